# Fresh machine: `make test` and `make demo` set up everything themselves
# (virtual environment, dependencies, native build) and then run.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-stamp
TESTDEPS := $(VENV)/.test-deps-stamp
NATIVE := $(VENV)/.native-stamp
NATIVE_SRC := setup.py $(wildcard evstore/native/core/*.h evstore/native/tf/*.h evstore/native/tf/*.cc serving_loader/native/*.cc)
# The gRPC front end's HTTP/2 library (Debian's libnghttp2-dev), installed when its header is missing.
NGHTTP2_H := /usr/include/nghttp2/nghttp2.h
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: all install test demo bench bench-peers clean

all: install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(DEPS): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip "setuptools>=70" wheel
	@echo "evstore: installing the dependencies into $(VENV) (TensorFlow is a ~600 MB download the first time) ..."
	$(BIN)/pip install --disable-pip-version-check "tensorflow==2.21.*" numpy pyarrow fsspec \
		"apscheduler>=3.10,<4" "prometheus_client>=0.20" "tqdm>=4.60" "orjson>=3.9" "uvloop>=0.19" "httptools>=0.6" "grpcio>=1.60" \
		"jsonschema>=4.18" "matplotlib>=3.7"
	# TF Serving's protos and stubs; --no-deps: its tensorflow pin must never replace the venv's TF 2.21
	$(BIN)/pip install -q --disable-pip-version-check --no-deps "tensorflow-serving-api==2.21.*"
	touch $@

# What only the tests need (pyproject's [test] extra): kept out of the first
# `make demo`; the S3 test runs moto's standalone server; h2 speaks raw HTTP/2
# to the gRPC port for what a gRPC client never sends.
$(TESTDEPS): pyproject.toml | $(DEPS)
	$(BIN)/pip install -q --disable-pip-version-check pytest "import-linter>=2.1" s3fs "moto[server]" h2
	touch $@

# The op library builds against the venv's TensorFlow (tf.sysconfig flags),
# in place and in view (one progress line per file; pip would hide them); the
# editable install then reuses it (no second compile) and keeps the source
# tree importable by tests and tools.
$(NGHTTP2_H):
	@echo "evstore: installing libnghttp2-dev (HTTP/2 for the gRPC front end of evstore serve) ..."
	$(SUDO) apt-get install -y -q libnghttp2-dev || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q libnghttp2-dev)

$(NATIVE): $(DEPS) $(NATIVE_SRC) | $(NGHTTP2_H)
	@echo "evstore: building the native op library and the gRPC front end (13 C++ files, in parallel; a few minutes the first time) ..."
	$(BIN)/python setup.py -q build_ext --inplace
	$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

install: $(NATIVE)

test: install $(TESTDEPS)
	$(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/evstore demo

# Benchmarks against peers (TFRA in its own venv, see ../shared/peers/README.md).
bench: install
	$(BIN)/python bench/run.py

clean:
	rm -rf build *.egg-info evstore/native/*.so serving_loader/native/*.so $(NATIVE)
