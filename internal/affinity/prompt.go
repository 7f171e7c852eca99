// Package affinity keeps prompt-cache affinity: which channel of a group
// last served each cached prefix of a prompt, so that another request
// with the same prefix goes where the upstream's cache holds it.
// Anthropic caches a prompt's prefix up to each block marked with
// `cache_control` (a breakpoint), in its cache order: tools, then system,
// then messages. A Prompt is what the relay noted of a request's
// breakpoints and, once digested, the keys of its prefixes; a Table is a
// group's records on this node; a Shared is the records of a fleet, in
// Redis, which a Table consults and feeds when it is given one.
//
// The package knows nothing of the relay: it takes the positions of the
// breakpoints in a body, the body's bytes, and names (group, model,
// channel).
package affinity

import (
	"encoding/binary"
	"slices"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"
)

// MaxBreakpoints is how many cache_control blocks the API takes in one
// request; a request with more is refused upstream, and none of its
// breakpoints count.
const MaxBreakpoints = 4

// A prompt's sections, in the API's cache order.
const (
	SectTools = iota
	SectSystem
	SectMessages
	numSections
)

// Minimum cacheable prompt lengths, in tokens: a shorter prefix is not
// cached by the API, and the relay neither counts nor records it.
const (
	minCacheTokens      = 1024
	minCacheTokensHaiku = 2048
)

// TTLs of the prompt cache, by breakpoint.
const (
	CacheTTL   = 5 * time.Minute
	CacheTTL1h = time.Hour
)

// Prompt is what was noted of a request's breakpoints (Mark, NoteSpan,
// SetAutomatic), and, once digested (Digest), the keys of its prefixes.
// The zero Prompt has no breakpoint.
type Prompt struct {
	n    uint8                           // breakpoints noted
	over bool                            // more than MaxBreakpoints: none count
	auto bool                            // a top-level cache_control: a breakpoint at the end of the messages
	long bool                            // the top-level one's TTL is 1h
	bps  [MaxBreakpoints]breakpoint      // in the order the body has them
	span [numSections]struct{ a, b int } // each section's raw value in the body

	// Keys are the keys of the prefixes long enough to cache, shortest
	// first; the first N count (set by Digest).
	Keys [MaxBreakpoints]Key
	// TTL1h says of each key whether its breakpoint's TTL is 1h (else 5m).
	TTL1h [MaxBreakpoints]bool
	// N is how many of Keys count.
	N uint8
	// Model and Group are the model and the group the keys name.
	Model, Group string
}

// breakpoint is one block with cache_control: its section, where the
// block ends in the body, and whether its TTL is 1h.
type breakpoint struct {
	sect uint8
	long bool
	end  int
}

// Key identifies a prefix: a keyed 64-bit digest of the group, the model
// and the prefix's bytes, and the number of those bytes.
type Key [16]byte

// KeyOf is the key of a prefix of n bytes whose digest is sum.
func KeyOf(sum uint64, n int) Key {
	var k Key
	binary.LittleEndian.PutUint64(k[:8], sum)
	binary.LittleEndian.PutUint64(k[8:], uint64(n))
	return k
}

// Mark notes a breakpoint of section sect whose block ends at end in the
// body; long: its TTL is 1h. Past MaxBreakpoints, none count.
func (p *Prompt) Mark(sect uint8, end int, long bool) {
	if int(p.n) == MaxBreakpoints {
		p.over = true
		return
	}
	p.bps[p.n] = breakpoint{sect: sect, long: long, end: end}
	p.n++
}

// Breakpoints is how many breakpoints were marked.
func (p *Prompt) Breakpoints() int { return int(p.n) }

// NoteSpan notes where a section's raw value lies in the body.
func (p *Prompt) NoteSpan(sect int, start, end int) {
	p.span[sect].a, p.span[sect].b = start, end
}

// SetAutomatic notes a top-level cache_control (automatic caching): on,
// the API puts a breakpoint on the last block, so a prefix is the whole
// prompt; long: its TTL is 1h.
func (p *Prompt) SetAutomatic(on, long bool) {
	p.auto, p.long = on, long
}

// TTL is how long the cache holds the prefix of Keys[i].
func (p *Prompt) TTL(i int) time.Duration {
	if p.TTL1h[i] {
		return CacheTTL1h
	}
	return CacheTTL
}

// minCacheable is the shortest prefix the API caches for model, in
// tokens.
func minCacheable(model string) int64 {
	if strings.Contains(model, "haiku") {
		return minCacheTokensHaiku
	}
	return minCacheTokens
}

// nul separates the parts of a digest.
var nul = []byte{0}

// Digest makes the keys of the prefixes up to each breakpoint, in cache
// order, keyed by seed and naming the group and the model: one pass over
// the prompt's bytes in body, the digest read at each breakpoint. Prefixes
// shorter than the model's minimum cacheable length (at 4 bytes a token)
// get no key. It reports whether any prefix has one.
func (p *Prompt) Digest(seed uint64, group, model string, body []byte) bool {
	if p.over || (p.n == 0 && !p.auto) {
		return false
	}
	bps := p.bps[:p.n]
	if p.auto && int(p.n) < MaxBreakpoints {
		bps = append(bps, breakpoint{sect: SectMessages, long: p.long, end: p.span[SectMessages].b})
	}
	slices.SortFunc(bps, func(a, b breakpoint) int {
		if a.sect != b.sect {
			return int(a.sect) - int(b.sect)
		}
		return a.end - b.end
	})
	minBytes := int((minCacheable(model) - 1) * 4)
	var d xxhash.Digest
	d.ResetWithSeed(seed)
	_, _ = d.WriteString(group)
	_, _ = d.Write(nul)
	_, _ = d.WriteString(model)
	_, _ = d.Write(nul)
	written, i := 0, 0
	p.N = 0
	for sect := range numSections {
		sp := p.span[sect]
		at := sp.a
		for ; i < len(bps) && int(bps[i].sect) == sect; i++ {
			end := bps[i].end
			if end < at || end > sp.b { // not within its section: cannot be
				return false
			}
			_, _ = d.Write(body[at:end])
			written += end - at
			at = end
			if written < minBytes {
				continue
			}
			p.Keys[p.N] = KeyOf(d.Sum64(), written)
			p.TTL1h[p.N] = bps[i].long
			p.N++
		}
		_, _ = d.Write(body[at:sp.b])
		written += sp.b - at
		_, _ = d.Write(nul)
	}
	p.Model, p.Group = model, group
	return p.N > 0
}
