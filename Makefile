# roce_gather: the NCCL plugin library, plugincheck and the tests.
GO ?= go
CC ?= gcc
BUILD := build
DRIVER_CFLAGS := -O2 -g -std=gnu11 -Wall -Wextra -Werror -Iinclude

# The machine the binaries are for: this one, or GOARCH=arm64 (CC=aarch64-linux-gnu-gcc, the
# default for it) cross-built on x86-64, whose binaries go to build/arm64/ beside the native
# ones and start here under qemu-user (tests/arm64/exec); the wheel lands in build/ either way.
HOST_GOARCH := $(shell $(GO) env GOHOSTARCH)
GOARCH ?= $(HOST_GOARCH)
ifeq ($(GOARCH),$(HOST_GOARCH))
OUT := $(BUILD)
TARGET_EXEC :=
else ifeq ($(GOARCH),arm64)
OUT := $(BUILD)/arm64
TARGET_EXEC := $(CURDIR)/tests/arm64/exec
ifeq ($(origin CC),default)
CC := aarch64-linux-gnu-gcc
endif
# go build turns cgo off when cross-compiling unless told; cgo takes the compiler from CC.
export CGO_ENABLED := 1
export CC GOARCH
else
$(error GOARCH=$(GOARCH): this Makefile builds for this machine ($(HOST_GOARCH)) or cross-builds GOARCH=arm64)
endif
LIB := $(OUT)/libroce_gather.so

.PHONY: all check test test-all test-arm64 test-load test-rxe vet fmt lint clean kernels kernels-oneshot install wheel need-build need-wheel need-test need-rxe need-arm64 need-arm64-test
all: $(LIB) $(OUT)/libnccl-net-roce_gather.so $(OUT)/plugincheck $(OUT)/plugincheck-driver $(OUT)/kernel-check $(OUT)/abort-nccl $(OUT)/gather-nccl

GO_SOURCES := $(shell find . -name '*.go' -not -path './build/*') $(shell find . -name '*.[ch]' -not -path './build/*' -not -path './cmd/*') kernels/roce_gather.ptx go.mod go.sum build/exports.map

# What each kind of target needs from the system (build/setup.sh installs it): a missing
# header or tool is named in one line, with the command that installs it, before anything runs.
# A cross build for aarch64 needs its compiler and C library as well (the arm64 group).
need-build: $(if $(TARGET_EXEC),need-arm64)
need-build need-wheel need-test need-rxe need-arm64 need-arm64-test:
	@build/setup.sh --check $(@:need-%=%)

$(LIB): $(GO_SOURCES) | need-build
	@mkdir -p $(@D)
	$(GO) build -buildmode=c-shared -trimpath \
		-ldflags "-extldflags=-Wl,--version-script=$(CURDIR)/build/exports.map" -o $@ .
	rm -f $(OUT)/libroce_gather.h

# NCCL_NET_PLUGIN=roce_gather finds the library under this name on the library path.
$(OUT)/libnccl-net-roce_gather.so: $(LIB)
	ln -sf libroce_gather.so $@

$(OUT)/plugincheck: $(GO_SOURCES) | need-build
	@mkdir -p $(@D)
	$(GO) build -trimpath -o $@ ./cmd/plugincheck

$(OUT)/plugincheck-driver: $(wildcard cmd/plugincheck/driver/*.c cmd/plugincheck/driver/*.h) $(wildcard include/nccl/*.h) | need-build
	@mkdir -p $(@D)
	$(CC) $(DRIVER_CFLAGS) -o $@ $(filter %.c,$^) -ldl -lpthread

# The GPU check of the gather kernel (tests/gpu/kernel_check.c); builds anywhere, runs where a GPU is.
KERNEL_CHECK_SRC := tests/gpu/kernel_check.c kernels/place.c internal/cudadrv/cudadrv.c
$(OUT)/kernel-check: $(KERNEL_CHECK_SRC) kernels/place.h internal/cudadrv/cudadrv.h include/cuda_subset.h | need-build
	@mkdir -p $(@D)
	$(CC) $(DRIVER_CFLAGS) -o $@ $(KERNEL_CHECK_SRC) -ldl -lpthread

# NCCL through its C API for tests/gpu: ncclCommAbort after the peer's death, and gathers
# with no framework around them. NCCL is opened at run time. Steps capi and abort build the
# same cases linked with -lnccl on the GPU machine (tests/gpu/gather_linked.c).
NCCL_MIN := tests/gpu/nccl_min.c tests/gpu/nccl_dlopen.c internal/cudadrv/cudadrv.c
NCCL_MIN_H := tests/gpu/nccl_min.h tests/gpu/nccl_api.h internal/cudadrv/cudadrv.h include/cuda_subset.h
$(OUT)/abort-nccl $(OUT)/gather-nccl: $(OUT)/%-nccl: tests/gpu/%_nccl.c $(NCCL_MIN) $(NCCL_MIN_H) | need-build
	@mkdir -p $(@D)
	$(CC) $(DRIVER_CFLAGS) -o $@ $< $(NCCL_MIN) -ldl -lpthread

# Rebuilds the embedded PTX of the gather kernel; needs nvcc (any CUDA 11.8 or newer).
# compute_75 PTX of ISA 7.8 (nvcc 11.8) loads on every CUDA 12 and 13 driver and runs on
# Turing and every later GPU; the first line records the source it came from.
NVCC ?= nvcc
KERNEL_ARCH := compute_75
kernels:
	$(NVCC) -ptx -arch=$(KERNEL_ARCH) -o kernels/roce_gather.ptx.tmp kernels/roce_gather.cu
	{ echo "// source-sha256: $$(sha256sum kernels/roce_gather.cu | cut -d' ' -f1)"; cat kernels/roce_gather.ptx.tmp; } >kernels/roce_gather.ptx
	rm -f kernels/roce_gather.ptx.tmp

# Rebuilds the embedded PTX of the intercepted gather's kernel with clang's CUDA mode, which
# needs no CUDA toolkit (Debian's clang-14). PTX ISA 6.3 for compute_75 loads on every
# CUDA 11 and later driver; the first line records the sources it came from.
CLANG_CUDA ?= clang-14
ONESHOT_SRC := kernels/oneshot.h kernels/oneshot_body.h kernels/oneshot.cu
ONESHOT_CFLAGS := --cuda-device-only -nocudainc -nocudalib --cuda-gpu-arch=sm_75 -O3 -Wall -Wextra -Werror -S
kernels-oneshot:
	$(CLANG_CUDA) $(ONESHOT_CFLAGS) -o kernels/oneshot.ptx.tmp kernels/oneshot.cu
	{ echo "// source-sha256: $$(cat $(ONESHOT_SRC) | sha256sum | cut -d' ' -f1)"; cat kernels/oneshot.ptx.tmp; } >kernels/oneshot.ptx
	rm -f kernels/oneshot.ptx.tmp

# make install [PREFIX=/usr/local] [DESTDIR=]: the library under both names in lib/ (with
# PREFIX/lib on the library path, NCCL_NET_PLUGIN=roce_gather finds it), plugincheck in
# bin/, and its driver, which only plugincheck runs, in libexec/roce_gather/. plugincheck
# finds the library and the driver from where it is installed.
PREFIX ?= /usr/local
install: $(LIB) $(OUT)/plugincheck $(OUT)/plugincheck-driver
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/libexec/roce_gather
	install -m 755 $(LIB) $(DESTDIR)$(PREFIX)/lib/libroce_gather.so
	ln -sf libroce_gather.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-roce_gather.so
	install -m 755 $(OUT)/plugincheck $(DESTDIR)$(PREFIX)/bin/plugincheck
	install -m 755 $(OUT)/plugincheck-driver $(DESTDIR)$(PREFIX)/libexec/roce_gather/plugincheck-driver

# make wheel: build/roce_gather-VERSION-py3-none-linux_x86_64.whl (linux_aarch64 for GOARCH=arm64),
# the library (both names), plugincheck and its driver in make install's layout inside the Python
# package python/roce_gather (build/wheel.py says why that tag, and checks that every binary is
# for that machine). pip install it; python -m roce_gather check checks it.
wheel: $(LIB) $(OUT)/plugincheck $(OUT)/plugincheck-driver | need-wheel
	python3 build/wheel.py --build $(OUT) --out $(BUILD) --arch $(GOARCH)

# Builds the library and runs plugincheck's main job: the ABI check. Cross-built, plugincheck
# and the driver it starts run under qemu-user (the driver through a two-line script, since
# an emulated program starts every child natively).
check: all $(if $(TARGET_EXEC),$(OUT)/plugincheck-driver.emulated)
	$(TARGET_EXEC) $(OUT)/plugincheck abi $(if $(TARGET_EXEC),--driver $(OUT)/plugincheck-driver.emulated)

$(OUT)/plugincheck-driver.emulated: $(OUT)/plugincheck-driver
	printf '#!/bin/sh\nexec %s %s "$$@"\n' '$(TARGET_EXEC)' '$(CURDIR)/$<' >$@
	chmod +x $@

vet:
	$(GO) vet ./...

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

lint: vet fmt

# The tests that need no guest: static checks, Go unit tests, the ABI and two-process tests
# that drive the built library through plugincheck's driver, the wheel installed in a fresh
# virtual environment (tests/wheel), the Python package's and the GPU scripts' own logic.
test: all lint wheel | need-test
	$(GO) test -count=1 ./...
	python3 python/test_roce_gather.py
	python3 tests/gpu/test_logic.py

# Every test, the README's second command: make test, then the soft-RoCE guest.
test-all: test
	$(if $(filter arm64,$(HOST_GOARCH)),,$(MAKE) test-arm64)
	$(MAKE) test-rxe

# make test-arm64: the aarch64 build and the aarch64 host tests, on x86-64 under qemu-user
# (tests/arm64/README.md says what each costs and why these): the cross build, the aarch64
# wheel and the ABI check; the Go unit tests of the packages that carry logic, as aarch64 test
# binaries (go test -exec tests/arm64/exec); the two-process tests of the intercepted engine
# (tests/intercept, Go on this machine starting aarch64 C children; internal/testtarget). An
# aarch64 host runs all of it natively in make test, and this target there without qemu.
# -trimpath: the test binaries' cgo objects name no folder, so a fresh clone (CI's) finds them
# in the Go cache that another clone filled.
ifeq ($(HOST_GOARCH),arm64)
ARM64_OUT := $(BUILD)
ARM64_CC := gcc
ARM64_GOTEST := $(GO) test -count=1 -trimpath
ARM64_CHILD :=
else
ARM64_OUT := $(BUILD)/arm64
ARM64_CC := aarch64-linux-gnu-gcc
ARM64_GOTEST := GOARCH=arm64 CGO_ENABLED=1 CC=$(ARM64_CC) $(GO) test -count=1 -trimpath -exec $(CURDIR)/tests/arm64/exec
# Started as qemu itself, not through tests/arm64/exec: a shell would be an x86-64 process
# under the aarch64 LD_PRELOAD of the tests that set one.
ARM64_CHILD := qemu-aarch64-static -L /usr/aarch64-linux-gnu
endif
# The aarch64 way in is LD_PRELOAD until entry hooks reach NCCL_NET_PLUGIN's callers there:
# then drop RG_TEST_PRELOAD and ARM64_INTERCEPT_RUN, and every test of tests/intercept runs.
ARM64_INTERCEPT_ENV := RG_TEST_CC=$(ARM64_CC) RG_TEST_EXEC="$(ARM64_CHILD)" RG_TEST_BUILD=$(ARM64_OUT) RG_TEST_GOARCH=arm64 RG_TEST_PRELOAD=1
ARM64_INTERCEPT_RUN := -run '^(TestInterceptedGathersTakeThePathExactlyWithinTheWindow|TestInterceptedGatherCapIsTheSmallerOnBothRanks511And512KiB|TestOneRankDisabledKeepsEveryGatherOnNCCLOnBoth|TestPairsClosingRightAfterTheirLastGatherLoseNothing|TestPeerKilledMidGatherFailsTheGatherWithoutARow|TestPeerThatNeverJoinsTimesOutAtTheDeadline|TestSilentPeerFailsTheGatherWithinTheDeadline|TestAbortInFlightEndsTheWaitingGather|TestDestroyInFlightReturnsWithinTwiceTheDeadline)$$'
# roce/verbs' lane tests load libibverbs.so.1, which Debian has for aarch64 only in a multiarch
# install (dpkg --add-architecture), which this target does not make.
test-arm64: | $(if $(ARM64_CHILD),need-arm64 need-arm64-test)
	$(MAKE) --no-print-directory GOARCH=arm64 CC=$(ARM64_CC) all wheel check
	$(ARM64_GOTEST) ./plugin ./roce ./roce/gather ./kernels
	$(ARM64_GOTEST) ./roce/verbs $(if $(ARM64_CHILD),-skip '^TestLane')
	$(ARM64_INTERCEPT_ENV) $(GO) test -count=1 -trimpath ./tests/intercept $(ARM64_INTERCEPT_RUN)
	RG_TEST_BUILD=$(ARM64_OUT) RG_TEST_GOARCH=arm64 $(GO) test -count=1 -trimpath ./tests/wheel

# make test beside one busy loop a core (LOAD_LOOPS), LOAD_RUNS times in a row, as on a CI
# machine other jobs share; the loops stop however it ends (tests/under-load.sh).
LOAD_LOOPS ?= $(shell nproc)
LOAD_RUNS ?= 1
test-load: all
	tests/under-load.sh -l $(LOAD_LOOPS) -r $(LOAD_RUNS) -- $(MAKE) --no-print-directory test

# The verbs checks on a real verbs stack: soft-RoCE (rdma_rxe) in a QEMU guest booting
# Debian's kernel (tests/rxe/README.md). The first run downloads Debian packages into a cache.
test-rxe: all | need-rxe
	$(GO) test -c -o $(BUILD)/rxe.test ./tests/rxe
	$(GO) test -c -o $(BUILD)/verbs.test ./roce/verbs
	$(GO) test -c -o $(BUILD)/plugincheck.test ./cmd/plugincheck
	$(GO) test -c -o $(BUILD)/gather.test ./roce/gather
	tests/rxe/run.sh

clean:
	rm -rf $(BUILD)/lib* $(BUILD)/plugincheck* $(BUILD)/kernel-check $(BUILD)/abort-nccl $(BUILD)/gather-nccl \
		$(BUILD)/rxe.test $(BUILD)/verbs.test $(BUILD)/gather.test $(BUILD)/roce_gather-*.whl $(BUILD)/arm64

