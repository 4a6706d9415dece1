#!/usr/bin/env bash
# `make demo`: control plane, `helm install`, the operator, and examples/rlhfjob-tiny.yaml run to
# Succeeded with live progress (scripts/demo.py). Set-up (make setup) has run before this.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/demo.py "$@"
