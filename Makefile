# providerd: the one way to do each job.
#
#   make demo         run the demo provider in the foreground and show it working
#   make test         install what the tests need, then every tier: lint unit integration system vm
#   make lint|unit|integration|system|vm   one tier
#   make deb          dist/providerd_<version>_all.deb
#   make bench        every bench/bench_*.py, in one go
#   make fuzz         the property-based tests with a long budget (FUZZ_EXAMPLES=20000 each)
#   make soak         1,000 activation → request → release cycles in the container (bench/soak.py)
#
# Each tier is one pytest run (or lint); its output is kept in .work/logs/<tier>.log.
# pytest's "no tests collected" (exit 5) fails a tier like any other failure.

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

SYSTEM_PATH := /usr/sbin:/usr/bin:/sbin:/bin
VENV := .venv
PY := $(VENV)/bin/python
WORK := .work
TIER := .ci/tier
PYTEST_FLAGS ?=

VERSION := $(shell awk 'NR == 1 { gsub(/[()]/, "", $$2); print $$2 }' packaging/debian/changelog)
DEB := dist/providerd_$(VERSION)_all.deb
DEB_INPUTS := $(shell git ls-files -co --exclude-standard agent units packaging docs examples pyproject.toml README.md 2>/dev/null)

# Debian packages: what the venv and `make demo` need, then what the test tiers add.
# (The .deb's own dependencies come from its control file.)
BASE_PACKAGES := python3 python3-venv python3-systemd python3-dbus-next python3-uvloop python3-prometheus-client curl git ca-certificates
TEST_PACKAGES := \
	systemd systemd-container dbus debootstrap qemu-system-x86 util-linux iproute2 procps \
	debhelper dh-python pybuild-plugin-pyproject python3-all python3-setuptools \
	build-essential fakeroot dpkg-dev lintian zstd e2fsprogs python3-hypothesis
PIP_PACKAGES := pytest ruff mypy
# Only for the tests (never the .deb): schemas and CEL for validating `providerctl export kubernetes`,
# and the official openai client that the integration and container tiers talk to providers with.
TEST_PIP_PACKAGES := kubernetes-validate cel-python pyyaml openai

.PHONY: help test deps venv lint unit integration system vm deb lintian bench soak demo fuzz clean

help:
	@sed -n '2,13s/^# \{0,1\}//p' Makefile

test: lint unit integration system vm

# --- set-up -------------------------------------------------------------------

deps: $(WORK)/apt.stamp

# apt_install STAMP PACKAGES: install what is missing (as root), then touch STAMP.
define apt_install
	@mkdir -p $(WORK)
	@missing=$$(for p in $(2); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q '^install ok installed' || echo $$p; done); \
	if [[ -n $$missing ]]; then \
		if [[ $$(id -u) != 0 ]]; then echo "make: missing Debian packages:" $$missing "(run as root, or apt-get install them)" >&2; exit 1; fi; \
		echo "apt-get install" $$missing; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq; \
		apt-get install -y -qq --no-install-recommends $$missing >$(WORK)/apt.log 2>&1 || { tail -n 30 $(WORK)/apt.log >&2; exit 1; }; \
	fi
	@touch $(1)
endef

$(WORK)/apt-base.stamp: Makefile
	$(call apt_install,$@,$(BASE_PACKAGES))

$(WORK)/apt.stamp: $(WORK)/apt-base.stamp
	$(call apt_install,$@,$(TEST_PACKAGES))

venv: $(VENV)/.stamp

$(VENV)/.stamp: $(WORK)/apt-base.stamp pyproject.toml Makefile
	@test -x $(PY) || PATH=$(SYSTEM_PATH) /usr/bin/python3 -m venv --system-site-packages $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check $(PIP_PACKAGES) $(TEST_PIP_PACKAGES)
	@$(PY) -m pip install -q --disable-pip-version-check -e .
	@touch $@

# --- tiers --------------------------------------------------------------------

LINT_PATHS = $(wildcard agent tests bench examples)

lint: venv deps
	@$(TIER) lint bash -c 'rc=0; \
		$(VENV)/bin/ruff check --extend-exclude agent/_vendor $(LINT_PATHS) || rc=1; \
		$(VENV)/bin/ruff format --check --extend-exclude agent/_vendor $(LINT_PATHS) || rc=1; \
		$(VENV)/bin/mypy --strict agent || rc=1; \
		exit $$rc'

unit: venv deps
	@$(TIER) unit $(PY) -m pytest tests/unit $(PYTEST_FLAGS)

integration: venv deps
	@$(TIER) integration $(PY) -m pytest tests/integration $(PYTEST_FLAGS)

system: venv deb
	@$(TIER) system $(PY) -m pytest tests/system --run-system --deb=$(DEB) -rA $(PYTEST_FLAGS)

vm: venv deb
	@$(TIER) vm $(PY) -m pytest tests/vm --run-vm --deb=$(DEB) -rA $(PYTEST_FLAGS)

# --- package ------------------------------------------------------------------

deb: $(DEB)

$(DEB): $(WORK)/apt.stamp $(DEB_INPUTS)
	@PATH=$(SYSTEM_PATH) packaging/build-deb.sh dist

lintian: $(DEB)
	@PATH=$(SYSTEM_PATH) lintian --fail-on error,warning -I --pedantic $(DEB)

# --- the rest -----------------------------------------------------------------

bench: venv deps
	@$(TIER) bench bash -c 'shopt -s nullglob; set -- bench/bench_*.py; \
		(( $$# )) || { echo "make bench: no bench/bench_*.py" >&2; exit 1; }; \
		for b; do echo "== $$b"; $(PY) "$$b"; done'

FUZZ_EXAMPLES ?= 20000

fuzz: venv deps
	@$(TIER) fuzz env PROVIDERD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest tests/unit/test_properties.py \
		--hypothesis-profile=fuzz -p no:cacheprovider $(PYTEST_FLAGS)

soak: venv deb
	@$(TIER) soak $(PY) bench/soak.py --deb=$(DEB)

demo: venv
	@examples/demo.sh

clean:
	rm -rf dist build $(WORK) .pytest_cache .mypy_cache .ruff_cache
