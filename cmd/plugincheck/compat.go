package main

import "strings"

// measuredNCCL lists the NCCL releases this library has run against with its checks
// passing. docs/compatibility.md gives each one's results and how they were measured, and
// TestClaimMatchesTheCompatibilityTable keeps the two the same: plugincheck claims these
// releases and no others.
var measuredNCCL = []string{"2.28.3", "2.28.9", "2.31.2"}

// abiVerdict is the closing line of a passed ABI check.
func abiVerdict() string {
	return "every table is complete; NCCL releases measured with this library: " + strings.Join(measuredNCCL, ", ") + " (docs/compatibility.md)"
}
