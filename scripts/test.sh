#!/usr/bin/env bash
# `make test`: set-up, the local control plane, then every test group with lint beside them, with each stage's time.
# Every pytest stage must collect tests (exit 5 is a failure). Ends with one "N passed, N failed" line.
# A stage collects only its paths (the whole tree's imports cost about 12 s a stage); the unit stage and
# `make lint` collect the whole tree, where tests/testkit/stages.py fails a test its stages do not reach.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
RESULTS=$(mktemp -d)
declare -a STAGES=()
status=0

cpu_ticks() {  # "BUSY TOTAL": the machine's CPU ticks so far, from /proc/stat (iowait counts as idle)
  local _c u n s i w q sq st
  read -r _c u n s i w q sq st _ </proc/stat
  echo "$((u + n + s + q + sq + st)) $((u + n + s + i + w + q + sq + st))"
}

stage() {  # stage NAME CMD...: its time, exit status and how busy the machine's cores were meanwhile
  local name=$1; shift
  local t0=$SECONDS b0 a0 b1 a1
  read -r b0 a0 <<<"$(cpu_ticks)"
  echo; echo "=== [$name] $*"
  "$@"; local rc=$?
  read -r b1 a1 <<<"$(cpu_ticks)"
  STAGES+=("$(printf '%-14s %5ds  rc=%d  cpu %3d%%' "$name" $((SECONDS - t0)) "$rc" $(((b1 - b0) * 100 / (a1 - a0 > 0 ? a1 - a0 : 1))))")
  return $rc
}

pytest_stage() {  # pytest_stage NAME ARGS...
  local name=$1; shift
  stage "$name" "$PY" -m pytest --junitxml="$RESULTS/$name.xml" -p no:cacheprovider "$@"
  local rc=$?
  if [ $rc -eq 5 ]; then echo "error: stage $name collected no tests" >&2; fi
  return $rc
}

declare -A BG_PID=() BG_T0=()
bg_start() {  # bg_start NAME CMD...: CMD in the background at the lowest CPU priority, its output in $RESULTS/NAME.log
  local name=$1; shift
  echo; echo "=== [$name] started in the background (SCHED_IDLE): $*"
  BG_T0[$name]=$SECONDS
  # SCHED_IDLE: CPU only when nothing else wants it (Ray runs its workers at nice 15, near nice 19).
  setsid chrt --idle 0 nice -n 19 "$@" >"$RESULTS/$name.log" 2>&1 </dev/null &  # its own process group
  BG_PID[$name]=$!
}

bg_join() {  # bg_join NAME: waits for a background stage, shows its output, records its time
  local name=$1 t0=$SECONDS rc
  echo; echo "=== [$name] joining the background stage"
  wait "${BG_PID[$name]}"; rc=$?
  if [ $rc -eq 0 ]; then tail -n 12 "$RESULTS/$name.log"; else cat "$RESULTS/$name.log"; fi
  STAGES+=("$(printf '%-14s %5ds  rc=%d  (background; waited %ds)' "$name" $((SECONDS - BG_T0[$name])) "$rc" $((SECONDS - t0)))")
  unset "BG_PID[$name]"
  return $rc
}

# One local Ray head (the stand-in for every RayCluster's head) for the stages from `cluster` to `alerting`:
# their `ray_head` fixture finds it up and leaves it running (one per stage cost ~12 s to start and stop).
# Not up during the trainer stage, whose `rlhf run`s start their own Ray, nor the real-node run.
ray_head() {  # ray_head start|stop (testkit/ray_head.py; the head gets this script's environment, as from pytest)
  "$PY" -c 'import sys; sys.path.insert(0, "tests"); from testkit.ray_head import main; sys.exit(main())' \
    "$1" --dir "$RESULTS"
}

# A background stage never outlives the run, nor does the Ray head.
trap 'for p in "${BG_PID[@]}"; do kill -- "-$p" 2>/dev/null; done; ray_head stop >/dev/null 2>&1' EXIT

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

# Cold, the builds are most of the run. The images (mostly disk and network) are built in the background
# beside everything up to `cluster-up`; the binaries `up` runs, beside the trainer tests (which
# need no cluster); the binaries only some stages use (Prometheus, the floor API server), beside the
# stages after `cluster-up`. A background stage runs at the lowest CPU priority, so it takes only the CPU
# the foreground leaves idle, and is joined before the first stage that needs it. Warm, each takes seconds.
stage containerd python3 images/build_images.py runtime-up || { summary; exit 1; }
bg_start images python3 images/build_images.py all --keep-runtime
stage setup scripts/setup.sh || { summary; exit 1; }
started_cluster=0
if ! python3 devcluster/devcluster.py status >/dev/null 2>&1; then started_cluster=1; fi
bg_start cluster-build python3 devcluster/devcluster.py build up

pytest_stage trainer tests/e2e/ray -m trainer || status=1
# The GPU path on Ray's logical GPUs: `rlhf plan` on four geometries (the real-node run is in realnode).
pytest_stage gpushape tests/e2e/gpushape -m "gpushape and not realnode" || status=1
bg_join cluster-build || { summary; exit 1; }
bg_start test-binaries python3 devcluster/devcluster.py build test
bg_join images || status=1
# The built images run by containerd the way a node runs them (uid, read-only root, imports, tiny model).
pytest_stage images tests/e2e/images -m images || status=1
stage cluster-up python3 devcluster/devcluster.py up || { summary; exit 1; }
# Unit tests are CPU-bound and independent: two pytest-xdist workers use both cores (the chart's unit
# tests run the Helm built above).
pytest_stage unit tests -m unit -n 2 || status=1
# Lint (about 3 min of CPU) beside the cluster tests, which mostly wait on the operator and the control
# plane: at the lowest priority it only takes the CPU they leave idle.
bg_start lint make -s lint
stage ray-head ray_head start || { summary; exit 1; }
pytest_stage cluster tests/e2e/cluster -m cluster || status=1
# Object stores and tracking against real servers started by the fixtures (moto's S3 server, an MLflow
# server): s3:// datasets, exports, model fetches and tracking sinks, mostly without pods (docs/development.md).
pytest_stage io tests/e2e/io -m io || status=1
bg_join lint || status=1
# Jobs on platform runtimes (docs/runtimes.md): the pods they get, generations, failures, per-job claims.
pytest_stage runtime tests/e2e/cluster/test_runtimes.py -m "runtime and not unit and not realnode" || status=1
pytest_stage security tests/e2e/security -m "security and not realnode" || status=1
pytest_stage reliability tests/e2e/reliability -m reliability || status=1
bg_join test-binaries || status=1
# A real Kueue (built with the test binaries) over the operator: quota, preemption, no fight (docs/kueue.md).
pytest_stage kueue tests/e2e/kueue -m kueue || status=1
pytest_stage alerting tests/e2e/alerting -m alerting || status=1
ray_head stop
# The user's path on the real node: the chart installed with the images built above, the tiny job in real
# pods (docs/development.md, "The real node").
pytest_stage realnode tests/e2e/realnode -m realnode || status=1
pytest_stage floor tests/e2e/cluster/test_kubernetes_floor.py -m floor || status=1

if [ $started_cluster = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
  python3 devcluster/devcluster.py down >/dev/null 2>&1 || true
fi
summary
exit $status
