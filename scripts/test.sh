#!/usr/bin/env bash
# `make test`: set-up, the local control plane, lint, then every test group, with each stage's time.
# Every pytest stage must collect tests (exit 5 is a failure). Ends with one "N passed, N failed" line.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RESULTS=$(mktemp -d)
declare -a STAGES=()
status=0

stage() {  # stage NAME CMD...
  local name=$1; shift
  local t0=$SECONDS
  echo; echo "=== [$name] $*"
  "$@"; local rc=$?
  STAGES+=("$(printf '%-14s %5ds  rc=%d' "$name" $((SECONDS - t0)) "$rc")")
  return $rc
}

pytest_stage() {  # pytest_stage NAME ARGS...
  local name=$1; shift
  stage "$name" "$PY" -m pytest --junitxml="$RESULTS/$name.xml" -p no:cacheprovider "$@"
  local rc=$?
  if [ $rc -eq 5 ]; then echo "error: stage $name collected no tests" >&2; fi
  return $rc
}

summary() {
  echo; echo "=== stage times"
  printf '%s\n' "${STAGES[@]}"
  "$PY" - "$RESULTS" <<'PY' 2>/dev/null || echo "0 passed, 1 failed"
import sys, pathlib, xml.etree.ElementTree as ET
p = f = s = 0
for x in pathlib.Path(sys.argv[1]).glob("*.xml"):
    for suite in ET.parse(x).getroot().iter("testsuite"):
        t = int(suite.get("tests", 0)); e = int(suite.get("errors", 0)); fl = int(suite.get("failures", 0)); sk = int(suite.get("skipped", 0))
        p += t - e - fl - sk; f += e + fl; s += sk
print(f"{p} passed, {f} failed" + (f", {s} skipped" if s else ""))
PY
}

stage setup scripts/setup.sh || { summary; exit 1; }
started_cluster=0
if ! python3 devcluster/devcluster.py status >/dev/null 2>&1; then started_cluster=1; fi
stage cluster-build python3 devcluster/devcluster.py build || { summary; exit 1; }
stage cluster-up python3 devcluster/devcluster.py up || { summary; exit 1; }

stage lint make -s lint || status=1
pytest_stage unit tests -m unit || status=1
pytest_stage cluster tests -m cluster || status=1
pytest_stage security tests -m security || status=1
pytest_stage alerting tests -m alerting || status=1
pytest_stage trainer tests -m trainer || status=1
pytest_stage reliability tests -m reliability || status=1
# The user's path on the real node: the images built here (content-hashed, seconds when unchanged),
# the chart installed with them, the tiny job in real pods (docs/development.md, "The real node").
stage images python3 images/build_images.py all --keep-runtime || status=1
pytest_stage realnode tests -m realnode || status=1

if [ $started_cluster = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
  python3 devcluster/devcluster.py down >/dev/null 2>&1 || true
fi
summary
exit $status
