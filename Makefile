# pegaflow: the two README commands and their parts.
#
#   make run    set the machine up for the server only (its dozen wheels, not the full lock),
#               then start pegaflow-server on its defaults
#   make test   set the machine up, then lint + nix check + offline Bazel check + bazel test //...
#
# Both are idempotent: set-up steps are skipped by stamps (lock hash, dpkg
# status, Bazel input hash) and Bazel caches test results, so a re-run on a
# set-up machine takes seconds.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
# Steps share the machine (apt, the venv, one Bazel server): never in parallel.
.NOTPARALLEL:

VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
# Bazel's venv toolchain (tools/python/venv.bzl) reuses this venv.
export PEGAFLOW_VENV := $(VENV)

PROTOS := $(wildcard proto/*.proto)
STUBS := $(PROTOS:.proto=_pb2.py) $(PROTOS:.proto=_pb2_grpc.py)

# Extra arguments: make run ARGS="--use-hugepages", make pytest ARGS="server/tests -x".
ARGS ?=
# make run's pool: a quarter of this machine's RAM (5gb on a 24 GiB machine),
# leaving room for vLLM engines next to it. make run POOL_SIZE=8gb to change it.
POOL_SIZE ?= $(shell awk '/^MemTotal:/ { g = int($$2 / 4 / 1048576); print (g < 1 ? 1 : g) "gb" }' /proc/meminfo)

.PHONY: help setup apt venv venv-server proto run test pytest lint format nix-check bazel-offline-check bazel-test clean

help:
	@echo "make run          install what is missing, start pegaflow-server (POOL_SIZE=, ARGS=... for flags)"
	@echo "make test         install what is missing, run lint, nix check, offline Bazel check, bazel test //..."
	@echo "make pytest       pytest directly on the source tree (ARGS=... to pick tests)"
	@echo "make proto        regenerate the gRPC stubs in proto/"
	@echo "make lint|format  ruff check + format --check | ruff format + fix"
	@echo "make clean        remove the stubs and Bazel's outputs (keeps .venv)"

# ---- set-up --------------------------------------------------------------

setup: apt venv proto

apt:
	@ci/apt.sh

venv: apt
	@ci/venv.sh

# What pegaflow-server imports and what building the package needs
# (third_party/requirements-server.lock + requirements-build.lock); a full venv
# already satisfies it. Enough for `make run` and for generating the stubs.
venv-server: apt
	@ci/venv.sh server

proto: $(STUBS)

# One generator for make, pip and Bazel (proto/generate.py). Stubs also depend
# on the locks that pin grpcio-tools and protobuf: a new one regenerates them.
proto/%_pb2.py proto/%_pb2_grpc.py: proto/%.proto proto/generate.py third_party/requirements-server.lock third_party/requirements-build.lock | venv-server
	@$(PY) proto/generate.py proto $<

# ---- the two commands ----------------------------------------------------

# Only the server's own dependencies: a fresh clone is serving in well under a
# minute (README), instead of the minutes the full lock takes to install.
run: apt venv-server proto
	exec $(VENV)/bin/pegaflow-server --pool-size $(POOL_SIZE) $(ARGS)

test: setup lint nix-check bazel-offline-check bazel-test

# ---- parts of `make test` ------------------------------------------------

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

nix-check: apt
	@ci/nix_check.sh

bazel-offline-check: venv
	@ci/bazel_offline_check.sh

# Every test in the repo, once: each tests/test_*.py is its own target.
bazel-test: venv
	bazel test //... $(ARGS)

# ---- development ---------------------------------------------------------

# pytest directly on the source tree (the same files bazel-test runs; not part of `make test`).
pytest: setup
	$(PY) -m pytest $(ARGS)

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	-bazel clean
	rm -f $(STUBS) $(PROTOS:.proto=_pb2.pyi)
