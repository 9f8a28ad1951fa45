# roce_gather: the NCCL plugin library, plugincheck and the tests.
GO ?= go
CC ?= gcc
BUILD := build
DRIVER_CFLAGS := -O2 -g -std=gnu11 -Wall -Wextra -Werror -Iinclude
LIB := $(BUILD)/libroce_gather.so

.PHONY: all check test vet fmt lint clean kernels
all: $(LIB) $(BUILD)/libnccl-net-roce_gather.so $(BUILD)/plugincheck $(BUILD)/plugincheck-driver

GO_SOURCES := $(shell find . -name '*.go' -not -path './build/*') $(shell find . -name '*.[ch]' -not -path './build/*' -not -path './cmd/*') go.mod go.sum build/exports.map

$(LIB): $(GO_SOURCES)
	$(GO) build -buildmode=c-shared -trimpath \
		-ldflags "-extldflags=-Wl,--version-script=$(CURDIR)/build/exports.map" -o $@ .
	rm -f $(BUILD)/libroce_gather.h

# NCCL_NET_PLUGIN=roce_gather finds the library under this name on the library path.
$(BUILD)/libnccl-net-roce_gather.so: $(LIB)
	ln -sf libroce_gather.so $@

$(BUILD)/plugincheck: $(GO_SOURCES)
	$(GO) build -trimpath -o $@ ./cmd/plugincheck

$(BUILD)/plugincheck-driver: $(wildcard cmd/plugincheck/driver/*.c cmd/plugincheck/driver/*.h) $(wildcard include/nccl/*.h)
	$(CC) $(DRIVER_CFLAGS) -o $@ $(filter %.c,$^) -ldl -lpthread

# Builds the library and runs plugincheck's main job: the ABI check.
check: all
	$(BUILD)/plugincheck abi

vet:
	$(GO) vet ./...

fmt:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

lint: vet fmt

# Every test: static checks, Go unit tests, and the ABI and two-process tests that drive
# the built library through plugincheck's driver.
test: all lint
	$(GO) test -count=1 ./...

clean:
	rm -rf $(BUILD)/lib* $(BUILD)/plugincheck*

