# Fresh machine: `make test` and `make demo` set up everything themselves
# (virtual environment, dependencies, native build) and then run.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-stamp
NATIVE := $(VENV)/.native-stamp
NATIVE_SRC := setup.py $(wildcard evstore/native/core/*.h evstore/native/tf/*.h evstore/native/tf/*.cc)
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: all install test demo bench bench-peers clean

all: install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(DEPS): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip "setuptools>=70" wheel
	$(BIN)/pip install -q --disable-pip-version-check "tensorflow==2.21.*" numpy pyarrow fsspec "apscheduler>=3.10,<4" \
		"starlette>=0.40" "uvicorn>=0.30" "prometheus_client>=0.20" "tqdm>=4.60" pytest "import-linter>=2.1"
	touch $@

# The op library builds against the venv's TensorFlow (tf.sysconfig flags);
# an editable install keeps the source tree importable by tests and tools.
$(NATIVE): $(DEPS) $(NATIVE_SRC)
	$(BIN)/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

install: $(NATIVE)

test: install
	$(BIN)/python -m pytest -q tests

demo: install
	$(BIN)/evstore demo

# Benchmarks against peers (TFRA in its own venv, see ../shared/peers/README.md).
bench: install
	$(BIN)/python bench/run.py

clean:
	rm -rf build *.egg-info evstore/native/*.so $(NATIVE)
