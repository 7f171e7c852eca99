//go:build !race

package memtest

// Race is set when the code runs under the race detector.
const Race = false
