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

.PHONY: all check test test-all test-arm64 test-asan test-load test-rxe vet fmt lint clean kernels-oneshot install wheel need-build need-wheel need-test need-rxe need-arm64 need-arm64-test
all: $(LIB) $(OUT)/libnccl-net-roce_gather.so $(OUT)/plugincheck $(OUT)/plugincheck-driver $(OUT)/plugincheck-rank $(OUT)/abort-nccl $(OUT)/gather-nccl

GO_SOURCES := $(shell find . -name '*.go' -not -path './build/*') $(shell find . -name '*.[ch]' -not -path './build/*' -not -path './cmd/*') kernels/oneshot.ptx go.mod go.sum build/exports.map

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

# plugincheck's C programs (cmd/plugincheck/driver): the ABI driver, which loads the library
# with no NCCL around, and the rank program, a NCCL application linked with the stand-in NCCL
# (cmd/plugincheck/standin), which it finds beside itself (RUNPATH $ORIGIN).
PC_C := cmd/plugincheck/driver
PC_H := $(wildcard $(PC_C)/*.h) $(wildcard include/nccl/*.h)
DRIVER_SRC := $(addprefix $(PC_C)/,driver.c abi.c lifecycle.c util.c)
# The rank's verbs floor opens libibverbs through the library's own wrappers (roce/verbs/ibv.c).
RANK_SRC := $(addprefix $(PC_C)/,rank.c bench.c load.c floor_tcp.c floor_verbs.c util.c) roce/verbs/ibv.c
RANK_H := roce/verbs/ibv.h roce/fabric/fabric.h
$(OUT)/plugincheck-driver: $(DRIVER_SRC) $(PC_H) | need-build
	@mkdir -p $(@D)
	$(CC) $(DRIVER_CFLAGS) -o $@ $(DRIVER_SRC) -ldl -lpthread

# Its own soname, so that it is never taken for a real libnccl.
$(OUT)/libnccl-standin.so: cmd/plugincheck/standin/nccl.c $(wildcard include/nccl/*.h) | need-build
	@mkdir -p $(@D)
	$(CC) $(DRIVER_CFLAGS) -shared -fPIC -DFAKE_NAME='"standin"' -Wl,-soname,libnccl-standin.so -o $@ $< -ldl -lpthread

$(OUT)/plugincheck-rank: $(RANK_SRC) $(PC_H) $(RANK_H) $(OUT)/libnccl-standin.so | need-build
	$(CC) $(DRIVER_CFLAGS) -Iroce/verbs -o $@ $(RANK_SRC) -L$(OUT) -l:libnccl-standin.so -Wl,--enable-new-dtags,-rpath,'$$ORIGIN' \
		-ldl -lpthread

# NCCL through its C API for tests/gpu and tests/nccl-versions: gathers with no framework
# around them, and ncclCommAbort after the peer's death. Linked with -lnccl, as a user's C
# program is (each call through the program's own relocation slot, which the library rebinds),
# against a stand-in libnccl.so.2 that serves the link only (tests/gpu/nccl_stub.c; clean's
# lib* removes it); at run time the library path gives NCCL's own.
NCCL_STUB := $(OUT)/libnccl-stub/libnccl.so
NCCL_MIN := tests/gpu/nccl_min.c internal/cudadrv/cudadrv.c
NCCL_MIN_H := tests/gpu/nccl_min.h tests/gpu/nccl_api.h include/nccl/api.h include/nccl/common.h \
	internal/cudadrv/cudadrv.h include/cuda_subset.h
$(NCCL_STUB): tests/gpu/nccl_stub.c tests/gpu/nccl_api.h include/nccl/api.h include/nccl/common.h | need-build
	mkdir -p $(@D)
	$(CC) $(DRIVER_CFLAGS) -shared -fPIC -Wl,-soname,libnccl.so.2 -o $@ $<
$(OUT)/abort-nccl $(OUT)/gather-nccl: $(OUT)/%-nccl: tests/gpu/%_nccl.c $(NCCL_MIN) $(NCCL_MIN_H) $(NCCL_STUB) | need-build
	$(CC) $(DRIVER_CFLAGS) -o $@ $< $(NCCL_MIN) -L$(dir $(NCCL_STUB)) -lnccl -ldl -lpthread

# Rebuilds the embedded PTX of the intercepted gather's kernel with clang's CUDA mode, which
# needs no CUDA toolkit (Debian's clang-14). PTX ISA 6.3 for compute_75 loads on every
# CUDA 11 and later driver; the first line records the sources it came from.
CLANG_CUDA ?= clang-14
ONESHOT_SRC := kernels/oneshot.h kernels/oneshot_reduce.h kernels/oneshot_body.h kernels/oneshot.cu
ONESHOT_CFLAGS := --cuda-device-only -nocudainc -nocudalib --cuda-gpu-arch=sm_75 -O3 -ffp-contract=off -Wall -Wextra -Werror -S
# It also writes kernels/oneshot_sources.go, the same hash as a Go constant: go rebuilds the C of
# a package when its own files change, not when a header of another package's does, and the
# constant changes the kernels package's export data, so every package that includes the
# sources (the host stand-in, the proxy) is rebuilt with them.
kernels-oneshot:
	$(CLANG_CUDA) $(ONESHOT_CFLAGS) -o kernels/oneshot.ptx.tmp kernels/oneshot.cu
	{ echo "// source-sha256: $$(cat $(ONESHOT_SRC) | sha256sum | cut -d' ' -f1)"; cat kernels/oneshot.ptx.tmp; } >kernels/oneshot.ptx
	rm -f kernels/oneshot.ptx.tmp
	{ echo "// Code generated by make kernels-oneshot; DO NOT EDIT."; echo; echo "package kernels"; echo; \
	  echo "// OneShotSourceSHA256 is the SHA-256 of the one-shot kernel's sources, as kernels/oneshot.ptx's first line."; \
	  echo "const OneShotSourceSHA256 = \"$$(cat $(ONESHOT_SRC) | sha256sum | cut -d' ' -f1)\""; } >kernels/oneshot_sources.go

# make install [PREFIX=/usr/local] [DESTDIR=]: the library under both names in lib/ (with
# PREFIX/lib on the library path, NCCL_NET_PLUGIN=roce_gather finds it), plugincheck in
# bin/, and what only plugincheck runs in libexec/roce_gather/: its driver, its rank program
# and the stand-in NCCL beside it. plugincheck finds them all from where it is installed.
PREFIX ?= /usr/local
PC_LIBEXEC := $(OUT)/plugincheck-driver $(OUT)/plugincheck-rank $(OUT)/libnccl-standin.so
install: $(LIB) $(OUT)/plugincheck $(PC_LIBEXEC)
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/libexec/roce_gather
	install -m 755 $(LIB) $(DESTDIR)$(PREFIX)/lib/libroce_gather.so
	ln -sf libroce_gather.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-roce_gather.so
	install -m 755 $(OUT)/plugincheck $(DESTDIR)$(PREFIX)/bin/plugincheck
	install -m 755 $(PC_LIBEXEC) $(DESTDIR)$(PREFIX)/libexec/roce_gather/

# make wheel: build/roce_gather-VERSION-py3-none-linux_x86_64.whl (linux_aarch64 for GOARCH=arm64),
# the library (both names), plugincheck and what it runs in make install's layout inside the Python
# package python/roce_gather (build/wheel.py says why that tag, and checks that every binary is
# for that machine). pip install it; python -m roce_gather check checks it.
wheel: $(LIB) $(OUT)/plugincheck $(PC_LIBEXEC) | need-wheel
	python3 build/wheel.py --build $(OUT) --out $(BUILD) --arch $(GOARCH)

# Builds the library and runs plugincheck's main job: the ABI check. Cross-built, plugincheck
# and the driver it starts run under qemu-user (the driver through a two-line script, since
# an emulated program starts every child natively).
check: all $(if $(TARGET_EXEC),$(OUT)/plugincheck-driver.emulated) | $(if $(TARGET_EXEC),need-arm64-test)
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
	python3 tests/python/test_roce_gather.py
	python3 tests/gpu/test_logic.py

# Every test, the README's second command: make test, the engine under AddressSanitizer, then
# the soft-RoCE guest.
test-all: test
	$(MAKE) test-asan
	$(if $(filter arm64,$(HOST_GOARCH)),,$(MAKE) test-arm64)
	$(MAKE) test-rxe

# The one-shot engine's host tests under AddressSanitizer (gcc's libasan, which gcc brings):
# its Go tests in one process, built with -asan, and the interceptor's two-process tests of
# the engine on a build of the library with -asan, its runtime preloaded into every process
# of a job. A use after free, at close or anywhere, fails them.
ASAN_LIB := $(BUILD)/asan/libroce_gather.so
ONESHOT_INTERCEPT_TESTS := ^(TestInterceptedGather|TestOneRankDisabled|TestPairsClosing|TestPeer|TestSilentPeer|TestAbortInFlight|TestDestroyInFlight|TestRanksWhose)
test-asan: all | need-test
	$(GO) build -asan -buildmode=c-shared -trimpath \
		-ldflags "-extldflags=-Wl,--version-script=$(CURDIR)/build/exports.map" -o $(ASAN_LIB) .
	rm -f $(BUILD)/asan/libroce_gather.h
	$(GO) test -asan -count=1 -run '^(TestInterceptedGather|TestForeignConnections)' ./roce/gather/
	RG_TEST_ONESHOT_LIB=$(CURDIR)/$(ASAN_LIB) RG_TEST_PRELOAD=$$($(CC) -print-file-name=libasan.so) \
		$(GO) test -count=1 -run '$(ONESHOT_INTERCEPT_TESTS)' ./tests/intercept/

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
ARM64_CHILD := qemu-aarch64 -L /usr/aarch64-linux-gnu
endif
ARM64_INTERCEPT_ENV := RG_TEST_CC=$(ARM64_CC) RG_TEST_EXEC="$(ARM64_CHILD)" RG_TEST_BUILD=$(ARM64_OUT) RG_TEST_GOARCH=arm64
# roce/verbs' lane tests load libibverbs.so.1, which Debian has for aarch64 only in a multiarch
# install (dpkg --add-architecture), which this target does not make.
test-arm64: | $(if $(ARM64_CHILD),need-arm64 need-arm64-test)
	$(MAKE) --no-print-directory GOARCH=arm64 CC=$(ARM64_CC) all wheel check
	$(ARM64_GOTEST) ./plugin ./roce ./roce/gather ./kernels
	$(ARM64_GOTEST) ./roce/verbs $(if $(ARM64_CHILD),-skip '^TestLane')
	$(ARM64_INTERCEPT_ENV) $(GO) test -count=1 -trimpath ./tests/intercept
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
	rm -rf $(BUILD)/lib* $(BUILD)/asan $(BUILD)/plugincheck* $(BUILD)/abort-nccl $(BUILD)/gather-nccl \
		$(BUILD)/rxe.test $(BUILD)/verbs.test $(BUILD)/gather.test $(BUILD)/roce_gather-*.whl $(BUILD)/arm64

