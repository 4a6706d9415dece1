# syntax=docker/dockerfile:1
# The operator image: `rlhf operator` (kopf) with the `operator` extra and nothing from the trainer.
# Build from the repository root:  docker build -t rlhf-operator:dev .
# The chart runs it as uid 10001 with a read-only root file system and an emptyDir at /tmp.

# The base: an exact Python patch release on Debian 12 by default. `make images` passes a Debian 12
# root file system made here (mmdebstrap, with Debian's python3 3.11 and python3-venv) instead, since
# no registry is reachable there. The same base in both stages, so the venv's interpreter link
# exists in the final image.
ARG PYTHON_BASE=python:3.11.14-slim-bookworm

FROM ${PYTHON_BASE} AS build

# pip's configuration: none by default (PyPI). `make images` mounts a wheelhouse made from the pip
# cache and points this at its pip.conf (no index, find-links there), so the build downloads nothing.
ARG PIP_CONFIG_FILE=/dev/null

# No pip cache in the layer, no version-check request.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A venv, so the final stage copies one directory with everything the operator needs.
RUN python3 -m venv /opt/venv

WORKDIR /src
# Only what the package build reads: the project file, the API package, the `rlhf` command and the
# operator package. Not the README: pyproject.toml names it as the package's long description, which
# nothing in the image reads, so the build gets a one-line stand-in and a README edit rebuilds nothing.
COPY pyproject.toml ./
COPY api/ api/
COPY cli/ cli/
COPY operator/ operator/
# A regular (not editable) install: the source tree stays in this stage. pip byte-compiles the
# modules here, since the running container cannot write .pyc files.
RUN echo "rlhf-operator: see README.md in the source repository" > README.md \
 && /opt/venv/bin/pip install ".[operator]"

FROM ${PYTHON_BASE}

# The non-root user the chart's securityContext names (runAsUser/runAsGroup 10001).
RUN groupadd --system --gid 10001 rlhf \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin rlhf

COPY --from=build /opt/venv /opt/venv

# venv first on PATH (for `rlhf`); no .pyc writes on a read-only root; logs unbuffered.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

USER 10001:10001

# kopf's liveness endpoint (/healthz) and the operator's Prometheus metrics (/metrics).
EXPOSE 8080 8000

# The chart passes the rest: --liveness http://0.0.0.0:8080/healthz and --all-namespaces or --namespace NS.
ENTRYPOINT ["rlhf", "operator"]
