"""Agentic rollouts: multi-turn episodes with tools, token in and token out (issue 37)."""
