# kvbridge developer entry points. `make test` and `make demo` are the two commands the
# README gives; everything they need is installed here, on a fresh machine too.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
PIP := $(PY) -m pip --disable-pip-version-check -q

# The CPU build of torch 2.13.0 is served from a local file on these machines; installing it
# first keeps any later `torch` requirement (nixl's wheel has one) from pulling a CUDA build.
TORCH_SPEC ?= torch==2.13.0
NIXL_SPEC ?= nixl-cu12==1.5.1

.PHONY: venv test lint bench soak clean test-stack node-images vllm-venv demo docs

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml testkit/pyproject.toml
	@echo ">> creating $(VENV) (first run installs torch CPU, NIXL and the project)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install --no-deps "$(NIXL_SPEC)"
	$(PIP) install -e '.[test]' -e ./testkit
	touch $@

lint: venv
	$(BIN)/ruff check agent operator router testkit tests bench demo

# A real kube-apiserver, kube-controller-manager and etcd for the operator, chart and e2e
# tests; the first build takes ~7-10 minutes and is cached under /var/cache/kvbridge.
test-stack: venv
	PYTHON=$(PY) bash hack/test-stack.sh ensure

# The images the real-node tests run (tests/node): the operator, agent and vLLM images from the
# Dockerfile, built with buildah over a Debian base made here, and the pod sandbox image.
# ~3 minutes the first time (and ~5 more for the vLLM serving image), rebuilt when their
# sources change; cached under /var/cache/kvbridge.
node-images: test-stack
	bash hack/node-images.sh ensure

# Real vLLM 0.30.0 engines (CPU build) for tests/vllm_engines and bench/bench_vllm.py, in a
# venv of their own outside the repository (vLLM pins its own torch and friends): ~5 minutes
# the first time, cached under /var/cache/kvbridge.
vllm-venv: venv
	bash hack/vllm-venv.sh ensure

test: venv lint test-stack node-images vllm-venv
	$(PY) -m pytest

# The whole flow on a local control plane: chart, operator, simulated P/D pods with real
# NIXL transfers, an incompatible pod refused. Builds the control plane on first use.
demo: venv
	$(PY) demo/run_demo.py

# The generated references in docs/reference/: CRD fields (crds/), Prometheus metrics (the
# agent's, operator's and router's registries) and the chart's alerts (its PrometheusRule,
# rendered with the test stack's helm: `make test-stack` fetches it). tests/unit and
# tests/chart fail while a committed file differs from what this writes.
docs: venv
	$(PY) -m kvbridge_testkit.docs_reference

bench: venv vllm-venv node-images
	@set -e; for b in bench/bench_*.py; do [ $$b = bench/bench_soak.py ] && continue; \
		echo ">> $$b" >&2; $(PY) $$b; done

# The 30-minute soak of the serving stack on the real node (bench/bench_soak.py): not in bench.
soak: venv vllm-venv node-images
	$(PY) bench/bench_soak.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
