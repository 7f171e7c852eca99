package relay

import (
	"bytes"
	"encoding/binary"
	"slices"
	"strings"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/cespare/xxhash/v2"
)

// Prompt-cache affinity, the request's side: which prefixes of its prompt
// the upstream may cache. Anthropic caches a prompt's prefix up to each
// block marked with `cache_control` (a breakpoint), in its cache order:
// tools, then system, then messages; a request whose prefix is in a
// channel's cache reads it for a tenth of the input price instead of
// writing it again at 1.25 times (twice for the 1-hour TTL). The relay
// notes the breakpoints in inspect's one strict pass, digests each prefix
// before the first pick, and remembers which channel served each
// (affinity_table.go), so that another session or key of the group with
// the same prefix is sent where it is warm.

// maxBreakpoints is how many cache_control blocks the API takes in one
// request; a request with more is refused upstream, and the relay notes
// none of its breakpoints.
const maxBreakpoints = 4

// A prompt's sections, in the API's cache order.
const (
	sectTools = iota
	sectSystem
	sectMessages
	numSections
)

// breakpointMark is how a body that may have a breakpoint shows it: a
// body without these bytes has none (a name written with escapes is not
// seen; it only misses affinity).
var breakpointMark = []byte(`"cache_control"`)

// controlMark is the rare part of breakpointMark that a search looks for
// first: a JSON body has a '"' every few bytes, and bytes.Index, finding
// a candidate at each, falls back to comparing at every offset (about 5%
// of a request's CPU on a 10 KB body); a '_' is rare.
var controlMark = []byte(`_control"`)

// hasBreakpointMark reports whether body holds breakpointMark.
func hasBreakpointMark(body []byte) bool {
	for at := 0; ; {
		i := bytes.Index(body[at:], controlMark)
		if i < 0 {
			return false
		}
		at += i
		if start := at - len(`"cache`); start >= 0 && bytes.Equal(body[start:start+len(breakpointMark)], breakpointMark) {
			return true
		}
		at++
	}
}

// cachePrefix is what inspect noted of a request's breakpoints, and the
// digests of its prefixes made from them. A request without breakpoints
// has none (nil), and pays nothing for it.
type cachePrefix struct {
	n    uint8                           // breakpoints noted
	over bool                            // more than maxBreakpoints: none count
	auto bool                            // a top-level cache_control: a breakpoint at the end of the messages
	long bool                            // the top-level one's TTL is 1h
	bps  [maxBreakpoints]breakpoint      // in the order the body has them
	span [numSections]struct{ a, b int } // each section's raw value in the body

	// set before the first pick (digest)
	keys  [maxBreakpoints]prefixKey // the prefixes long enough to cache, shortest first
	ttl1h [maxBreakpoints]bool      // each one's TTL is 1h (else 5m)
	nkeys uint8
	model string // the model the digests are of

	// set by the lookup and the picks
	warm   string // the channel with a live record of its longest warm prefix; "": none
	result string // affinityWarm, affinityCold or affinityMoved; "": not picked yet
	warmOn string // the channel the first pick chose for being warm
	table  *affinityTable
	group  string
}

// breakpoint is one block with cache_control: its section, where the
// block ends in the body, and whether its TTL is 1h.
type breakpoint struct {
	sect uint8
	long bool
	end  int
}

// prefixKey identifies a prefix: a keyed 64-bit digest of the group, the
// model and the prefix's bytes, and the number of those bytes.
type prefixKey [16]byte

// newCachePrefix is the prefix notes of a Messages request of a group with
// affinity whose body may have a breakpoint; nil otherwise, at the cost
// of one search of the body.
func newCachePrefix(in *inbound) *cachePrefix {
	if in.route != routeMessages || in.ask.chat != nil || in.who.key == nil || !in.who.key.group.affinity ||
		!hasBreakpointMark(in.ask.body) {
		return nil
	}
	return new(cachePrefix)
}

// mark notes a breakpoint whose block ends at end.
func (p *cachePrefix) mark(sect uint8, end int, long bool) {
	if int(p.n) == maxBreakpoints {
		p.over = true
		return
	}
	p.bps[p.n] = breakpoint{sect: sect, long: long, end: end}
	p.n++
}

// noteSpan notes where a section's raw value lies in the body.
func (p *cachePrefix) noteSpan(sect int, start, end int) {
	p.span[sect].a, p.span[sect].b = start, end
}

// isBreakpoint reports whether v, a cache_control value, marks a
// breakpoint, and whether its TTL is 1h.
func isBreakpoint(v []byte) (ok, long bool) {
	if jsonscan.KindOf(v) != '{' {
		return false, false
	}
	return true, bytes.Contains(v, []byte(`"1h"`))
}

// scanSection reads the value of `system`, or of a `messages` that is not
// an array, in inspect's pass, walking an array's blocks for their
// breakpoints. (An array of messages is walked by inspect_messages.go,
// always, when a prefix is noted.)
func (p *cachePrefix) scanSection(sc *jsonscan.Scanner, sect int) error {
	start := sc.ValueOffset()
	if sc.PeekKind() != '[' {
		_, err := sc.ReadValue()
		p.noteSpan(sect, start, sc.InputOffset())
		return err
	}
	err := p.scanBlocks(sc, uint8(sect))
	p.noteSpan(sect, start, sc.InputOffset())
	return err
}

// scanBlocks walks an array of system blocks, which may be marked: a
// marked block is a breakpoint at its end.
func (p *cachePrefix) scanBlocks(sc *jsonscan.Scanner, sect uint8) error {
	if err := sc.ReadArrayStart(); err != nil {
		return err
	}
	for {
		more, err := sc.NextElement()
		if err != nil || !more {
			return err
		}
		if sc.PeekKind() != '{' {
			if _, err := sc.ReadValue(); err != nil {
				return err
			}
			continue
		}
		if err := sc.ReadObjectStart(); err != nil {
			return err
		}
		marked, long := false, false
		for {
			name, err := sc.NextName()
			if err != nil {
				return err
			}
			if name == nil {
				break
			}
			v, err := sc.ReadValue()
			if err != nil {
				return err
			}
			if unquoteJSON(name) == "cache_control" {
				marked, long = isBreakpoint(v)
			}
		}
		if marked {
			p.mark(sect, sc.InputOffset(), long)
		}
	}
}

// noteAutomatic notes a top-level cache_control (automatic caching): the
// API puts the breakpoint on the last block, so the prefix is the whole
// prompt.
func (p *cachePrefix) noteAutomatic(v []byte) {
	p.auto, p.long = isBreakpoint(v)
}

// Minimum cacheable prompt lengths, in tokens: a shorter prefix is not
// cached by the API, and the relay neither counts nor records it.
const (
	minCacheTokens      = 1024
	minCacheTokensHaiku = 2048
)

// minCacheable is the shortest prefix the API caches for model, in
// tokens.
func minCacheable(model string) int64 {
	if strings.Contains(model, "haiku") {
		return minCacheTokensHaiku
	}
	return minCacheTokens
}

// digest makes the keys of the prefixes up to each breakpoint, in cache
// order, keyed by seed and naming the group and the model: one pass over
// the prompt's bytes, the digest read at each breakpoint. Prefixes shorter
// than the model's minimum cacheable length (by estimateTokens' measure)
// get no key. It reports whether any prefix has one.
func (p *cachePrefix) digest(seed uint64, group, model string, body []byte) bool {
	if p.over || (p.n == 0 && !p.auto) {
		return false
	}
	bps := p.bps[:p.n]
	if p.auto && int(p.n) < maxBreakpoints {
		bps = append(bps, breakpoint{sect: sectMessages, long: p.long, end: p.span[sectMessages].b})
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
	p.nkeys = 0
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
			p.keys[p.nkeys] = keyOf(d.Sum64(), written)
			p.ttl1h[p.nkeys] = bps[i].long
			p.nkeys++
		}
		_, _ = d.Write(body[at:sp.b])
		written += sp.b - at
		_, _ = d.Write(nul)
	}
	p.model = model
	return p.nkeys > 0
}

// keyOf is the key of a prefix of n bytes whose digest is sum.
func keyOf(sum uint64, n int) prefixKey {
	var k prefixKey
	binary.LittleEndian.PutUint64(k[:8], sum)
	binary.LittleEndian.PutUint64(k[8:], uint64(n))
	return k
}

// sectionOf is the section of a top-level field, system or messages.
func sectionOf(field string) int {
	if field == "system" {
		return sectSystem
	}
	return sectMessages
}
