// Package suggest finds, for a word nobody knows, the known name it was
// likely meant to be: an unrecognized Caddyfile option close to a known
// one (a letter missing, added, changed, or two swapped) gets a "did you
// mean" in its error.
package suggest

import "strconv"

// DidYouMean is ` (did you mean "x"?)` for the name closest to word, or ""
// when none is close: one edit away, or two for a word of five letters or
// more.
func DidYouMean(word string, names ...[]string) string {
	best, bestDist := "", 3
	if len(word) < 5 {
		bestDist = 2
	}
	for _, list := range names {
		for _, n := range list {
			if d := Distance(word, n); d > 0 && d < bestDist {
				best, bestDist = n, d
			}
		}
	}
	if best == "" {
		return ""
	}
	return " (did you mean " + strconv.Quote(best) + "?)"
}

// Distance is the optimal string alignment distance between a and b:
// insertions, deletions, substitutions and swaps of neighbours.
func Distance(a, b string) int {
	prev2, prev, cur := make([]int, len(b)+1), make([]int, len(b)+1), make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}
