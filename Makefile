# atom_sched developer and CI entry point. `make test` runs every test suite.
#
# The machine has 2 cores: every build here uses at most 2 jobs (JOBS=1 to go lower).

SHELL := /bin/bash
.DEFAULT_GOAL := test

JOBS   ?= 2
PYTHON ?= python3
CMAKE  ?= cmake
CTEST  ?= ctest
VENV   := .venv
VPY    := $(CURDIR)/$(VENV)/bin/python
VPIP   := $(VPY) -m pip

# Build and test tools for the venv; keep in step with pyproject.toml's build-system and extras.
VENV_PACKAGES := "scikit-build-core>=0.10" "pybind11>=2.12" "numpy>=1.24" pytest hypothesis xxhash \
                 ninja "cmake>=3.25" matplotlib tqdm pyzmq msgpack

CPP_DIR  := build/cpp
ASAN_DIR := build/asan
CMAKE_COMMON := -G Ninja -DATOM_SCHED_BUILD_TESTS=ON -DATOM_SCHED_BUILD_PYTHON=OFF
SANITIZER_ENV := ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1

.PHONY: help venv install demo build-cpp test-cpp build-asan test-asan test-python test bench clean distclean

help:
	@echo "make demo          build, install and run the toy engine loop"
	@echo "make test          all suites: C++ (Release), C++ under ASan+UBSan, Python"
	@echo "make test-cpp      GoogleTest suites, Release build in $(CPP_DIR)"
	@echo "make test-asan     GoogleTest suites with ASan+UBSan in $(ASAN_DIR)"
	@echo "make test-python   pip-install the package into $(VENV), then pytest tests/python"
	@echo "make install       (re)build and install the package into $(VENV)"
	@echo "make bench         run the benchmarks (atom-sched bench)"
	@echo "make clean         remove build trees; make distclean also removes $(VENV)"

# ---- Python environment --------------------------------------------------------------------------
venv: $(VENV)/.stamp

$(VENV)/.stamp:
	$(PYTHON) -m venv $(VENV)
	$(VPIP) install --disable-pip-version-check -q $(VENV_PACKAGES)
	touch $@

# No build isolation: the venv's scikit-build-core, pybind11, cmake and ninja build in the
# persistent build/<wheel_tag> tree, so a re-install only recompiles what changed.
install: venv
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(VPIP) install --disable-pip-version-check \
	  --no-build-isolation -v .

# ---- C++ -----------------------------------------------------------------------------------------
$(CPP_DIR)/build.ninja: Makefile
	$(CMAKE) -S . -B $(CPP_DIR) $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=Release \
	  -DATOM_SCHED_BUILD_BENCHMARKS=ON -DATOM_SCHED_SANITIZE=OFF

$(ASAN_DIR)/build.ninja: Makefile
	$(CMAKE) -S . -B $(ASAN_DIR) $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DATOM_SCHED_BUILD_BENCHMARKS=OFF -DATOM_SCHED_SANITIZE=ON

build-cpp: $(CPP_DIR)/build.ninja
	$(CMAKE) --build $(CPP_DIR) -j $(JOBS)

build-asan: $(ASAN_DIR)/build.ninja
	$(SANITIZER_ENV) $(CMAKE) --build $(ASAN_DIR) -j $(JOBS)

test-cpp: build-cpp
	$(CTEST) --test-dir $(CPP_DIR) --output-on-failure -j $(JOBS)

test-asan: build-asan
	$(SANITIZER_ENV) $(CTEST) --test-dir $(ASAN_DIR) --output-on-failure -j $(JOBS)

# ---- Python --------------------------------------------------------------------------------------
# pytest runs from tests/python so that the in-tree atom_sched/ (which has no compiled _core) cannot
# shadow the installed package; the rootdir and settings still come from ./pyproject.toml.
test-python: install
	cd tests/python && $(VPY) -m pytest -q .

test: test-cpp test-asan test-python

# The toy engine loop (examples/toy_engine.py): continuous batching, chunked prefill, prefix
# caching and preemption driven by a stand-in model.
demo: install
	cd examples && $(VPY) toy_engine.py --spec 2 --async

bench: install
	$(VENV)/bin/atom-sched bench

clean:
	rm -rf build dist *.egg-info .hypothesis tests/python/.hypothesis .pytest_cache bench_out
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
