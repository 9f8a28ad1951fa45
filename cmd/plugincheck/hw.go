package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/roce-gather/roce_gather/plugin"
	"github.com/roce-gather/roce_gather/roce/verbs"
)

// cmdHW reports what the verbs fabric would find here. It reads the same environment as
// the plugin (ROCE_GATHER_HCAS, ROCE_GATHER_GID_INDEX), so the verdict is the plugin's.
func cmdHW(args []string) int {
	fs := flag.NewFlagSet("hw", flag.ExitOnError)
	asJSON := fs.Bool("json", false, "print the inventory as JSON")
	fs.Parse(args)
	cfg, warns := plugin.ParseConfig(os.Getenv)
	for _, w := range warns {
		fmt.Fprintln(os.Stderr, "plugincheck: WARN", w)
	}
	hw := verbs.Inventory(verbs.Config{HCAs: cfg.HCAs, GIDIndex: cfg.GIDIndex, Timeout: cfg.Timeout})
	if *asJSON {
		b, err := hw.JSON()
		if err != nil {
			return complain(2, err)
		}
		os.Stdout.Write(append(b, '\n'))
	} else if err := hw.WriteTable(os.Stdout); err != nil {
		return complain(2, err)
	}
	if !hw.Usable {
		return 1
	}
	return 0
}
