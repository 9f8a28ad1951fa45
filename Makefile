# roce_gather: the NCCL plugin library, plugincheck and the tests.
GO ?= go
CC ?= gcc
BUILD := build
DRIVER_CFLAGS := -O2 -g -std=gnu11 -Wall -Wextra -Werror -Iinclude
LIB := $(BUILD)/libroce_gather.so

.PHONY: all check test test-all test-load test-rxe vet fmt lint clean kernels-oneshot install wheel need-build need-wheel need-test need-rxe
all: $(LIB) $(BUILD)/libnccl-net-roce_gather.so $(BUILD)/plugincheck $(BUILD)/plugincheck-driver $(BUILD)/plugincheck-rank $(BUILD)/abort-nccl $(BUILD)/gather-nccl

GO_SOURCES := $(shell find . -name '*.go' -not -path './build/*') $(shell find . -name '*.[ch]' -not -path './build/*' -not -path './cmd/*') kernels/oneshot.ptx go.mod go.sum build/exports.map

# What each kind of target needs from the system (build/setup.sh installs it): a missing
# header or tool is named in one line, with the command that installs it, before anything runs.
need-build need-wheel need-test need-rxe:
	@build/setup.sh --check $(@:need-%=%)

$(LIB): $(GO_SOURCES) | need-build
	$(GO) build -buildmode=c-shared -trimpath \
		-ldflags "-extldflags=-Wl,--version-script=$(CURDIR)/build/exports.map" -o $@ .
	rm -f $(BUILD)/libroce_gather.h

# NCCL_NET_PLUGIN=roce_gather finds the library under this name on the library path.
$(BUILD)/libnccl-net-roce_gather.so: $(LIB)
	ln -sf libroce_gather.so $@

$(BUILD)/plugincheck: $(GO_SOURCES) | need-build
	$(GO) build -trimpath -o $@ ./cmd/plugincheck

# plugincheck's C programs (cmd/plugincheck/driver): the ABI driver, which loads the library
# with no NCCL around, and the rank program, a NCCL application linked with the stand-in NCCL
# (cmd/plugincheck/standin), which it finds beside itself (RUNPATH $ORIGIN).
PC_C := cmd/plugincheck/driver
PC_H := $(wildcard $(PC_C)/*.h) $(wildcard include/nccl/*.h)
DRIVER_SRC := $(addprefix $(PC_C)/,driver.c abi.c lifecycle.c util.c)
RANK_SRC := $(addprefix $(PC_C)/,rank.c bench.c load.c floor_tcp.c floor_verbs.c util.c)
$(BUILD)/plugincheck-driver: $(DRIVER_SRC) $(PC_H) | need-build
	$(CC) $(DRIVER_CFLAGS) -o $@ $(DRIVER_SRC) -ldl -lpthread

# Its own soname, so that it is never taken for a real libnccl.
$(BUILD)/libnccl-standin.so: cmd/plugincheck/standin/nccl.c $(wildcard include/nccl/*.h) | need-build
	$(CC) $(DRIVER_CFLAGS) -shared -fPIC -DFAKE_NAME='"standin"' -Wl,-soname,libnccl-standin.so -o $@ $< -ldl -lpthread

$(BUILD)/plugincheck-rank: $(RANK_SRC) $(PC_H) $(BUILD)/libnccl-standin.so | need-build
	$(CC) $(DRIVER_CFLAGS) -o $@ $(RANK_SRC) -L$(BUILD) -l:libnccl-standin.so -Wl,--enable-new-dtags,-rpath,'$$ORIGIN' \
		-ldl -lpthread

# NCCL through its C API for tests/gpu and tests/nccl-versions: gathers with no framework
# around them, and ncclCommAbort after the peer's death. Linked with -lnccl, as a user's C
# program is (each call through the program's own relocation slot, which the library rebinds),
# against a stand-in libnccl.so.2 that serves the link only (tests/gpu/nccl_stub.c; clean's
# lib* removes it); at run time the library path gives NCCL's own.
NCCL_STUB := $(BUILD)/libnccl-stub/libnccl.so
NCCL_MIN := tests/gpu/nccl_min.c internal/cudadrv/cudadrv.c
NCCL_MIN_H := tests/gpu/nccl_min.h tests/gpu/nccl_api.h include/nccl/api.h include/nccl/common.h \
	internal/cudadrv/cudadrv.h include/cuda_subset.h
$(NCCL_STUB): tests/gpu/nccl_stub.c tests/gpu/nccl_api.h include/nccl/api.h include/nccl/common.h | need-build
	mkdir -p $(@D)
	$(CC) $(DRIVER_CFLAGS) -shared -fPIC -Wl,-soname,libnccl.so.2 -o $@ $<
$(BUILD)/abort-nccl $(BUILD)/gather-nccl: $(BUILD)/%-nccl: tests/gpu/%_nccl.c $(NCCL_MIN) $(NCCL_MIN_H) $(NCCL_STUB) | need-build
	$(CC) $(DRIVER_CFLAGS) -o $@ $< $(NCCL_MIN) -L$(dir $(NCCL_STUB)) -lnccl -ldl -lpthread

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
# bin/, and what only plugincheck runs in libexec/roce_gather/: its driver, its rank program
# and the stand-in NCCL beside it. plugincheck finds them all from where it is installed.
PREFIX ?= /usr/local
PC_LIBEXEC := $(BUILD)/plugincheck-driver $(BUILD)/plugincheck-rank $(BUILD)/libnccl-standin.so
install: $(LIB) $(BUILD)/plugincheck $(PC_LIBEXEC)
	install -d $(DESTDIR)$(PREFIX)/lib $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/libexec/roce_gather
	install -m 755 $(LIB) $(DESTDIR)$(PREFIX)/lib/libroce_gather.so
	ln -sf libroce_gather.so $(DESTDIR)$(PREFIX)/lib/libnccl-net-roce_gather.so
	install -m 755 $(BUILD)/plugincheck $(DESTDIR)$(PREFIX)/bin/plugincheck
	install -m 755 $(PC_LIBEXEC) $(DESTDIR)$(PREFIX)/libexec/roce_gather/

# make wheel: build/roce_gather-VERSION-py3-none-linux_x86_64.whl, the library (both names),
# plugincheck and what it runs in make install's layout inside the Python package python/roce_gather
# (build/wheel.py says why that tag). pip install it; python -m roce_gather check checks it.
wheel: $(LIB) $(BUILD)/plugincheck $(PC_LIBEXEC) | need-wheel
	python3 build/wheel.py --build $(BUILD) --out $(BUILD)

# Builds the library and runs plugincheck's main job: the ABI check.
check: all
	$(BUILD)/plugincheck abi

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
	$(MAKE) test-rxe

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
	rm -rf $(BUILD)/lib* $(BUILD)/plugincheck* $(BUILD)/abort-nccl $(BUILD)/gather-nccl \
		$(BUILD)/rxe.test $(BUILD)/verbs.test $(BUILD)/gather.test $(BUILD)/roce_gather-*.whl

