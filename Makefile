# opforge front door. Each target sets itself up on a fresh machine:
#   make demo   the brief's example end to end + a short benchmark table
#   make test   the fast tier (minutes): lint, ABI drift check, the native C tests and the Python
#               tests not marked slow (torch.compile on the aot_eager backend: fake kernels and wiring)
#   make test-full  everything (what CI runs): the fast tier's checks, the C tests under a thread
#               sweep, the AVX-512 variants over SIMDe on CPUs without them, every Python test
#               (torch.compile on inductor, AOTInductor, HF models, distributed, fuzz on fixed seeds)
#               and a short `make sanitize`
#   make cuda   the CUDA library (python/opforge/libopforge_cuda.so) with nvcc; `make build` builds it too
#               where nvcc is found (OPFORGE_CUDA=0 leaves it out)
#   make gpu-check  on a machine with a GPU: builds with that machine's python3 and torch, runs the CUDA
#               tests and benchmarks, prints the table (CSV and markdown to $$OUT when set)
#   make bench  the full benchmarks (CSV, markdown, PNG under benchmarks/results/)
#   make lint   clang-format (C) and ruff (Python) checks; make format applies them
#   OPFORGE_NAMESPACE=acme_ops_1a2b make clean build
#               the ops as torch.ops.acme_ops_1a2b (default: torch.ops.opforge)
#   make test-other-torch TORCH_WHEEL=...  the Python tests of the library as built
#               (against the pinned torch) under another torch release, in .venv-other/
#   make fuzz   random cases of every op against float64 PyTorch, for FUZZ_SECONDS, on a fresh seed
#   make sanitize  the C tests and a short fuzz with AddressSanitizer + UndefinedBehaviorSanitizer
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
LIB    := python/opforge/libopforge.so
CUDA_LIB := python/opforge/libopforge_cuda.so
CSRC   := $(shell find csrc -name '*.c' -o -name '*.h')
CUSRC  := $(shell find csrc -name '*.cu' -o -name '*.cuh')
TORCH_INCLUDE = $(shell $(PY) -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")

.PHONY: cuda ctest-cuda gpu-check
.PHONY: all setup build demo test test-full ctest ctest-full ctest-emulated ctest-threads abi-check pytest pytest-full test-other-torch bench bench-smoke fuzz sanitize lint format clean

all: build

$(VENV)/.installed: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

setup: $(VENV)/.installed

$(LIB): $(VENV)/.installed $(CSRC) $(CUSRC) setup.py python/opforge/_build.py
	$(PY) setup.py -q build_ext --inplace

build: $(LIB)

# The CUDA library: nvcc for the .cu files (sm_80 and sm_90 SASS, sm_90 PTX), the C compiler for the glue.
cuda: $(VENV)/.installed $(CSRC) $(CUSRC) setup.py python/opforge/_build.py
	OPFORGE_CUDA=1 $(PY) setup.py -q build_ext --inplace

# The CUDA kernels' C tests, on the CPU: each tests/cuda/test_<op>.c with csrc/cuda/<op>.cu compiled as
# C++ over tests/emu/cuda_emu.h (a fiber per GPU thread), against the C reference kernels.
CUDA_CTESTS := $(patsubst tests/cuda/%.c,build/ctest-cuda/%,$(sort $(wildcard tests/cuda/test_*.c)))
build/ctest-cuda/test_%: tests/cuda/test_%.c csrc/cuda/%.cu tests/c/check.h tests/emu/cuda_emu.h $(CSRC) $(CUSRC) python/opforge/_build.py | $(VENV)/.installed
	$(PY) python/opforge/_build.py $@ $< csrc/cuda/$*.cu $(wildcard csrc/runtime/*.c) $(wildcard csrc/kernels/*.c) -I csrc/include

ctest-cuda: $(CUDA_CTESTS)
	@for t in $(CUDA_CTESTS); do echo "./$$t"; ./$$t || exit 1; done

# One script for a machine with a GPU (python3 and torch as they are there: no venv, no downloads).
gpu-check:
	bash tests/gpu/gpu_check.sh

demo: build
	$(PY) examples/dispersion_correction.py

# Every C file is compiled once per distinct command into build/obj (python/opforge/_build.py names
# objects by a digest of their command): the library and every C test binary share the plain objects,
# and a -D reaches only the files that read its macro, so a test's build parameter recompiles one file.
CBUILD = $(PY) python/opforge/_build.py $@ $< $(wildcard csrc/runtime/*.c) $(wildcard csrc/kernels/*.c) -I csrc/include

build/ctest/test_%: tests/c/test_%.c tests/c/check.h $(CSRC) python/opforge/_build.py | $(VENV)/.installed
	$(CBUILD)

# the AMX kernel over a C model of its tile instructions, for CPUs without AMX
build/ctest/test_gemm_amx_emulated: tests/c/test_gemm.c tests/c/check.h $(CSRC) python/opforge/_build.py | $(VENV)/.installed
	$(CBUILD) -D OPF_AMX_EMULATE

# attention's AMX table over the same model
build/ctest/test_attention_amx_emulated: tests/c/test_attention.c tests/c/check.h $(CSRC) python/opforge/_build.py | $(VENV)/.installed
	$(CBUILD) -D OPF_AMX_EMULATE

# attention with the forward's keys split into chunks on (almost) every shape, not only the fewest query blocks
build/ctest/test_attention_split: tests/c/test_attention.c tests/c/check.h $(CSRC) python/opforge/_build.py | $(VENV)/.installed
	$(CBUILD) -D ATTENTION_FWD_MIN_TASKS=64

# every tests/c/test_*.c and the AMX kernel over a model of its tile instructions; attention split
# (the same test with the forward's keys split on every shape) runs in the full tier
CTESTS := $(patsubst tests/c/%.c,build/ctest/%,$(sort $(wildcard tests/c/test_*.c))) build/ctest/test_gemm_amx_emulated \
	build/ctest/test_attention_amx_emulated

# The same tests with the AVX-512 (and AMX) variants compiled for AVX2 over
# SIMDe (tests/emu/immintrin.h): their logic is tested on CPUs without AVX-512.
# SIMDe's headers come with the venv (cmeel-simde in requirements-dev.txt).
# A CPU that runs every AVX-512 variant natively (AVX-512 F/BW/VL/DQ and BF16)
# tests them in `make ctest`: there the emulated pass adds only time, and
# `make test-full` leaves it out (saying so); `make ctest-emulated` still runs it.
EMU_CTESTS := $(patsubst tests/c/%.c,build/ctest-emu/%,$(sort $(wildcard tests/c/test_*.c))) build/ctest-emu/test_gemm_amx_emulated
NATIVE_AVX512 := $(shell for f in avx512f avx512bw avx512vl avx512dq avx512_bf16; do \
	grep -qw $$f /proc/cpuinfo 2>/dev/null || exit 0; done; echo yes)

build/ctest-emu/test_%: tests/c/test_%.c tests/c/check.h tests/emu/immintrin.h $(CSRC) python/opforge/_build.py | $(VENV)/.installed
	$(CBUILD) -D OPF_EMULATE_AVX512

build/ctest-emu/test_gemm_amx_emulated: tests/c/test_gemm.c tests/c/check.h tests/emu/immintrin.h $(CSRC) python/opforge/_build.py | $(VENV)/.installed
	$(CBUILD) -D OPF_EMULATE_AVX512 -D OPF_AMX_EMULATE

ctest-emulated: $(EMU_CTESTS)
	@for t in $(EMU_CTESTS); do echo "./$$t (AVX-512 emulated)"; ./$$t || exit 1; done

# the native C tests (every variant this CPU runs, the AMX model, attention split)
ctest: $(CTESTS) ctest-cuda
	@for t in $(CTESTS); do echo "./$$t"; ./$$t || exit 1; done

# The standalone runtime's pthread pool at thread counts a 2-core machine never has: every kernel
# driver's empty, tiny and odd shapes (test_sweep, bitwise against 1 thread) at 1, 2, 3, 7, 16 and 64
# threads. (Every C test at 3 and 16 threads as well would add 250 s on 2 cores: SWEEP_TESTS=... runs
# any of them at SWEEP_THREADS.)
SWEEP_THREADS ?= 1 2 3 7 16 64
SWEEP_TESTS ?= build/ctest/test_sweep
ctest-threads: $(SWEEP_TESTS)
	@for n in $(SWEEP_THREADS); do for t in $(SWEEP_TESTS); do \
		echo "OPFORGE_NUM_THREADS=$$n ./$$t"; OPFORGE_NUM_THREADS=$$n ./$$t > /dev/null || exit 1; done; done

ctest-full: ctest ctest-threads build/ctest/test_attention_split
	./build/ctest/test_attention_split
ifeq ($(NATIVE_AVX512),yes)
	@echo "ctest-emulated: skipped: this CPU runs the AVX-512 variants natively (make ctest-emulated runs them over SIMDe)"
else
ctest-full: ctest-emulated
endif

# torch's C++ headers and ours in one C++ file: a drifted signature fails here.
abi-check: $(VENV)/.installed
	g++ -std=c++17 -fsyntax-only -I$(TORCH_INCLUDE) -Icsrc/include tests/abi/abi_drift.cpp
	g++ -std=c++17 -fsyntax-only -DUSE_CUDA -I$(TORCH_INCLUDE) -Icsrc/include tests/abi/abi_drift.cpp
	@echo "abi-check: csrc/include/opforge/shim.h matches torch's headers (with and without their CUDA declarations)"

# the fast tier: the tests not marked slow, torch.compile on aot_eager (tests/python/conftest.py);
# one pytest worker per core (at most 8), a file's tests in one worker (its module fixtures built once)
PYTEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 8 ] && n=8; echo $$n)
PYTEST := $(PY) -m pytest -q -n $(PYTEST_JOBS) --dist loadfile

# The GEMM and attention tests again with every product and every plain attention on torch's
# kernels (OPFORGE_GEMM=torch), less the ones that check opforge's own plans give the same bits at
# every thread count
GEMM_TESTS := tests/python/test_linear.py tests/python/test_linear_cross_entropy.py tests/python/test_attention.py
GEMM_ON_TORCH := OPFORGE_GEMM=torch $(PYTEST) -k "not same_bits and not do_not_depend_on_the_thread_count"

pytest: build
	$(PYTEST) -m "not slow" tests/python
	$(GEMM_ON_TORCH) -m "not slow" $(GEMM_TESTS)

pytest-full: build
	OPFORGE_TEST_FULL=1 $(PYTEST) tests/python
	OPFORGE_TEST_FULL=1 $(GEMM_ON_TORCH) $(GEMM_TESTS)

test: lint abi-check ctest pytest

# CI: what `make test` runs, and everything it leaves out, in at most 15 minutes on 2 cores; the
# sanitized fuzz on a fixed seed, so that a run is repeatable (make fuzz / make sanitize draw fresh ones)
test-full: lint abi-check ctest-full pytest-full
	$(MAKE) sanitize SANITIZE_FUZZ_SECONDS=60 FUZZ_ARGS="--seed 1" SAN_RUN="$(filter-out $(SAN_HEAVY),$(SAN_CTESTS))"

# The stable-ABI promise, checked: the library built against the pinned torch
# must load and pass under another release, so nothing here rebuilds it (an
# existing libopforge.so is used as is). The venv is remade when TORCH_WHEEL
# (a wheel path or a pip requirement) changes; the other pins are installed
# without the torch line so that pip does not re-resolve torch.
OTHER_VENV  := .venv-other
OTHER_PY    := $(OTHER_VENV)/bin/python
TORCH_WHEEL ?= torch==2.14.1

test-other-torch: | $(LIB)
	@if [ "$$(cat $(OTHER_VENV)/.torch 2>/dev/null)" != "$(TORCH_WHEEL)" ]; then \
	  set -e; rm -rf $(OTHER_VENV); $(PYTHON) -m venv $(OTHER_VENV); \
	  $(OTHER_PY) -m pip install -q "$(TORCH_WHEEL)"; \
	  grep -vE '^torch([=<>~! ;]|$$)' requirements-dev.txt > $(OTHER_VENV)/requirements-no-torch.txt; \
	  $(OTHER_PY) -m pip install -q -r $(OTHER_VENV)/requirements-no-torch.txt; \
	  echo "$(TORCH_WHEEL)" > $(OTHER_VENV)/.torch; \
	fi
	@$(OTHER_PY) -c "import torch; print('test-other-torch: torch', torch.__version__)"
	PYTHONPATH=$(CURDIR)/python $(OTHER_PY) -m pytest -q tests/python

# cases run in child processes: a crash fails its case and the run goes on; each failure prints the
# command that reruns it (FUZZ_ARGS: e.g. --seed 7, --ops linear,matmul)
FUZZ_SECONDS ?= 300
FUZZ_JOBS ?= 2
FUZZ_ARGS ?=

fuzz: build
	$(PY) tests/python/fuzz.py --seconds $(FUZZ_SECONDS) --jobs $(FUZZ_JOBS) $(FUZZ_ARGS)

# ASan + UBSan: the C tests, and the fuzz on a sanitized copy of the package (build/asan/python) in a
# python that preloads the sanitizer runtimes. The default build is left as it is.
SAN_DIR := build/asan
SAN_CTESTS := $(patsubst tests/c/%.c,%,$(wildcard tests/c/test_*.c)) test_gemm_amx_emulated test_attention_split
SAN_OPTIONS := ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
SANITIZE_FUZZ_SECONDS ?= 180
# the C tests `make sanitize` runs (SAN_RUN=... picks some). test-full's leaves out the five that take
# 45-145 s each under ASan on 2 cores (attention, attention_split, linear, linear_cross_entropy, the AMX
# model: 560 s of 650); test_sweep runs every one of those drivers sanitized on every ISA all the same.
SAN_RUN ?= $(SAN_CTESTS)
SAN_HEAVY := test_attention test_attention_split test_linear test_linear_cross_entropy test_gemm_amx_emulated

$(SAN_DIR)/ctest/test_%: tests/c/test_%.c tests/c/check.h $(CSRC) python/opforge/_build.py tests/sanitize.py | $(VENV)/.installed
	$(PY) tests/sanitize.py test $@ $< $(wildcard csrc/runtime/*.c) $(wildcard csrc/kernels/*.c) -I csrc/include

$(SAN_DIR)/ctest/test_gemm_amx_emulated: tests/c/test_gemm.c tests/c/check.h $(CSRC) python/opforge/_build.py tests/sanitize.py | $(VENV)/.installed
	$(PY) tests/sanitize.py test $@ $< $(wildcard csrc/runtime/*.c) $(wildcard csrc/kernels/*.c) -I csrc/include -D OPF_AMX_EMULATE

$(SAN_DIR)/ctest/test_attention_split: tests/c/test_attention.c tests/c/check.h $(CSRC) python/opforge/_build.py tests/sanitize.py | $(VENV)/.installed
	$(PY) tests/sanitize.py test $@ $< $(wildcard csrc/runtime/*.c) $(wildcard csrc/kernels/*.c) -I csrc/include -D ATTENTION_FWD_MIN_TASKS=64

$(SAN_DIR)/python/opforge/libopforge.so: $(CSRC) $(wildcard python/opforge/*.py) tests/sanitize.py | $(VENV)/.installed
	$(PY) tests/sanitize.py library $(SAN_DIR)/python

sanitize: $(addprefix $(SAN_DIR)/ctest/,$(SAN_RUN)) $(SAN_DIR)/python/opforge/libopforge.so
	@for t in $(SAN_RUN); do echo "./$(SAN_DIR)/ctest/$$t"; $(SAN_OPTIONS) ./$(SAN_DIR)/ctest/$$t || exit 1; done
	$(SAN_OPTIONS) LD_PRELOAD="$$($(PY) tests/sanitize.py runtime)" PYTHONPATH=$(SAN_DIR)/python \
		$(PY) tests/python/fuzz.py --seconds $(SANITIZE_FUZZ_SECONDS) --jobs $(FUZZ_JOBS) $(FUZZ_ARGS)

# every benchmarks/bench_*.py (bench_build, the slow C++-extension baseline, last); the smoke run writes
# under build/ so that it leaves the published results alone
BENCHES := $(filter-out benchmarks/bench_build.py,$(sort $(wildcard benchmarks/bench_*.py)))

bench: build
	@for b in $(BENCHES) benchmarks/bench_build.py; do echo "$(PY) $$b"; $(PY) $$b || exit 1; done

bench-smoke: build
	@for b in $(BENCHES); do echo "$(PY) $$b --smoke"; $(PY) $$b --smoke --out build/bench-smoke || exit 1; done

# C: .clang-format (the scaffold templates are left out: their {name}
# placeholders are not C until `opforge new` fills them in). Python: ruff's
# lint rules and import order from pyproject.toml; no Python formatter.
CLANG_FORMAT ?= $(VENV)/bin/clang-format
RUFF         := $(VENV)/bin/ruff
C_FORMATTED  := $(shell find csrc tests/c tests/cuda examples -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort)
PY_LINTED    := python tests benchmarks examples

lint: $(VENV)/.installed
	$(CLANG_FORMAT) --dry-run --Werror $(C_FORMATTED)
	$(RUFF) check $(PY_LINTED)

format: $(VENV)/.installed
	$(CLANG_FORMAT) -i $(C_FORMATTED)
	$(RUFF) check --select I --fix $(PY_LINTED)

clean:
	rm -rf build $(LIB) $(CUDA_LIB) python/*.egg-info
