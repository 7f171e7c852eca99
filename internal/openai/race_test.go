//go:build race

package openai

// The race detector makes long loops ten times slower: tests that prove a
// bound by volume run a smaller, still sufficient, volume under it.
func init() { raceDetector = true }
