# moe.c — build, train, test, docs, bench.
#
#   make            build the library and programs (CPU; CUDA/MPI parts when found)
#   make train      train the default MoE on tinyshakespeare (CPU or GPU)
#   make test       unit + gradient-check tests, docs with warnings as errors,
#                   and the unit tests again under AddressSanitizer/UBSan
#   make docs       API docs with Doxygen (warnings are errors)
#   make bench      benchmarks
#   make test-gpu   the CUDA tests only (they print "skipped: no GPU" without one)
#   make ch03-versions  chapter 03's kernel ladder, bin/ch03_versions (needs nvcc)
#   make check-ch01 (ch02, ch03, ch04, ch05, ch06, ch07)   one chapter's tests only, in under a minute on 2 cores;
#                   STUDENT=1 grades the stubs in chapters/NN-*/student/ instead
#   make notebooks  re-execute notebooks-c/*.ipynb and save their outputs
#   make test-plots tools/plot_metrics.py and tools/plot_bench.py on synthetic inputs
#                   (needs python3-matplotlib; skipped without it)
#   make figures    redraw every figure of docs/results/figures/ from the files in the tree
#   make clean
#
# Variables: MARCH (default native; x86-64-v3 for binaries that run on another machine),
# OMP (1/0), CUDA (auto/1/0: build the CUDA backend when nvcc is found), MPI (auto/1/0),
# JOBS (parallel build jobs, default: the number of cores),
# TRAIN_FLAGS (extra flags for make train), STUDENT (1: check-chNN grades the student stubs).

SHELL := /bin/bash
.DEFAULT_GOAL := all

# Build in parallel by default, one job per core, so a first `make train` does not compile
# serially: JOBS=N sets the number of jobs (GNU make 4.3 does not let a makefile see a -jN
# given on the command line, so JOBS is the knob). Sub-makes share the top-level make's job
# slots. Tests still run one after another.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
ifneq ($(SERIAL),)
  .NOTPARALLEL:
else ifeq ($(MAKELEVEL),0)
  MAKEFLAGS += -j$(JOBS)
endif

CC      ?= cc
MARCH   ?= native
OMP     ?= 1
BUILD   ?= build

# ---------------------------------------------------------------- detection
NVCC    := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(NVCC)),/usr/local/cuda)
# NCCL_INC=dir: build against the NCCL headers in dir. The fused dispatcher compiles NCCL's
# device API into our kernels, so the headers must be those of the libnccl that runs.
NCCL_INC ?=
NCCL_H  := $(firstword $(wildcard $(if $(NCCL_INC),$(NCCL_INC)/nccl.h) /usr/include/nccl.h $(CUDA_HOME)/include/nccl.h))
MPICC   := $(shell command -v mpicc 2>/dev/null)
# CHECK_DIR=dir: Check as static libraries in dir/lib (libcheck.a, libsubunit.a) with its
# headers in dir/include, for a machine without the Check package (the GPU box: see
# tools/README.md, "Building on a GPU machine")
CHECK_DIR ?=
HAVE_CHECK := $(if $(CHECK_DIR),$(if $(wildcard $(CHECK_DIR)/lib/libcheck.a),yes),$(shell pkg-config --exists check 2>/dev/null && echo yes))
DOXYGEN := $(shell command -v doxygen 2>/dev/null)

MPI     ?= auto
ifeq ($(MPI),auto)
  WITH_MPI := $(if $(MPICC),1,0)
else
  WITH_MPI := $(MPI)
endif
CUDA    ?= auto
ifeq ($(CUDA),auto)
  WITH_CUDA := $(if $(NVCC),1,0)
else
  WITH_CUDA := $(CUDA)
endif

WITH_NCCL := $(if $(and $(filter 1,$(WITH_CUDA)),$(filter 1,$(WITH_MPI)),$(NCCL_H)),1,0)

found = $(if $(1),found $(1),not found)
define REPORT
moe.c build configuration
  cc       : $(shell $(CC) --version 2>/dev/null | head -n1)
  openmp   : $(if $(filter 1,$(OMP)),on,off)
  nvcc     : $(call found,$(NVCC))  (CUDA backend: $(if $(filter 1,$(WITH_CUDA)),on -- sm_90a + sm_100a,off))
  nccl     : $(call found,$(NCCL_H))  ($(if $(filter 1,$(WITH_NCCL)),GPU ranks through NCCL,not used))
  mpi      : $(call found,$(MPICC))  (communication layer: $(if $(filter 1,$(WITH_MPI)),MPI ranks,single process))
  check    : $(if $(HAVE_CHECK),found$(if $(CHECK_DIR), in $(CHECK_DIR)),not found$(if $(CHECK_DIR), in CHECK_DIR=$(CHECK_DIR) (no lib/libcheck.a there)) -- make test needs it: apt-get install check libsubunit-dev)
  doxygen  : $(call found,$(DOXYGEN))
endef
export REPORT

# ---------------------------------------------------------------- flags
WARN    := -Wall -Wextra -Wshadow -Wno-unused-parameter
KERNELS_INC := -Ikernels
CSTD    := -std=c11 -D_DEFAULT_SOURCE -D_POSIX_C_SOURCE=200809L
OPENMP  := $(if $(filter 1,$(OMP)),-fopenmp,)
CFLAGS  ?= -O3
# lib/ is compiled without -Ikernels: the library defines interfaces (the op table, the
# transport table, the fused dispatcher's launchers) that kernels/ implements, and never
# includes a CUDA header. Programs, chapters and tests may include both.
ALL_CFLAGS = $(CSTD) $(WARN) $(CFLAGS) -march=$(MARCH) $(OPENMP) -Ilib $(KERNELS_INC) $(if $(CHECK_DIR),-I$(CHECK_DIR)/include) -MMD -MP
LDLIBS  := $(OPENMP) -lm
# Check is linked statically so test binaries also run on machines without it (the GPU box).
CHECK_LIBS := $(if $(CHECK_DIR),-L$(CHECK_DIR)/lib) -Wl,-Bstatic -lcheck -lsubunit -Wl,-Bdynamic -lrt -lpthread

# ---------------------------------------------------------------- CUDA
NVCC_ARCH  := -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_100a,code=sm_100a
NVCC_FLAGS ?= -O3
ALL_NVCC_FLAGS = -std=c++17 $(NVCC_FLAGS) $(NVCC_ARCH) -Ilib -Ikernels -Xcompiler -Wall,-Wextra,-Wno-unused-parameter -MMD -MP
CUDA_LIBS  := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublasLt -lcublas -lcudart -lstdc++

# ---------------------------------------------------------------- sources
LIB_SRC  := $(wildcard lib/*.c lib/cpu/*.c lib/moe/*.c)
CU_SRC   := $(if $(filter 1,$(WITH_CUDA)),$(wildcard kernels/*.cu),)
GPU_SRC  := $(wildcard tests/gpu_*.c) tests/helpers.c
MPI_SRC  := $(filter-out tests/mpi_abort_main.c,$(wildcard tests/mpi_*.c)) tests/helpers.c
PROG_SRC := $(wildcard programs/*.c)
UNIT_SRC := $(wildcard tests/test_*.c) tests/main_unit.c tests/helpers.c
FD_SRC   := $(wildcard tests/fd_*.c) tests/fd.c tests/main_fd.c tests/helpers.c

LIB      := $(BUILD)/libmoe.a
LIB_F64  := $(BUILD)/f64/libmoe.a
PROGRAMS := $(patsubst programs/%.c,bin/%,$(PROG_SRC))
# chapter programs: chapters/NN-name/chNN_what.c -> bin/chNN_what
CHAPTER_SRC := $(filter-out $(if $(filter 1,$(WITH_CUDA)),,chapters/05-fp8-nvfp4/% chapters/06-cuda-graphs/% chapters/07-long-context/ch07_attention_bench.c),$(wildcard chapters/*/ch*.c))
CHAPTER_BIN := $(foreach f,$(CHAPTER_SRC),bin/$(basename $(notdir $(f))))

obj = $(patsubst %.c,$(BUILD)/$(2)%.o,$(1))
CU_OBJ := $(patsubst %.cu,$(BUILD)/%.o,$(CU_SRC))
ifeq ($(WITH_CUDA),1)
  ALL_CFLAGS += -DMOE_HAVE_CUDA -I$(CUDA_HOME)/include
  LDLIBS += $(CUDA_LIBS)
endif
ifeq ($(WITH_MPI),1)
  MPI_CFLAGS := $(shell $(MPICC) --showme:compile 2>/dev/null)
  MPI_LIBS   := $(shell $(MPICC) --showme:link 2>/dev/null)
  ALL_CFLAGS += -DMOE_HAVE_MPI $(MPI_CFLAGS)
  ALL_NVCC_FLAGS += -DMOE_HAVE_MPI $(MPI_CFLAGS)
  LDLIBS := $(MPI_LIBS) $(LDLIBS)
endif
ifeq ($(WITH_NCCL),1)
  ALL_CFLAGS += -DMOE_HAVE_NCCL
  ALL_NVCC_FLAGS += -DMOE_HAVE_NCCL $(if $(NCCL_INC),-I$(NCCL_INC))
  LDLIBS := $(LDLIBS) -lnccl
endif

# ---------------------------------------------------------------- configuration stamp
# Every object depends on $(CONFIG_STAMP), a file holding the whole build configuration
# (compilers, flags, what detection found). It is rewritten only when that text changes, so
# a build made before Open MPI (or CUDA, or NCCL) was installed is rebuilt once they are,
# instead of being linked, stale, into binaries compiled with them. The pattern is git's
# GIT-CFLAGS file.
CONFIG_STAMP := $(BUILD)/CONFIG
CONFIG_TEXT = CC=$(CC) CFLAGS=$(ALL_CFLAGS) NVCC=$(NVCC) NVCCFLAGS=$(ALL_NVCC_FLAGS) \
  LDLIBS=$(LDLIBS) CUDA=$(WITH_CUDA) MPI=$(WITH_MPI) NCCL=$(WITH_NCCL) OMP=$(OMP) MARCH=$(MARCH)
.PHONY: FORCE
FORCE:
# write-stamp FILE,TEXT: rewrite FILE only when its content is not TEXT
define write-stamp
	@mkdir -p $(dir $(1))
	@if [ '$(subst ','\'',$(2))' != "$$(cat $(1) 2>/dev/null)" ]; then \
	  if [ -f $(1) ]; then echo "$(notdir $(1)) changed: rebuilding what depends on it"; fi; \
	  echo '$(subst ','\'',$(2))' > $(1); fi
endef
$(CONFIG_STAMP): FORCE
	$(call write-stamp,$@,$(CONFIG_TEXT))

# The members of each library: a source that is removed or moved must leave the archive,
# so the archive is rebuilt from scratch whenever its member list changes.
$(BUILD)/LIB-MEMBERS: FORCE
	$(call write-stamp,$@,$(call obj,$(LIB_SRC),) $(CU_OBJ))
$(BUILD)/f64/LIB-MEMBERS: FORCE
	$(call write-stamp,$@,$(call obj,$(LIB_SRC),f64/))

# ---------------------------------------------------------------- targets
.PHONY: all config check-deps train test test-unit test-fd test-asan test-gpu test-mpi test-notebooks notebooks docs bench \
	clean print-build-flags test-mpi8 check-ch01 check-ch02 check-ch03 check-ch04 check-ch05 check-ch06 check-ch07 test-chapters test-student-stubs test-plots \
	ch03-versions figures

# chapter 03's kernel ladder (chapters/03-grouped-gemm/versions/): CUDA only
VERSIONS_BIN := $(if $(filter 1,$(WITH_CUDA)),bin/ch03_versions)

all: config $(LIB) $(PROGRAMS) $(CHAPTER_BIN) $(VERSIONS_BIN)

config:
	@echo "$$REPORT"

$(BUILD)/%.o: %.c $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -c $< -o $@

$(BUILD)/lib/%.o $(BUILD)/f64/lib/%.o: KERNELS_INC :=
# (the stamp records the flags of everything else; prerequisites inherit target variables)
$(CONFIG_STAMP): KERNELS_INC := -Ikernels

# The same library sources compiled with moe_real = double, for the
# finite-difference gradient checks (see lib/real.h).
$(BUILD)/f64/%.o: %.c $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -DMOE_HAVE_CUDA -DMOE_HAVE_NCCL,$(ALL_CFLAGS)) -DMOE_REAL_DOUBLE -c $< -o $@

$(BUILD)/%.o: %.cu $(CONFIG_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(ALL_NVCC_FLAGS) -c $< -o $@

$(LIB): $(call obj,$(LIB_SRC),) $(CU_OBJ) $(BUILD)/LIB-MEMBERS
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $(filter %.o,$^)

$(LIB_F64): $(call obj,$(LIB_SRC),f64/) $(BUILD)/f64/LIB-MEMBERS
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $(filter %.o,$^)

bin/%: $(BUILD)/programs/%.o $(LIB)
	@mkdir -p bin
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

define CHAPTER_RULE
bin/$(basename $(notdir $(1))): $(BUILD)/$(1:.c=.o) $(LIB)
	@mkdir -p bin
	$$(CC) $$(ALL_CFLAGS) $$^ -o $$@ $$(LDLIBS)
endef
$(foreach f,$(CHAPTER_SRC),$(eval $(call CHAPTER_RULE,$(f))))
# chapter 06's benchmark counts kernels with CUPTI (CUDA toolkit): only it links -lcupti.
# `private`: a target's variables are inherited by its prerequisites, and the configuration
# stamp (which records LDLIBS) is one, so without it `make bin/ch06_graphs_bench` rewrote the
# stamp and rebuilt everything, and the next plain build rebuilt it all again.
CUPTI_LIBDIR := $(firstword $(wildcard $(CUDA_HOME)/extras/CUPTI/lib64 $(CUDA_HOME)/lib64))
bin/ch06_graphs_bench: private LDLIBS += -L$(CUPTI_LIBDIR) -Wl,-rpath,$(CUPTI_LIBDIR) -lcupti

# ---- chapter 03's kernel ladder: v1 SIMT .. v4 the library's kernel, each checked against
# the cuBLAS loop and timed by one program (chapters/03-grouped-gemm/versions/ch03_versions.cu)
ch03-versions:
	@if [ "$(WITH_CUDA)" != 1 ]; then echo "ch03-versions: skipped (needs nvcc: the ladder is CUDA code)"; \
	else $(MAKE) --no-print-directory bin/ch03_versions; fi

bin/ch03_versions: $(BUILD)/chapters/03-grouped-gemm/versions/ch03_versions.o $(LIB)
	@mkdir -p bin
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

# ---- main job
TRAIN_FLAGS ?=
train: all
	./bin/moe-train $(TRAIN_FLAGS)

# ---- tests
# Check's per-test timeouts (4 s by default) are for a quiet machine; a loaded 2-core CI
# runner or laptop needs slack, and a test that really hangs still fails, later.
export CK_TIMEOUT_MULTIPLIER ?= 3
check-deps:
	@if [ -z "$(HAVE_CHECK)" ]; then \
	  echo "make test needs the Check unit-test library. Install it with:"; \
	  echo "  sudo apt-get install check libsubunit-dev pkg-config doxygen"; exit 1; fi

$(BUILD)/tests/unit: $(call obj,$(UNIT_SRC),) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(CHECK_LIBS) $(LDLIBS)

# The fp64 build is CPU-only: no -DMOE_HAVE_CUDA, no kernels.
$(BUILD)/tests/fd: $(call obj,$(FD_SRC),f64/) $(LIB_F64)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out -DMOE_HAVE_CUDA -DMOE_HAVE_NCCL,$(ALL_CFLAGS)) -DMOE_REAL_DOUBLE $^ -o $@ $(CHECK_LIBS) $(MPI_LIBS) $(OPENMP) -lm

$(BUILD)/tests/gpu: $(call obj,$(GPU_SRC),) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(CHECK_LIBS) $(LDLIBS)

# (the unit suite also runs bin/moe-train and bin/moe-grid as a user would)
test-unit: check-deps $(BUILD)/tests/unit $(PROGRAMS)
	@echo "== unit tests (fp32 CPU)"
	$(BUILD)/tests/unit

test-fd: check-deps $(BUILD)/tests/fd
	@echo "== finite-difference gradient checks (fp64 CPU)"
	$(BUILD)/tests/fd

# The unit tests once more, built with AddressSanitizer + UBSan: any leak or
# undefined behaviour fails the run.
test-asan: check-deps
	@echo "== unit tests under -fsanitize=address,undefined"
	$(MAKE) --no-print-directory SERIAL= BUILD=$(BUILD)/asan CUDA=0 MPI=0 CFLAGS="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all" \
	  LDLIBS="$(OPENMP) -lm -fsanitize=address,undefined" $(BUILD)/asan/tests/unit
	MOE_TEST_QUICK=1 ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  CK_FORK=no $(BUILD)/asan/tests/unit

$(BUILD)/tests/mpi: $(call obj,$(MPI_SRC),) $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(CHECK_LIBS) $(LDLIBS)

$(BUILD)/tests/mpi_abort: $(BUILD)/tests/mpi_abort_main.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $^ -o $@ $(LDLIBS)

# Distributed tests on CPU ranks: the same binary under mpirun with 1, 2 and 4 ranks
# (oversubscribed: CI has 2 cores). Every rank checks; any failure fails the run.
# Single-copy shared memory (CMA) is often forbidden inside containers, where it makes
# Open MPI fail large messages: plain shared memory works everywhere.
MPIRUN ?= env OMPI_MCA_btl_vader_single_copy_mechanism=none mpirun --oversubscribe --allow-run-as-root
# $(call EXPECT_JOB_END,mpirun arguments,text the output must carry): the job must fail
# within 120 s (not succeed, not hang) and print the text.
EXPECT_JOB_END = if timeout 120 $(MPIRUN) $(1) > $(BUILD)/tests/mpi_abort.log 2>&1; \
	  then echo "FAIL: the job did not fail"; cat $(BUILD)/tests/mpi_abort.log; exit 1; \
	  elif [ $$? = 124 ]; then echo "FAIL: the job hung"; exit 1; \
	  elif ! grep -qF "$(2)" $(BUILD)/tests/mpi_abort.log; then \
	    echo "FAIL: no message from the failing rank"; cat $(BUILD)/tests/mpi_abort.log; exit 1; \
	  else echo "ok: the job ended with the failing rank's message"; fi
# The 8-rank foldings of chapter 04 (tests/mpi_etp.c, suite mpi_fold8): attention TP 2 + SP
# x DP 4 with experts EP 4 x EDP 2, and with ETP 2 x EP 2 x EDP 2, each against one
# process. 8 ranks oversubscribed on 2 cores: about 2 s (check-ch04 runs it too).
test-mpi8: check-deps
	@if [ "$(WITH_MPI)" != 1 ]; then echo "== MPI tests on 8 ranks: skipped (no mpicc: apt-get install libopenmpi-dev openmpi-bin)"; \
	else $(MAKE) --no-print-directory $(BUILD)/tests/mpi && \
	  echo "== chapter 04 foldings on 8 MPI ranks (CPU, oversubscribed)" && \
	  CK_RUN_SUITE=mpi_fold8 OMP_NUM_THREADS=1 CK_FORK=no $(MPIRUN) -np 8 $(BUILD)/tests/mpi; fi

test-mpi: check-deps
	@if [ "$(WITH_MPI)" != 1 ]; then echo "== MPI tests: skipped (no mpicc: apt-get install libopenmpi-dev openmpi-bin)"; \
	else $(MAKE) --no-print-directory $(BUILD)/tests/mpi && \
	  for np in 1 2 4; do echo "== MPI tests, $$np rank(s) (CPU)"; \
	    OMP_NUM_THREADS=1 CK_FORK=no $(MPIRUN) -np $$np $(BUILD)/tests/mpi || exit 1; done; \
	  $(MAKE) --no-print-directory $(BUILD)/tests/mpi_abort && \
	  echo "== MPI test: a failing rank ends the job (rank 1 aborts, rank 0 waits in a collective)" && \
	  $(call EXPECT_JOB_END,-np 2 $(BUILD)/tests/mpi_abort,rank 1 gives up); \
	  echo "== MPI test: a stopped rank ends the job (rank 1 stops, rank 0's deadline of 2 s passes)" && \
	  $(call EXPECT_JOB_END,-x MOE_COMM_TIMEOUT=2 -np 2 $(BUILD)/tests/mpi_abort stop,[rank 0] fatal: all_reduce_sum did not complete within 2 s (MOE_COMM_TIMEOUT)); \
	  echo "== MPI test: the deadline from --distributed-timeout-minutes 0.05 (3 s) ends the job" && \
	  $(call EXPECT_JOB_END,-np 2 $(BUILD)/tests/mpi_abort stop --distributed-timeout-minutes 0.05,[rank 0] fatal: all_reduce_sum did not complete within 3 s (--distributed-timeout-minutes)); \
	  $(MAKE) --no-print-directory bin/moe-train && \
	  echo "== MPI test: kill -9 of a rank, resume from the checkpoint, the same losses bit for bit (2 ranks, EP 2)" && \
	  MPIRUN="$(MPIRUN)" tests/ckpt_resume_mpi.sh || exit 1; fi

# CUDA tests: each CUDA op against its CPU twin, the whole model CUDA vs CPU, and resume
# through bin/moe-train --device cuda (kill -9, resume, the same losses bit for bit).
# Without a GPU (CI) the binary prints "skipped: no GPU" and succeeds.
test-gpu: check-deps
	@if [ "$(WITH_CUDA)" != 1 ]; then echo "== GPU tests: skipped (built without CUDA: nvcc not found)"; \
	else $(MAKE) --no-print-directory $(BUILD)/tests/gpu bin/moe-train && echo "== GPU tests (CUDA vs CPU)" && $(BUILD)/tests/gpu; fi

# ---- chapter self-checks (make check-chNN) and student mode (STUDENT=1)
# check-chNN runs only the test cases tagged "chNN" (Check's CK_INCLUDE_TAGS; the tags are
# set where the suites are built, e.g. tests/test_router.c), in the unit binary, the fp64
# gradient checks and, for chapter 02, the MPI tests on 2 and 4 CPU ranks.
#
# STUDENT=1 grades the student's versions of the chapter's key functions instead of the
# library's. The stubs in chapters/NN-*/student/*.c define the same symbols as lib/ (the
# CHNN_SYMBOLS below). How they replace the library's: link-time substitution. The test
# binaries are linked with the stub objects and a copy of libmoe.a in which objcopy has made
# exactly those symbols weak, so the stub's (strong) definition wins wherever the library,
# the tests or the op table call the function. We chose this over weak attributes or an
# adapter layer in lib/ because the library's source stays exactly as it is: its code is
# the reference solution, nothing is copied, and a student reads the same file a user
# does. (Plain "link the stub before libmoe.a" is not enough: the library's object is still
# pulled in for its other functions, and the two strong definitions would clash.) The
# functions are called from other files than their own, so no inlined copy of the
# reference survives; test-student-stubs proves it by expecting an untouched stub to fail.
# (An op table in the function's own file is safe: taking the address is a relocation
# against the symbol, which the linker binds to the stub. A direct call in the same file is
# not: GCC -O3 inlined moe_cpu_quant_blockwise into its caller moe_cpu_quant_blockwise_t,
# which therefore lives in lib/cpu/quantize_transpose.c.)
CH01_SYMBOLS := moe_cpu_router_forward moe_cpu_aux_loss_forward moe_cpu_aux_loss_backward \
	moe_cpu_permute_index
CH02_SYMBOLS := moe_dispatch_layout moe_dispatch_sort_maps
CH03_SYMBOLS := moe_cpu_grouped_matmul_forward moe_tile_schedule_prefix moe_tile_schedule_at
CH04_SYMBOLS := moe_cpu_cross_entropy_shard_merge
CH05_SYMBOLS := moe_cpu_quant_blockwise
CH06_SYMBOLS := moe_cpu_permute_index_budget
CH07_SYMBOLS := moe_cp_merge
OBJCOPY ?= objcopy
# the chapters with student stubs
STUDENT_CHAPTERS := 01 02 03 04 05 06 07
student_src = $(wildcard chapters/$(1)-*/student/*.c)
# $(call chapter_bin,NN,unit|fd|mpi): the test binary check-chNN runs
chapter_bin = $(if $(filter 1,$(STUDENT)),$(BUILD)/student/ch$(1)/$(2),$(BUILD)/tests/$(2))

define STUDENT_RULES
$(BUILD)/student/ch$(1)/libmoe.a: $(LIB)
	@mkdir -p $$(dir $$@)
	$(OBJCOPY) $(foreach f,$(CH$(1)_SYMBOLS),--weaken-symbol=$(f)) $$< $$@
$(BUILD)/student/ch$(1)/f64/libmoe.a: $(LIB_F64)
	@mkdir -p $$(dir $$@)
	$(OBJCOPY) $(foreach f,$(CH$(1)_SYMBOLS),--weaken-symbol=$(f)) $$< $$@
$(BUILD)/student/ch$(1)/unit: $(call obj,$(UNIT_SRC),) $(call obj,$(call student_src,$(1)),) $(BUILD)/student/ch$(1)/libmoe.a
	@mkdir -p $$(dir $$@)
	$$(CC) $$(ALL_CFLAGS) $$^ -o $$@ $$(CHECK_LIBS) $$(LDLIBS)
$(BUILD)/student/ch$(1)/fd: $(call obj,$(FD_SRC),f64/) $(call obj,$(call student_src,$(1)),f64/) $(BUILD)/student/ch$(1)/f64/libmoe.a
	@mkdir -p $$(dir $$@)
	$$(CC) $$(filter-out -DMOE_HAVE_CUDA -DMOE_HAVE_NCCL,$$(ALL_CFLAGS)) -DMOE_REAL_DOUBLE $$^ -o $$@ $$(CHECK_LIBS) $$(MPI_LIBS) $$(OPENMP) -lm
$(BUILD)/student/ch$(1)/mpi: $(call obj,$(MPI_SRC),) $(call obj,$(call student_src,$(1)),) $(BUILD)/student/ch$(1)/libmoe.a
	@mkdir -p $$(dir $$@)
	$$(CC) $$(ALL_CFLAGS) $$^ -o $$@ $$(CHECK_LIBS) $$(LDLIBS)
endef
$(foreach n,$(STUDENT_CHAPTERS),$(eval $(call STUDENT_RULES,$(n))))

CHECK_MODE = $(if $(filter 1,$(STUDENT)),student stubs in chapters/$(1)-*/student/,reference: the library's code)
# $(call RUN_TAGGED,NN,unit|fd): one binary, only the chapter's test cases
RUN_TAGGED = CK_INCLUDE_TAGS=ch$(1) $(call chapter_bin,$(1),$(2))

check-ch01: check-deps
	@$(MAKE) --no-print-directory $(call chapter_bin,01,unit) $(call chapter_bin,01,fd)
	@echo "== chapter 01 self-check ($(call CHECK_MODE,01))"
	$(call RUN_TAGGED,01,unit)
	$(call RUN_TAGGED,01,fd)

check-ch02: check-deps
	@$(MAKE) --no-print-directory $(call chapter_bin,02,unit) \
	  $(if $(filter 1,$(WITH_MPI)),$(call chapter_bin,02,mpi))
	@echo "== chapter 02 self-check ($(call CHECK_MODE,02))"
	$(call RUN_TAGGED,02,unit)
	@if [ "$(WITH_MPI)" != 1 ]; then echo "== chapter 02 MPI ranks: skipped (no mpicc: apt-get install libopenmpi-dev openmpi-bin)"; \
	else for np in 2 4; do echo "== chapter 02 on $$np MPI ranks (CPU)"; \
	  CK_INCLUDE_TAGS=ch02 OMP_NUM_THREADS=1 CK_FORK=no $(MPIRUN) -np $$np $(call chapter_bin,02,mpi) || exit 1; done; fi

check-ch03: check-deps
	@$(MAKE) --no-print-directory $(call chapter_bin,03,unit) $(call chapter_bin,03,fd)
	@echo "== chapter 03 self-check, CPU parts ($(call CHECK_MODE,03))"
	$(call RUN_TAGGED,03,unit)
	$(call RUN_TAGGED,03,fd)

# chapter 04 (parallel folding): the student's merge of the vocabulary-parallel
# cross-entropy is graded by its unit test, the finite-difference check and every TP folding
# on 2 and 4 ranks (all through the student's function). The bench and the warning check run
# the library's programs.
# a one-step TP 2 + SP run of a tiny MoE model with a capacity that drops tokens
CH04_DROPS_RUN := --num-layers 1 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 \
	--seq-length 16 --micro-batch-size 2 --global-batch-size 4 --moe-ffn-hidden-size 16 \
	--tensor-model-parallel-size 2 --sequence-parallel --make-vocab-size-divisible-by 8 \
	--moe-expert-capacity-factor 1.0 --lr-warmup-iters 0 --train-iters 1 --eval-iters 1 --sample-length 0
# $(call CH04_ETP_AGREES,file): from the bench's output, each ETP folding's heading with its
# agreement line; fails when there is none (the default list must hold uniform TP: the
# bytes model's ETP term is checked only where an ETP folding runs)
CH04_ETP_AGREES = awk '/^folding / { f = "" } /^folding [^:]*etp=/ && !/: not run/ { f = $$0; \
	sub(/ \|.*/, "", f) } f != "" && /^  model / { sub(/^  /, ""); print f ": " $$0; n++ } \
	END { exit !n }' $(1)
check-ch04: check-deps
	@$(MAKE) --no-print-directory $(call chapter_bin,04,unit) $(call chapter_bin,04,fd) \
	  $(if $(filter 1,$(WITH_MPI)),$(call chapter_bin,04,mpi))
	@echo "== chapter 04 self-check ($(call CHECK_MODE,04))"
	$(call RUN_TAGGED,04,unit)
	$(call RUN_TAGGED,04,fd)
	@if [ "$(WITH_MPI)" != 1 ]; then echo "== chapter 04 MPI ranks: skipped (no mpicc: apt-get install libopenmpi-dev openmpi-bin)"; \
	else for np in 2 4; do echo "== chapter 04 on $$np MPI ranks (CPU)"; \
	  CK_INCLUDE_TAGS=ch04 OMP_NUM_THREADS=1 CK_FORK=no $(MPIRUN) -np $$np $(call chapter_bin,04,mpi) || exit 1; done; \
	  $(MAKE) --no-print-directory test-mpi8; fi
	@if [ "$(WITH_MPI)" = 1 ]; then $(MAKE) --no-print-directory bin/ch04_folding_bench && \
	  for np in 2 4; do echo "== chapter 04 folding benchmark on $$np MPI ranks: the bytes model must equal the counts"; \
	  OMP_NUM_THREADS=1 $(MPIRUN) -np $$np ./bin/ch04_folding_bench --repeats 1 --warmup 0 \
	    --model "--moe-layer-freq [1,0]" > $(BUILD)/ch04_folding_bench_$$np.txt 2>&1 \
	    || { cat $(BUILD)/ch04_folding_bench_$$np.txt; exit 1; }; \
	  $(call CH04_ETP_AGREES,$(BUILD)/ch04_folding_bench_$$np.txt) \
	    || { echo "FAIL: no ETP folding in the benchmark's default list"; exit 1; }; \
	  tail -1 $(BUILD)/ch04_folding_bench_$$np.txt; done; fi
	@if [ "$(WITH_MPI)" = 1 ]; then $(MAKE) --no-print-directory bin/moe-train && \
	  echo "== chapter 04: a TP run whose capacity drops tokens warns once (rank 0) that its loss differs from one process" && \
	  OMP_NUM_THREADS=1 $(MPIRUN) -np 2 ./bin/moe-train --device cpu $(CH04_DROPS_RUN) > $(BUILD)/ch04_drops.txt 2>&1 \
	    || { cat $(BUILD)/ch04_drops.txt; exit 1; }; \
	  n=$$(grep -c "token drops depend on the local batch" $(BUILD)/ch04_drops.txt); \
	  if [ "$$n" != 1 ]; then echo "FAIL: the warning appears $$n times, want once"; cat $(BUILD)/ch04_drops.txt; exit 1; fi; \
	  echo "ok: $$(grep 'token drops depend' $(BUILD)/ch04_drops.txt)"; fi

# chapter 05 (FP8 / NVFP4): the codecs and every recipe on the CPU, the GEMM's CPU twin and
# the QDQ op (tests/test_quant.c); with CUDA, every recipe CUDA vs CPU byte for byte
# (tests/gpu_quant.c, "skipped: no GPU" without one). The student's blockwise quantizer
# (moe_cpu_quant_blockwise) is graded by the unit suite, which calls it directly, through
# the transposed copy and through the CPU quantizer table of the QDQ op; the GPU binary
# runs the library's code.
check-ch05: check-deps
	@$(MAKE) --no-print-directory $(call chapter_bin,05,unit) $(if $(filter 1,$(WITH_CUDA)),$(BUILD)/tests/gpu)
	@echo "== chapter 05 self-check ($(call CHECK_MODE,05))"
	$(call RUN_TAGGED,05,unit)
	@if [ "$(WITH_CUDA)" = 1 ]; then CK_INCLUDE_TAGS=ch05 $(BUILD)/tests/gpu; fi

# chapter 06 (CUDA graphs): the CPU parts (--cuda-graph-scope, the capture helper on a mock
# backend, the step's scalars, the sync-free layer's budget and its overflow protocol); the
# GPU parts (the arena, replay == eager) are tagged ch06 in the GPU binary. The student's
# budgeted permutation index (moe_cpu_permute_index_budget) is graded by its unit tests and
# by the overflow protocol, whose sync-free layers call it through the CPU op table; the GPU
# binary runs the library's code.
check-ch06: check-deps
	@$(MAKE) --no-print-directory $(call chapter_bin,06,unit) $(if $(filter 1,$(WITH_CUDA)),$(BUILD)/tests/gpu)
	@echo "== chapter 06 self-check ($(call CHECK_MODE,06))"
	$(call RUN_TAGGED,06,unit)
	@if [ "$(WITH_CUDA)" = 1 ]; then CK_INCLUDE_TAGS=ch06 $(BUILD)/tests/gpu; fi
	@if [ "$(WITH_CUDA)" = 1 ]; then $(MAKE) --no-print-directory bin/ch06_graphs_bench && \
	  echo "== chapter 06: the benchmark names a bad --scopes or --only (before it looks for a GPU)" && \
	  { o=$$(bin/ch06_graphs_bench --scopes none,nonsense 2>&1); test $$? = 2; } && \
	  echo "$$o" | grep -q "each must be one of none attn" && \
	  { o=$$(bin/ch06_graphs_bench --only nonsense 2>&1); test $$? = 2; } && \
	  echo "$$o" | grep -q "preset or large" || \
	  { echo "check-ch06: ch06_graphs_bench accepted a bad flag"; exit 1; }; fi

# chapter 07 (flash attention, context parallelism): the CPU flash attention against the
# naive reference (shapes around the tiles, chunks at offsets, the model) and its
# finite-difference gradients; on MPI ranks the context-parallel attention and the model
# under --context-parallel-size (each comm type, with TP and EP) against one process. The
# student's merge of partial attention results (moe_cp_merge) is graded by its unit test and
# by those MPI runs, which merge through it; the GPU comparison runs the library's kernels.
check-ch07: check-deps
	@$(MAKE) --no-print-directory $(call chapter_bin,07,unit) $(call chapter_bin,07,fd) \
	  $(if $(filter 1,$(WITH_CUDA)),$(BUILD)/tests/gpu)
	@echo "== chapter 07 self-check ($(call CHECK_MODE,07))"
	$(call RUN_TAGGED,07,unit)
	$(call RUN_TAGGED,07,fd)
	@if [ "$(WITH_CUDA)" = 1 ]; then echo "== chapter 07: the CUDA flash attention against the CPU's"; \
	  CK_RUN_SUITE=gpu_attention $(BUILD)/tests/gpu; fi
	@if [ "$(WITH_MPI)" != 1 ]; then echo "== chapter 07 MPI ranks: skipped (no mpicc: apt-get install libopenmpi-dev openmpi-bin)"; \
	else $(MAKE) --no-print-directory $(call chapter_bin,07,mpi) && \
	  for np in 2 3 4; do echo "== chapter 07: context-parallel attention and model on $$np MPI ranks (CPU) against one process"; \
	  CK_RUN_SUITE=mpi_cp OMP_NUM_THREADS=1 CK_FORK=no $(MPIRUN) -np $$np $(call chapter_bin,07,mpi) || exit 1; done; \
	  $(MAKE) --no-print-directory bin/ch07_cp_bench && \
	  echo "== chapter 07: the context-parallel benchmark runs (2 CPU ranks, small shapes)" && \
	  OMP_NUM_THREADS=1 $(MPIRUN) -np 2 ./bin/ch07_cp_bench --seqs 64,128 --heads 2 --dim 16 \
	    --repeats 1 --warmup 0 > $(BUILD)/ch07_cp_bench.txt 2>&1 \
	    || { cat $(BUILD)/ch07_cp_bench.txt; exit 1; }; \
	  tail -1 $(BUILD)/ch07_cp_bench.txt; fi

# make test runs the chapter checks on the reference, and proves the other direction: an
# untouched stub fails, with the message that names its file and function.
test-chapters: check-ch01 check-ch02 check-ch03 check-ch04 check-ch05 check-ch06 check-ch07

# $(call EXPECT_STUB,NN,file,function[,suite]): the chapter's student unit binary (only
# the Check suite named, when a chapter has stubs in several) must fail with the stub's
# TODO message
EXPECT_STUB = if CK_INCLUDE_TAGS=ch$(1) $(if $(4),CK_RUN_SUITE=$(4)) CK_FORK=no $(BUILD)/student/ch$(1)/unit > $(BUILD)/student/ch$(1)/stub.log 2>&1; \
	  then echo "FAIL: chapter $(1)'s untouched stubs passed"; exit 1; \
	  elif ! grep -qF "TODO(student): $(2): $(3) is not implemented yet" $(BUILD)/student/ch$(1)/stub.log; then \
	    echo "FAIL: no TODO message from $(2)"; cat $(BUILD)/student/ch$(1)/stub.log; exit 1; \
	  else echo "ok: chapter $(1)'s untouched stub fails: $$(grep -F 'TODO(student)' $(BUILD)/student/ch$(1)/stub.log)"; fi
test-student-stubs: check-deps
	@$(MAKE) --no-print-directory $(foreach n,$(STUDENT_CHAPTERS),$(BUILD)/student/ch$(n)/unit)
	@echo "== student stubs, untouched, fail with their TODO message"
	@$(call EXPECT_STUB,01,chapters/01-naive-moe/student/router.c,moe_cpu_router_forward)
	@$(call EXPECT_STUB,02,chapters/02-expert-parallel/student/dispatch_plan.c,moe_dispatch_layout)
	@$(call EXPECT_STUB,03,chapters/03-grouped-gemm/student/grouped_matmul.c,moe_cpu_grouped_matmul_forward,grouped)
	@$(call EXPECT_STUB,03,chapters/03-grouped-gemm/student/tile_schedule.c,moe_tile_schedule_prefix,tile_schedule)
	@$(call EXPECT_STUB,04,chapters/04-parallel-folding/student/cross_entropy_merge.c,moe_cpu_cross_entropy_shard_merge,vocab-merge)
	@$(call EXPECT_STUB,05,chapters/05-fp8-nvfp4/student/quant_blockwise.c,moe_cpu_quant_blockwise,quant)
	@$(call EXPECT_STUB,06,chapters/06-cuda-graphs/student/permute_budget.c,moe_cpu_permute_index_budget,sync_free)
	@$(call EXPECT_STUB,07,chapters/07-long-context/student/cp_merge.c,moe_cp_merge,cp_layout)

# Everything the test steps run is built first, in parallel; then the steps run one after
# another (SERIAL=1), so their output does not interleave and the MPI ranks get the cores.
TEST_BINS := $(BUILD)/tests/unit $(BUILD)/tests/fd $(if $(filter 1,$(WITH_MPI)),$(BUILD)/tests/mpi \
	$(BUILD)/tests/mpi_abort) $(if $(filter 1,$(WITH_CUDA)),$(BUILD)/tests/gpu) \
	$(foreach n,$(STUDENT_CHAPTERS),$(BUILD)/student/ch$(n)/unit)
# Each step says how long it took (CI's budget is 20 minutes on 2 cores: the times show where
# it goes). No step may rewrite the configuration stamp once the build is done: that rebuilds
# the library and every kernel (a target-specific variable that reached the stamp once cost
# CI eight minutes: see bin/ch06_graphs_bench above).
TEST_STEPS := test-unit test-fd test-mpi test-gpu test-chapters test-student-stubs \
	test-notebooks test-plots docs test-asan
test: config check-deps
	@t0=$$(date +%s); $(MAKE) --no-print-directory $(LIB) $(PROGRAMS) $(CHAPTER_BIN) $(TEST_BINS) \
	  && echo "== build: $$(( $$(date +%s) - t0 )) s"
	@touch $(BUILD)/.test-built
	@for step in $(TEST_STEPS); do t=$$(date +%s); \
	  $(MAKE) --no-print-directory SERIAL=1 $$step || exit 1; \
	  echo "== $$step: $$(( $$(date +%s) - t )) s"; \
	  if [ $(CONFIG_STAMP) -nt $(BUILD)/.test-built ]; then \
	    echo "FAIL: $$step rewrote $(CONFIG_STAMP), so it rebuilt everything: a target's own flags"; \
	    echo "      reached the stamp (make hands them to prerequisites; use 'private')"; exit 1; fi; \
	done
	@echo "== all tests passed"

# ---- notebooks (notebooks-c/): every notebook executed headlessly with Debian's nbclient.
# --check runs them in memory and never writes the files; `make notebooks` refreshes the
# committed outputs. Their %%c cells compile and link against this build.
# --check first compares each notebook's source stamp (notebooks-c/nbstamp.py) with the
# sources now, so outputs saved from older code fail; test_nbstamp.py tests that check.
NB_RUN = MOE_NB_MAKEFLAGS="CUDA=$(CUDA) BUILD=$(BUILD) OMP=$(OMP) MARCH=$(MARCH)" \
	/usr/bin/python3 notebooks-c/run_notebooks.py

test-notebooks: all
	@echo "== notebooks (notebooks-c/*.ipynb)"
	@if [ ! -x /usr/bin/python3 ]; then echo "notebooks: skipped: no /usr/bin/python3 (sudo apt-get install python3)"; \
	else /usr/bin/python3 notebooks-c/test_nbstamp.py && $(NB_RUN) --check; fi

notebooks: all
	$(NB_RUN) --update

# ---- plots (tools/plot_metrics.py, tools/plot_bench.py), on tiny synthetic inputs:
# - plot_metrics: two MoE steps with an evaluation, then a dense run, must give two
#   non-empty PNGs; two runs with a capacity factor (two policies) and a dropless one the
#   dropped-tokens figure; a missing file a named error;
# - plot_bench: a dispatch-benchmark table, a two-panel bars table and a stages table
#   must give three PNGs; a table that is not there a named error.
# matplotlib is optional, as in .ci/run: without it the step says so and passes.
PLOT_TEST = $(BUILD)/plots-test
PY = /usr/bin/python3
define PLOT_CAP_RUN   # file, factor, policy, dropped at steps 1 and 2, last val loss
printf '%s\n' '{"event":"config","moe-expert-capacity-factor":"$(2)","moe-token-drop-policy":"$(3)"}' \
  '{"event":"train","step":1,"loss":4.3,"dropped_tokens":$(4)}' \
  '{"event":"train","step":2,"loss":4.1,"dropped_tokens":$(5)}' \
  '{"event":"eval","step":2,"train_loss":4.0,"val_loss":$(6)}' > $(PLOT_TEST)/$(1).jsonl
endef
define PLOT_CH03_SHAPE   # name, rows over E = 2 experts, forward/dgrad ms: loop and ours (10 GFLOP each), wgrad += GB/s of ours
printf '%s\n' '$(1): T=1 H=8 F=8 E=2 k=1 -> $(2) rows, 1..2 per expert' 'our wgrad splits each group' \
  '| GEMM | GFLOP | loop ms | TFLOP/s | grouped ms | TFLOP/s | grouped % of dense |' '|---|---|---|---|---|---|---|' \
  '| fc1 forward | 10 | $(4) | 1 | $(3) | 1 | 1% |' '| fc2 forward | 10 | $(4) | 1 | $(3) | 1 | 1% |' \
  '| fc1 dgrad | 10 | $(4) | 1 | $(3) | 1 | 1% |' '| fc2 dgrad | 10 | $(4) | 1 | $(3) | 1 | 1% |' \
  '| fc1 wgrad += | 10 | 2 | 5 (50 GB/s) | 1 | 10 ($(5) GB/s) | 1% |' '| fc2 wgrad += | 10 | 2 | 5 (50 GB/s) | 1 | 10 ($(5) GB/s) | 1% |' \
  '| fc1 wgrad bf16 | 10 | - | - | 0.5 | 20 (40 GB/s) | 2% |' '| fc2 wgrad bf16 | 10 | - | - | 0.5 | 20 (40 GB/s) | 2% |' '' \
  > $(PLOT_TEST)/$(1).txt
endef
test-plots:
	@echo "== which kernels' device code changed (tools/device_code_diff.py)"
	@NVCC=$(NVCC) tools/test_device_code_diff.sh
	@echo "== run summaries (tools/metrics_summary.py)"
	@mkdir -p $(PLOT_TEST) && printf '%s\n' '{"event":"config"}' \
	  '{"event":"train","step":1,"loss":5.0,"step_s":0.9,"tokens_per_s":10}' \
	  '{"event":"train","step":2,"loss":4.0,"step_s":0.020,"tokens_per_s":400}' \
	  '{"event":"train","step":3,"loss":3.0,"step_s":0.010,"tokens_per_s":800}' \
	  '{"event":"train","step":4,"loss":2.0,"step_s":0.030,"tokens_per_s":300}' \
	  '{"event":"eval","step":4,"train_loss":2.1,"val_loss":2.5}' > $(PLOT_TEST)/summary.jsonl && \
	  test "$$($(PY) tools/metrics_summary.py $(PLOT_TEST)/summary.jsonl --after 1)" = "20.000 400 2.0000" && \
	  test "$$($(PY) tools/metrics_summary.py $(PLOT_TEST)/summary.jsonl --after 50% --tokens 80 --print ms,tps,tail,val)" = "20.000 4000 3.5000 2.5000" && \
	  ! $(PY) tools/metrics_summary.py $(PLOT_TEST)/summary.jsonl --after 4 2> $(PLOT_TEST)/summary.err && \
	  grep -q "no training step after --after 4" $(PLOT_TEST)/summary.err && \
	  echo "summaries: the warm-up left out (steps or a percentage), medians, the last and tail losses, a run too short refused"
	@echo "== plots (tools/plot_metrics.py, tools/plot_bench.py)"
	@if ! $(PY) -c 'import matplotlib' 2>/dev/null; then \
	  echo "skipped: python3-matplotlib not installed (sudo apt-get install python3-matplotlib)"; \
	else \
	  rm -rf $(PLOT_TEST) && mkdir -p $(PLOT_TEST) && \
	  printf '%s\n' '{"event":"config","num-experts":"8"}' \
	    '{"event":"train","step":1,"loss":4.3,"expert_load_min":100,"expert_load_max":900,"expert_load_mean":512}' \
	    '{"event":"train","step":2,"loss":3.9,"expert_load_min":300,"expert_load_max":700,"expert_load_mean":512}' \
	    '{"event":"eval","step":2,"train_loss":3.8,"val_loss":3.85}' > $(PLOT_TEST)/moe.jsonl && \
	  printf '%s\n' '{"event":"train","step":1,"loss":4.2}' '{"event":"train","step":2,"loss":4.0}' \
	    > $(PLOT_TEST)/dense.jsonl && \
	  $(PY) tools/plot_metrics.py --out $(PLOT_TEST) --title test \
	    $(PLOT_TEST)/moe.jsonl $(PLOT_TEST)/dense.jsonl && \
	  test -s $(PLOT_TEST)/loss.png && test -s $(PLOT_TEST)/expert_load.png && \
	  ! $(PY) tools/plot_metrics.py --out $(PLOT_TEST) $(PLOT_TEST)/missing.jsonl \
	    2> $(PLOT_TEST)/missing.err && grep -q 'no such file' $(PLOT_TEST)/missing.err && \
	  $(call PLOT_CAP_RUN,none,0,probs,0,0,3.9) && \
	  $(call PLOT_CAP_RUN,cf1p,1,probs,900,700,4.0) && \
	  $(call PLOT_CAP_RUN,cf1q,1,position,900,750,4.1) && \
	  $(call PLOT_CAP_RUN,cf2p,2,probs,10,0,3.95) && \
	  $(PY) tools/plot_metrics.py --figure dropped --out $(PLOT_TEST) $(PLOT_TEST)/none.jsonl \
	    $(PLOT_TEST)/cf1p.jsonl $(PLOT_TEST)/cf1q.jsonl $(PLOT_TEST)/cf2p.jsonl && \
	  test -s $(PLOT_TEST)/dropped.png && \
	  ! $(PY) tools/plot_metrics.py --figure dropped --out $(PLOT_TEST) $(PLOT_TEST)/dense.jsonl \
	    2> $(PLOT_TEST)/nocap.err && grep -q 'moe-expert-capacity-factor' $(PLOT_TEST)/nocap.err && \
	  echo "plots: loss.png, expert_load.png and dropped.png written, missing file and run without capacity refused" && \
	  printf '%s\n' 'H=64, E=8, top-2; bytes' '' \
	    '| tokens/rank | raw a2a ms | raw GB/s | collective ms | GB/s | of raw | fused ms | GB/s | of raw |' \
	    '|---|---|---|---|---|---|---|---|---|' \
	    '| 1024 | 0.1 | 100.0 | 0.2 | 50.0 | 50% | 0.1 | 90.0 | 90% |' \
	    '| 4096 | 0.2 | 200.0 | 0.3 | 120.0 | 60% | 0.2 | 210.0 | 105% |' > $(PLOT_TEST)/dispatch.txt && \
	  printf '%s\n' '| GEMM | A: loop | **ours** | ours, % of dense | B: loop | **ours** |' '|---|---:|---:|---:|---:|---:|' \
	    '| fc1 | 300 | **600** | 75% | 400 | 650 (1.0 ms) |' '| fc2 | 250 | 550 | 69% | 380 | 640 |' '' \
	    '| shape, backend | router | permute | GEMMs at |' '|---|---:|---:|---:|' \
	    '| A, loop | 0.40 ms (20%) | 1.60 ms (80%) | 300 TFLOP/s |' '| B, ours | 0.20 ms (10%) | 1.80 ms (90%) | 600 TFLOP/s |' \
	    > $(PLOT_TEST)/page.md && \
	  $(PY) tools/plot_bench.py dispatch $(PLOT_TEST)/dispatch.txt --out $(PLOT_TEST)/dispatch.png \
	    > $(PLOT_TEST)/dispatch.out && \
	  grep -qx '  H=64, E=8, top-2: tokens 1024 4096 | raw 100 200 | collective 50 120 | fused 90 210' $(PLOT_TEST)/dispatch.out && \
	  $(PY) tools/plot_bench.py bars $(PLOT_TEST)/page.md --table GEMM --ceiling 800 --out $(PLOT_TEST)/bars.png \
	    > $(PLOT_TEST)/bars.out && \
	  grep -qx '  A: rows fc1 / fc2: loop 300 250 | ours 600 550' $(PLOT_TEST)/bars.out && \
	  grep -qx '  B: rows fc1 / fc2: loop 400 380 | ours 650 640' $(PLOT_TEST)/bars.out && \
	  $(PY) tools/plot_bench.py stages $(PLOT_TEST)/page.md --table 'shape, backend' --out $(PLOT_TEST)/stages.png \
	    > $(PLOT_TEST)/stages.out && \
	  grep -qx '  A: loop router=0.4 permute=1.6' $(PLOT_TEST)/stages.out && \
	  test -s $(PLOT_TEST)/dispatch.png && test -s $(PLOT_TEST)/bars.png && test -s $(PLOT_TEST)/stages.png && \
	  ! $(PY) tools/plot_bench.py bars $(PLOT_TEST)/page.md --table nothere --out $(PLOT_TEST)/x.png \
	    2> $(PLOT_TEST)/notable.err && grep -q "no table whose header starts with 'nothere'" $(PLOT_TEST)/notable.err && \
	  ! $(PY) tools/plot_bench.py dispatch $(PLOT_TEST)/page.md --out $(PLOT_TEST)/x.png \
	    2> $(PLOT_TEST)/nodispatch.err && grep -q "no table with a 'raw GB/s' column" $(PLOT_TEST)/nodispatch.err && \
	  echo "plots: dispatch.png, bars.png and stages.png written with the numbers of their tables, missing tables refused" && \
	  $(call PLOT_CH03_SHAPE,qwen3,1024,0.25,0.5,20) && \
	  $(call PLOT_CH03_SHAPE,sweep64,128,1,2,100) && \
	  printf '%s\n' 'dense GEMM 8192^3 (the ceiling of this device): 1.000 ms, 800.0 TFLOP/s' '' \
	    '| shape | ours += | ours = | += vs compiled | = vs compiled |' '|---|---|---|---|---|' \
	    '| qwen3 | 1.0 | 0.9 | 1.1x | 1.2x |' '| sweep64 | 2.0 | 1.0 | 1.5x | 3.0x |' '' \
	    '| shape | ours bf16 | vs compiled |' '|---|---|---|' '| sweep64 | 1.0 | 1.2x |' \
	    | cat $(PLOT_TEST)/qwen3.txt $(PLOT_TEST)/sweep64.txt - > $(PLOT_TEST)/ch03.txt && \
	  $(PY) tools/plot_bench.py sweep $(PLOT_TEST)/ch03.txt --out $(PLOT_TEST)/sweep.png > $(PLOT_TEST)/sweep.out && \
	  grep -qx '  rows per expert: 64' $(PLOT_TEST)/sweep.out && \
	  grep -qx '  forward + dgrad: loop 5 | grouped 10' $(PLOT_TEST)/sweep.out && \
	  grep -qx '  wgrad: loop += 5 | grouped += 10 | grouped bf16 20' $(PLOT_TEST)/sweep.out && \
	  grep -qx '  layer vs PyTorch: (a) += vs compiled 1.5 | (a) = vs compiled 3 | (b) bf16 vs compiled 1.2' $(PLOT_TEST)/sweep.out && \
	  $(PY) tools/plot_bench.py roofline $(PLOT_TEST)/ch03.txt --out $(PLOT_TEST)/roofline.png > $(PLOT_TEST)/roofline.out && \
	  grep -qx '  ours +=: qwen3/fc1=500:10 qwen3/fc2=500:10 sweep64/fc1=100:10 sweep64/fc2=100:10' $(PLOT_TEST)/roofline.out && \
	  grep -qx '  ours bf16: qwen3/fc1=500:20 qwen3/fc2=500:20 sweep64/fc1=500:20 sweep64/fc2=500:20' $(PLOT_TEST)/roofline.out && \
	  grep -qx '  dense ceiling 800, roof bandwidth 100 GB/s' $(PLOT_TEST)/roofline.out && \
	  test -s $(PLOT_TEST)/sweep.png && test -s $(PLOT_TEST)/roofline.png && \
	  ! $(PY) tools/plot_bench.py sweep $(PLOT_TEST)/page.md --out $(PLOT_TEST)/x.png \
	    2> $(PLOT_TEST)/nosweep.err && grep -q "no GEMM table under a 'NAME: T=.. E=.. -> N rows' line" $(PLOT_TEST)/nosweep.err && \
	  echo "plots: sweep.png and roofline.png written with the numbers of chapter 03's tables, other shapes left out, a file without them refused" && \
	  printf '%s\n' '| T | ms per step | tokens/s | note |' '|---|---|---|---|' '| 4096 | 8 | 482,664 | a |' \
	    '| 16384 | 34 | 478,470 | b |' '| total | 42 | | |' > $(PLOT_TEST)/lines.md && \
	  $(PY) tools/plot_bench.py lines $(PLOT_TEST)/lines.md --table T --columns 'ms|tokens' \
	    --out $(PLOT_TEST)/lines.png > $(PLOT_TEST)/lines.out && test -s $(PLOT_TEST)/lines.png && \
	  grep -qx '  ms per step: 4096:8 16384:34' $(PLOT_TEST)/lines.out && \
	  grep -qx '  tokens/s: 4096:482664 16384:478470' $(PLOT_TEST)/lines.out && \
	  ! grep -q note $(PLOT_TEST)/lines.out && \
	  ! $(PY) tools/plot_bench.py lines $(PLOT_TEST)/lines.md --table T --columns zzz \
	    --out $(PLOT_TEST)/x.png 2> $(PLOT_TEST)/nolines.err && grep -q "no numeric column" $(PLOT_TEST)/nolines.err && \
	  printf '%s\n' '| T | GPUs | type | tokens/s |' '|---|---|---|---|' '| 1024 | 1 | - | 10 |' \
	    '| 1024 | 2 | p2p | 19 |' '| 1024 | 2 | a2a | 99 |' '| 2048 | 1 | - | 5 |' '| 2048 | 2 | p2p | 9 |' \
	    > $(PLOT_TEST)/by.md && \
	  $(PY) tools/plot_bench.py lines $(PLOT_TEST)/by.md --table T --by GPUs --where 'type=^(-|p2p)$$' \
	    --out $(PLOT_TEST)/by.png > $(PLOT_TEST)/by.out && test -s $(PLOT_TEST)/by.png && \
	  grep -qx '  tokens/s: GPUs 1: 1024:10 2048:5 | GPUs 2: 1024:19 2048:9' $(PLOT_TEST)/by.out && \
	  ! $(PY) tools/plot_bench.py lines $(PLOT_TEST)/by.md --table T --by nope \
	    --out $(PLOT_TEST)/x.png 2> $(PLOT_TEST)/noby.err && grep -q "no such column" $(PLOT_TEST)/noby.err && \
	  echo "plots: lines.png written against the first column, a row without a size left out, no matching column refused, one line per --by value with --where's rows"; \
	fi

# ---- figures: every PNG of docs/results/figures/ redrawn from the files in the tree (the
# runs behind them and the commands: docs/results/figures.md). The PNGs are byte-stable
# for a given matplotlib (Debian's 3.6.3 drew the committed ones): `git status` after
# `make figures` shows what a change to the tools or the data did to them.
FIG = docs/results/figures
FIG_RUNS = $(FIG)/runs
FIG_CH02 = docs/results/runs/multigpu_ch02_e3716dc.txt
FIG_CH03 = docs/results/03-grouped-gemm.md
FIG_CH03_II = docs/results/runs/ch03_bench_dc547fa.txt
FIG_CH05 = docs/results/runs/ch05_convergence_776f6dd
FIG_CH07 = docs/results/07-long-context.md
figures:
	@$(PY) -c 'import matplotlib' 2>/dev/null || \
	  { echo "make figures needs python3-matplotlib: sudo apt-get install python3-matplotlib"; exit 1; }
	$(PY) tools/plot_metrics.py --out $(FIG) --prefix ch01_moe_vs_dense_ --figure loss \
	  --title "default CPU model, 100 steps" --label MoE --label dense $(FIG_RUNS)/moe.jsonl $(FIG_RUNS)/dense.jsonl
	$(PY) tools/plot_metrics.py --out $(FIG) --prefix ch01_balancing_ \
	  --title "default CPU model, 100 steps" --label "aux loss 0.01" --label "no aux loss" \
	  --label "sigmoid + expert bias, no aux loss" $(FIG_RUNS)/moe.jsonl $(FIG_RUNS)/moe_noaux.jsonl $(FIG_RUNS)/moe_bias.jsonl
	$(PY) tools/plot_metrics.py --out $(FIG) --prefix ch02_capacity_ --figure dropped \
	  --title "default CPU model, EP = 2 on 2 CPU ranks, 100 steps" $(FIG_RUNS)/ch02_capacity/*.jsonl
	$(PY) tools/plot_bench.py dispatch $(FIG_CH02) --out $(FIG)/ch02_dispatch_gbps.png \
	  --title "dispatch + combine vs raw all-to-all, 2 × H200 (NVLink), commit e3716dc"
	$(PY) tools/plot_bench.py bars $(FIG_CH03) --table GEMM --out $(FIG)/ch03_gemm_tflops.png \
	  --ceiling 793.7 --ceiling-label "dense bf16 cuBLAS 8192³, same run: 793.7" \
	  --title "the six expert GEMMs per backend, H200, commit d0de9c5 (03-grouped-gemm.md)"
	$(PY) tools/plot_bench.py stages $(FIG_CH03) --table "shape, backend" --out $(FIG)/ch03_layer_stages.png \
	  --title "where the MoE layer's time goes, H200, commit d0de9c5 (03-grouped-gemm.md)"
	$(PY) tools/plot_bench.py sweep $(FIG_CH03_II) --out $(FIG)/ch03_sweep_rows_per_expert.png \
	  --title "the sweep (H=4096, F=1536, k=8, E = T·k / R): expert GEMMs per backend and the layer vs PyTorch, H200, commit dc547fa"
	$(PY) tools/plot_bench.py roofline $(FIG_CH03_II) --out $(FIG)/ch03_wgrad_roofline.png \
	  --title "wgrad: achieved TFLOP/s against FLOP per byte, every shape of the run, H200, commit dc547fa"
	for m in preset large; do $(PY) tools/plot_metrics.py --out $(FIG) --prefix ch05_convergence_$${m}_ \
	  --figure loss --smooth 10 --title "$$m model, NVIDIA H100 80GB HBM3, commit 776f6dd" \
	  $(foreach r,bf16 tensorwise blockwise mxfp8 nvfp4,--label $(r)) \
	  $(foreach r,bf16 tensorwise blockwise mxfp8 nvfp4,$(FIG_CH05)/ch05_conv_$${m}_$(r).jsonl) || exit 1; done
	$(PY) tools/plot_bench.py lines $(FIG_CH07) --table "T (tokens in one sequence)" \
	  --columns "ms|tokens|memory" --out $(FIG)/ch07_longest_sequence.png \
	  --title "the GPU preset's model, one sequence of T tokens, one H100, commit bc51e05"
	$(PY) tools/plot_bench.py lines $(FIG_CH07) --table "T (tokens)" --by GPUs \
	  --where "CP comm type=^(-|p2p)$$" --columns "tokens/s|efficiency|memory" \
	  --out $(FIG)/ch07_cp_scaling.png \
	  --title "the GPU preset's model, one sequence of T tokens, ring CP on 1-4 H100s, commit dc6a8b9"

# ---- docs
docs:
	@if [ -z "$(DOXYGEN)" ]; then echo "make docs needs Doxygen: sudo apt-get install doxygen"; exit 1; fi
	@mkdir -p $(BUILD)/docs
	doxygen docs/Doxyfile

# ---- benchmarks
# Every benchmark program, each printing its device, date, commit and the ratio to its
# chapter's baseline measured in the same run (GPU shapes when a GPU is present).
bench: all
	./bin/moe-bench
	./bin/ch01_moe_layer_bench
	@if [ "$(WITH_MPI)" = 1 ]; then OMP_NUM_THREADS=1 $(MPIRUN) -np 2 ./bin/ch02_dispatch_bench; \
	else echo "ch02 dispatch benchmark: skipped (needs MPI)"; fi
	@if [ "$(WITH_MPI)" = 1 ]; then OMP_NUM_THREADS=1 $(MPIRUN) -np 4 ./bin/ch04_folding_bench; \
	else echo "ch04 folding benchmark: skipped (needs MPI)"; fi
	./bin/ch03_grouped_gemm_bench
	@if [ "$(WITH_CUDA)" = 1 ]; then ./bin/ch05_fp8_gemm_bench; \
	else echo "ch05 FP8 GEMM benchmark: skipped (built without CUDA)"; fi
	./bin/ch01_moe_layer_bench --impl grouped --precision bf16,fp8
	@if [ "$(WITH_CUDA)" = 1 ]; then ./bin/ch06_graphs_bench; \
	else echo "ch06 graphs benchmark: skipped (built without CUDA)"; fi
	@if [ "$(WITH_CUDA)" = 1 ]; then ./bin/ch07_attention_bench; \
	else echo "ch07 attention benchmark: skipped (built without CUDA)"; fi
	@if [ "$(WITH_MPI)" = 1 ]; then OMP_NUM_THREADS=1 $(MPIRUN) -np 2 ./bin/ch07_cp_bench \
	  --seqs 1024,2048 --heads 4 --dim 64; \
	else echo "ch07 context-parallel benchmark: skipped (needs MPI; GPUs: tools/multigpu.sh ch07)"; fi

# For tools that compile C against the library (the notebooks' %%c cells).
print-build-flags:
	@echo "CC=$(CC)"
	@echo "CFLAGS=$(ALL_CFLAGS)"
	@echo "LIB=$(abspath $(LIB))"
	@echo "LDLIBS=$(LDLIBS)"

clean:
	rm -rf $(BUILD) bin

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
