package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// paths locates the library and plugincheck's two C programs.
type paths struct {
	lib    string
	driver string // plugincheck-driver: the ABI check, with no NCCL in its process
	rank   string // plugincheck-rank: one rank of a two-rank run, over the stand-in NCCL
}

// defaultPaths fills in what was not named: each is looked for beside this executable (the
// build tree: build/plugincheck, build/libroce_gather.so, build/plugincheck-driver,
// build/plugincheck-rank), then in the layout make install writes (PREFIX/bin/plugincheck,
// PREFIX/lib/libroce_gather.so, PREFIX/libexec/roce_gather/plugincheck-{driver,rank}), so an
// installed plugincheck checks the installed library wherever PREFIX is. The rank program is
// looked for only where withRank says a command runs ranks.
func defaultPaths(lib, driver, rank string, withRank bool) (paths, error) {
	self, err := os.Executable()
	if err != nil {
		return paths{}, fmt.Errorf("locating plugincheck: %w", err)
	}
	dir := filepath.Dir(self)
	prefix := filepath.Dir(dir)
	libexec := filepath.Join(prefix, "libexec", "roce_gather")
	find := func(given *string, flag string, candidates ...string) {
		if err == nil && *given == "" {
			*given, err = firstExisting(flag, candidates...)
		}
	}
	find(&lib, "--lib", filepath.Join(dir, "libroce_gather.so"), filepath.Join(prefix, "lib", "libroce_gather.so"))
	find(&driver, "--driver", filepath.Join(dir, "plugincheck-driver"), filepath.Join(libexec, "plugincheck-driver"))
	if withRank {
		find(&rank, "--rank", filepath.Join(dir, "plugincheck-rank"), filepath.Join(libexec, "plugincheck-rank"))
	}
	if err == nil {
		lib, err = filepath.Abs(lib)
	}
	if err != nil {
		return paths{}, err
	}
	check := []string{lib, driver}
	if withRank {
		check = append(check, rank)
	}
	for _, p := range check {
		if _, err := os.Stat(p); err != nil {
			return paths{}, fmt.Errorf("%s: %w", p, err)
		}
	}
	// The rank program finds the stand-in NCCL beside itself (RUNPATH $ORIGIN).
	if standin := filepath.Join(filepath.Dir(rank), "libnccl-standin.so"); withRank && !exists(standin) {
		return paths{}, fmt.Errorf("%s is missing: %s needs it beside itself (build with make, install with make install)", standin, rank)
	}
	return paths{lib: lib, driver: driver, rank: rank}, nil
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// firstExisting returns the first of the candidates that exists.
func firstExisting(flag string, candidates ...string) (string, error) {
	for _, c := range candidates {
		if exists(c) {
			return c, nil
		}
	}
	return "", fmt.Errorf("none of %s exists (build with make, install with make install, or pass %s)", strings.Join(candidates, ", "), flag)
}
