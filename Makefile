# rlhf-operator: the README's two commands are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
DEVCLUSTER := python3 devcluster/devcluster.py
# mypy's cache outside the checkout, so a fresh clone (CI) checks in seconds what has not changed
# (mypy validates each entry against its source's hash); a clean checkout took about 2 min.
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/rlhf-operator/mypy

.PHONY: setup test images images-gpu test-images demo cluster-build cluster-up cluster-down cluster-status kueue-up kueue-down lint crd bench clean

setup: ## Create .venv with everything (idempotent; fast when done)
	@scripts/setup.sh

test: ## The full suite: lint, unit, cluster, chart/alerts and trainer tests (prints stage times)
	@scripts/test.sh

images: ## Build the operator and CPU trainer images here (no registry) and load them into containerd
	@python3 images/build_images.py all

images-gpu: ## Build the GPU trainer image here (about 10 GB, not part of `make test`) and check it with no GPU
	@python3 images/build_images.py trainer-gpu

test-images: setup ## Run the built images with containerd: uid, read-only root, imports, tiny model
	@$(PY) -m pytest tests/e2e/images -m images

demo: setup ## The first command: control plane + Helm chart + a tiny RLHFJob run to Succeeded
	@scripts/demo.sh

cluster-build: ## Build the control-plane binaries from the Go module proxy (cached in ~/.cache/rlhf-operator)
	@$(DEVCLUSTER) build

cluster-up: ## Start etcd, kube-apiserver, controller-manager, scheduler, KWOK and KubeRay on loopback
	@$(DEVCLUSTER) up

cluster-down: ## Stop the control plane and remove its state
	@$(DEVCLUSTER) down

cluster-status:
	@$(DEVCLUSTER) status

kueue-up: ## Start Kueue (built from the Go module proxy if needed) in the running control plane
	@$(DEVCLUSTER) kueue-up

kueue-down: ## Stop Kueue and remove its webhooks (its CRDs stay)
	@$(DEVCLUSTER) kueue-down

lint: setup ## ruff, mypy, the import-layer contracts (lint-imports) and the operator's function size
	@$(VENV)/bin/ruff check api cli operator trainer_image devcluster tests benchmarks scripts images
	@$(VENV)/bin/ruff format --check api cli operator trainer_image devcluster tests benchmarks scripts images
	@$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)
	@$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE) --strict images/build_images.py images/containerd_runtime.py images/image_recipe.py
	@$(VENV)/bin/lint-imports --no-logo
	@# Every function of the operator package under 60 lines (the state machine's steps stay small; docs/architecture.md).
	@$(PY) scripts/lint_function_size.py
	@# Every collected test is in a stage of `make test` (tests/testkit/stages.py fails the collection otherwise).
	@$(PY) -m pytest --collect-only -q -p no:cacheprovider tests >/dev/null || { $(PY) -m pytest --collect-only -q -p no:cacheprovider tests | tail -5; exit 1; }

crd: setup ## Regenerate crds/ and the chart's copy from the pydantic model
	@$(PY) -m rlhf_api.crd --write

bench: setup ## Run every benchmark (not tests; see docs/benchmarks.md)
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean: cluster-down
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
