# Fresh machine: `make test` and `make demo` set up everything themselves
# (virtual environment, dependencies, native build) and then run.
# Every dependency list is pyproject.toml's: [build-system] requires (the build
# backend and TensorFlow), [project] dependencies, [dependency-groups] test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check
DEPS   := $(VENV)/.deps-stamp
TESTDEPS := $(VENV)/.test-deps-stamp
DOCSDEPS := $(VENV)/.docs-deps-stamp
NATIVE := $(VENV)/.native-stamp
NATIVE_SRC := CMakeLists.txt $(wildcard evstore/native/core/*.h evstore/native/tf/*.h evstore/native/tf/*.cc serving_loader/native/*.cc serving_loader/native/*.h)
# The Debian packages the gRPC front end of `evstore serve` builds on: libnghttp2
# (HTTP/2) and pkg-config, which CMake finds it with.
SYSTEM_PKGS := libnghttp2-dev pkg-config
# The Debian package of the `openssl` command, which the shard TLS test runs.
TEST_SYSTEM_PKGS := openssl
export TF_CPP_MIN_LOG_LEVEL ?= 2
SHELL := /bin/bash
# Runs the Python code given after it with `build` = pyproject.toml's [build-system].
BUILD_SYSTEM = $(BIN)/python -c 'import sys; toml = __import__("tomllib" if sys.version_info >= (3, 11) else "tomli"); \
	build = toml.load(open("pyproject.toml", "rb"))["build-system"]; exec(sys.argv[1])'

NATIVE_TESTS := build/native-tests

.PHONY: all install test test-native demo docs cli-docs bench bench-tools bench-peers soak clean system-packages

all: install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The build backend and TensorFlow go in first: the package is built without
# build isolation, against the venv's TensorFlow (a second, isolated copy of
# TensorFlow would be a ~600 MB install per build). Then what the backend asks
# for through its PEP 517 hook (CMake and Ninja when the system has none).
$(DEPS): pyproject.toml | $(BIN)/python
	$(PIP) install -q --upgrade pip
	@echo "evstore: installing the build requirements into $(VENV) (TensorFlow is a ~600 MB download the first time) ..."
	@$(BIN)/python -c 'import tomllib' 2>/dev/null || $(PIP) install -q tomli   # Python 3.10
	@$(BUILD_SYSTEM) 'print("\n".join(build["requires"]))' > $(VENV)/build-requirements.txt
	$(PIP) install -q -r $(VENV)/build-requirements.txt
	@$(BUILD_SYSTEM) 'import importlib; print("\n".join(importlib.import_module(build["build-backend"]).get_requires_for_build_editable()))' \
		> $(VENV)/backend-requirements.txt
	test ! -s $(VENV)/backend-requirements.txt || $(PIP) install -q -r $(VENV)/backend-requirements.txt
	touch $@

$(TESTDEPS): pyproject.toml | $(DEPS)
	$(PIP) install -q --group test
	touch $@

# $(call apt-install,PACKAGES,WHAT FOR,WITHOUT THEM): never prompts. As root a
# missing package is installed with apt-get -y; otherwise (or if apt-get
# fails) one line says what goes without it and what to install.
define apt-install
if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	echo "evstore: installing $(1) ($(2)) ..."; \
	export DEBIAN_FRONTEND=noninteractive; \
	apt-get install -y -q $(1) || (apt-get update -q && apt-get install -y -q $(1)) \
		|| echo "evstore: apt-get could not install $(1): $(3)"; \
else \
	echo "evstore: $(3); for $(2) install $(1) (Debian/Ubuntu: sudo apt-get install $(1))"; \
fi
endef

# libnghttp2 for the gRPC front end (without it the build goes on and
# `evstore serve` answers REST only); the `openssl` command, with which the
# shard TLS test makes its certificate (without it that test skips).
system-packages:
	@if pkg-config --exists libnghttp2 2>/dev/null; then :; else \
		$(call apt-install,$(SYSTEM_PKGS),HTTP/2 for the gRPC front end of evstore serve,building without the gRPC front end of evstore serve (REST only) - make clean install after installing them); fi
	@if command -v openssl >/dev/null; then :; else \
		$(call apt-install,$(TEST_SYSTEM_PKGS),the certificate of the shard TLS test,the shard TLS test will skip); fi

# The editable install compiles (scikit-build-core: CMake and Ninja, in
# parallel, incremental, through ccache) in the source tree, installs the
# runtime dependencies and the `evstore` command, and keeps the checkout
# importable by tests and tools. Shown: the build's progress lines; the whole
# log is $(VENV)/build.log (printed in part when the build fails).
$(NATIVE): $(DEPS) $(NATIVE_SRC) pyproject.toml | system-packages
	@echo "evstore: building the native op library and the gRPC front end (a few minutes the first time) ..."
	@$(PIP) install -v --no-build-isolation -e . 2>&1 | tee $(VENV)/build.log \
		| grep --line-buffered -E '^ *(\*\*\*|\[[0-9]+/[0-9]+\]|-- evstore:)|^Successfully installed'; \
	status=$${PIPESTATUS[0]}; if [ $$status -ne 0 ]; then tail -n 60 $(VENV)/build.log; \
		echo "evstore: the build failed (whole log: $(VENV)/build.log)"; exit $$status; fi
	touch $@

# pyproject's `docs` dependency group (MkDocs with Material, ~30 s from PyPI).
$(DOCSDEPS): pyproject.toml | $(DEPS)
	$(PIP) install -q --group docs
	touch $@

install: $(NATIVE)

# The suite on TEST_WORKERS processes (pytest-xdist), each test file on one of them (a file's
# module-scoped fixtures are built once), or in this one process with TEST_WORKERS=0. Two workers
# overlap the many tests that wait on other processes (docs/ARCHITECTURE.md, the suite's time budget).
# The core's C++ tests (test-native) run first.
TEST_WORKERS ?= 2
test: install test-native $(TESTDEPS) $(DOCSDEPS)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 tests

# The core's C++ tests (tests/native/CMakeLists.txt: -O3 -Wall -Wextra -Werror,
# ASan+UBSan, TSan for the tests with threads, the portable group probe),
# built by CMake and run by CTest. No compiler or no CMake: this fails.
test-native: $(DEPS)
	PATH=$(abspath $(BIN)):$$PATH cmake -S tests/native -B $(NATIVE_TESTS) -DPython_EXECUTABLE=$(abspath $(BIN)/python) >/dev/null
	PATH=$(abspath $(BIN)):$$PATH cmake --build $(NATIVE_TESTS) --parallel 2
	PATH=$(abspath $(BIN)):$$PATH ctest --test-dir $(NATIVE_TESTS) --parallel 2 --output-on-failure

demo: install
	$(BIN)/evstore demo

# The command-line reference page, rendered from evstore_app/cli.py's parser (tests/test_docs.py
# checks the committed page is current).
cli-docs: | $(BIN)/python
	$(BIN)/python -m evstore_app.cli_reference > docs/reference/cli.md

# The documentation site, into site/ (git-ignored); any broken link, anchor or page missing from
# mkdocs.yml's nav fails the build.
docs: $(DOCSDEPS) cli-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Benchmarks against peers (TFRA in its own venv .peer-tfra, made by bench/peers/tfra-setup.sh).
# bench/ is a package run from the repository root: any one benchmark is
# `$(BIN)/python -m bench.<area>.<name>` (bench/README.md lists them).
# The load generators bench/serving/bench_serving_net.py drives `evstore serve` with
# (wrk for REST, h2load for gRPC); as root they are installed with apt-get -y,
# otherwise one line says what to install and that benchmark reports itself skipped.
# On a shared machine, EVSTORE_BENCH_BIGMEM_LOCK=/tmp/<file> make bench runs each part estimated over
# 6 GiB (EVSTORE_BENCH_BIGMEM_MIB) holding flock(2) on that file, as `flock <file> <command>` does.
BENCH_PKGS := wrk nghttp2-client
bench: install bench-tools
	$(BIN)/python -m bench.run

bench-tools:
	@if command -v wrk >/dev/null && command -v h2load >/dev/null; then :; else \
		$(call apt-install,$(BENCH_PKGS),the serving benchmark's load generators,bench_serving_net will report itself skipped); fi

bench-peers:
	bash bench/peers/tfra-setup.sh .peer-tfra

# The reliability soak (tests/soak/soak.py: a trainer on moto's S3 server, three
# replicas, random SIGKILLs, every answer checked); `make test` runs it for 3
# minutes. SOAK_MINUTES=120 make soak for the long run; the report goes to SOAK_OUT.
# SOAK_ARGS=--hosts: every process on a host of its own (network and mount namespaces; root).
SOAK_MINUTES ?= 30
SOAK_OUT ?= out/soak.json
SOAK_ARGS ?=
soak: install $(TESTDEPS)
	mkdir -p $(dir $(SOAK_OUT))
	$(BIN)/python tests/soak/soak.py --minutes $(SOAK_MINUTES) --out $(SOAK_OUT) $(SOAK_ARGS)

# The in-source CMake build (editable.mode = "inplace") and the libraries.
clean:
	rm -rf build *.egg-info .cmake .ninja_* .skbuild-info.json CMakeCache.txt CMakeFiles CMakeInit.txt build.ninja \
		cmake_install.cmake evstore/native/*.so serving_loader/native/*.so $(NATIVE)
