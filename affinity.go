package relay

import (
	"bytes"

	"github.com/caddy-relay/relay/internal/affinity"
	"github.com/caddy-relay/relay/internal/jsonscan"
)

// Prompt-cache affinity, the request's side: which prefixes of its prompt
// the upstream may cache. Anthropic caches a prompt's prefix up to each
// block marked with `cache_control` (a breakpoint), in its cache order:
// tools, then system, then messages; a request whose prefix is in a
// channel's cache reads it for a tenth of the input price instead of
// writing it again at 1.25 times (twice for the 1-hour TTL). The relay
// notes the breakpoints in inspect's one strict pass, digests each prefix
// before the first pick, and remembers which channel served each
// (internal/affinity), so that another session or key of the group with
// the same prefix is sent where it is warm.

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

// cachePrefix is what inspect noted of a request's breakpoints, the
// digests of its prefixes made from them (internal/affinity), and what
// the lookup and the picks found. A request without breakpoints has none
// (nil), and pays nothing for it.
type cachePrefix struct {
	affinity.Prompt

	// set by the lookup and the picks
	warm   string // the channel with a live record of its longest warm prefix; "": none
	result string // affinityWarm, affinityCold or affinityMoved; "": not picked yet
	warmOn string // the channel the first pick chose for being warm
	table  *affinity.Table
}

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
		p.NoteSpan(sect, start, sc.InputOffset())
		return err
	}
	err := p.scanBlocks(sc, uint8(sect))
	p.NoteSpan(sect, start, sc.InputOffset())
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
			p.Mark(sect, sc.InputOffset(), long)
		}
	}
}

// noteAutomatic notes a top-level cache_control (automatic caching): the
// API puts the breakpoint on the last block, so the prefix is the whole
// prompt.
func (p *cachePrefix) noteAutomatic(v []byte) {
	p.SetAutomatic(isBreakpoint(v))
}

// sectionOf is the section of a top-level field, system or messages.
func sectionOf(field string) int {
	if field == "system" {
		return affinity.SectSystem
	}
	return affinity.SectMessages
}

// Prompt-cache affinity, the relay's side: each group remembers which
// channel last served each prefix (internal/affinity). A request whose
// prefix is warm on a live channel of the best tier goes there, whatever
// the group's policy would have picked in that tier.

// Results of relay_cache_affinity_total.
const (
	affinityWarm  = "warm"  // sent to the channel where its prefix is warm
	affinityCold  = "cold"  // no live record of its prefixes
	affinityMoved = "moved" // a record, but its channel was not a live candidate of the best tier
)

// Reasons of relay_cache_miss_usd_total (affinityCold and affinityMoved,
// and this one).
const missFailover = "failover" // warm, but the warm channel failed and another answered

// affinityTable returns the group's table, made at its first use.
func (s *groupState) affinityTable() *affinity.Table {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.affinity == nil {
		s.affinity = affinity.NewTable(affinity.MaxEntries)
	}
	return s.affinity
}

// affinitySeed returns the seed that keys the prefixes' digests, derived
// from the resource secret, which every relay of a fleet shares; false
// while a fleet's secret is not known yet.
func (r *Relay) affinitySeed() (uint64, bool) {
	if r.affinity == nil {
		return 0, false
	}
	if seed, ok := r.affinity.Get(); ok {
		return seed, true
	}
	if r.secret == nil {
		return 0, false
	}
	key, ok := r.secret.Get()
	if !ok {
		return 0, false
	}
	return r.affinity.Derive(key), true
}

// sharedAffinity is the fleet's affinity records, nil without a fleet.
func (r *Relay) sharedAffinity() *affinity.Shared {
	if r.fleet == nil {
		return nil
	}
	return r.fleet.affinity
}

// lookupAffinity digests the prefixes of a request of group g that has
// breakpoints, and finds where the longest warm one is: in the node's
// table, else (in a fleet) in Redis, in one round trip. It returns the
// prefix for the picks, nil when the request has none worth it.
func (r *Relay) lookupAffinity(in *inbound, g *group) *cachePrefix {
	p := in.ask.prefix
	if p == nil || g.table == nil {
		return nil
	}
	seed, ok := r.affinitySeed()
	if !ok || !p.Digest(seed, g.name, in.ask.model, in.ask.body) {
		return nil
	}
	p.table = g.table
	p.warm = g.table.Warm(&p.Prompt, r.now(), r.sharedAffinity())
	return p
}

// route is the first pick's channel for p among the best tier: the one
// where its prefix is warm, noting the result; nil when none is, or when
// affinity does not apply (a failover, a fallback model).
func (p *cachePrefix) route(tier []*channel, s *selection) *channel {
	if p == nil || len(s.tried) > 0 || s.model != p.Model {
		return nil
	}
	if p.warm == "" {
		p.result = affinityCold
		return nil
	}
	for _, ch := range tier {
		if ch.name == p.warm {
			p.result, p.warmOn = affinityWarm, ch.name
			return ch
		}
	}
	p.result = affinityMoved
	return nil
}

// settleAffinity counts a request's affinity result and, after an answer,
// what its cache writes cost beyond the reads a warm channel would have
// billed, and records that the answering channel holds its prefixes.
func (r *Relay) settleAffinity(in *inbound) {
	p := in.grant.sel.prefix
	if p == nil || p.result == "" {
		return
	}
	metricCacheAffinity.WithLabelValues(p.Group, p.result).Inc()
	ch := in.end.answered
	if ch == nil || in.end.status != 200 || in.end.shared != "" {
		return
	}
	reason := p.result
	switch {
	case p.result == affinityWarm && ch.name != p.warmOn:
		reason = missFailover
	case p.result == affinityWarm:
		reason = "" // what a warm channel writes extends its cache
	}
	if reason != "" && in.end.usage.cacheWrite > 0 {
		if usd := r.missUSD(in, ch); usd > 0 {
			metricCacheMissUSD.WithLabelValues(p.Group, reason).Add(usd)
		}
	}
	p.table.Record(&p.Prompt, ch.name, r.now(), r.sharedAffinity())
}

// missUSD is what in's cache writes cost beyond reading the same tokens
// from the cache, at the price of the model served and the channel's
// price factor.
func (r *Relay) missUSD(in *inbound, ch *channel) float64 {
	rates := r.prices.Lookup(in.grant.target)
	if rates == nil {
		return 0
	}
	return rates.CacheMiss(in.end.usage.priced()) * ch.priceFactor
}
