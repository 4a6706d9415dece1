"""The shared test support, one importable package: the control plane's handles, jobs and waits
(`support`), Helm rendering (`chart_tools`), inputs of the pure status decision (`status_inputs`), the
stage table (`stages`), the trainer runs (`trainer_runs`, `weight_sync_check`), the checks on one real
vLLM engine (`real_engine_checks`), a controllable reward (`control_reward`), the monitoring stack
(`monitored`, `monitoring_stack`) and agentic rollout's test doubles (`agent_doubles`).

Test modules import from here; no test module imports another, and nothing edits `sys.path` (pytest's
`pythonpath` in pyproject.toml puts `tests/` on it).
"""

from pathlib import Path

TESTKIT = Path(__file__).resolve().parent
"""This package's folder: scripts in it run as files (weight_sync_check.py, control_reward.py)."""
