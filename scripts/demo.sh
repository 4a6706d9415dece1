#!/usr/bin/env bash
# Placeholder until the demo issue: will start the control plane, install the chart with Helm, run the
# operator locally, apply examples/rlhfjob-tiny.yaml and follow it to Succeeded.
set -euo pipefail
echo "make demo: not built yet. It will: set up, start the local control plane, helm install the chart,"
echo "run the operator locally, apply examples/rlhfjob-tiny.yaml and show live progress until Succeeded."
