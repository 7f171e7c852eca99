package relay

import (
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/maypok86/otter/v2"
)

// Prompt-cache affinity, the relay's side: each group remembers which
// channel last served each prefix (affinity.go), for the TTL of the
// breakpoint that ends it, refreshed at each answer as the API refreshes
// its cache on each read. A request whose prefix is warm on a live
// channel of the best tier goes there, whatever the group's policy would
// have picked in that tier.

// Results of relay_cache_affinity_total.
const (
	affinityWarm  = "warm"  // sent to the channel where its prefix is warm
	affinityCold  = "cold"  // no live record of its prefixes
	affinityMoved = "moved" // a record, but its channel was not a live candidate of the best tier
)

// Reasons of relay_cache_miss_usd_total (affinityCold and affinityMoved,
// and this one).
const missFailover = "failover" // warm, but the warm channel failed and another answered

// TTLs of the prompt cache, by breakpoint.
const (
	cacheTTL   = 5 * time.Minute
	cacheTTL1h = time.Hour
)

// maxAffinityEntries bounds the prefixes a group remembers on a node; past
// it the least useful are forgotten (otter's policy).
const maxAffinityEntries = 1 << 16

// affinityRecord is the channel that last served a prefix, and until when
// (Unix nanoseconds, by the relay's clock) its cache holds it.
type affinityRecord struct {
	channel string
	until   int64
}

// affinityTable is a group's records, kept across reloads with its state.
type affinityTable struct {
	entries *otter.Cache[prefixKey, affinityRecord]
}

func newAffinityTable(size int) *affinityTable {
	return &affinityTable{entries: otter.Must(&otter.Options[prefixKey, affinityRecord]{
		MaximumSize: size,
		// bounds memory by the clock of the process; lookups check until
		// by the relay's
		ExpiryCalculator: otter.ExpiryWritingFunc(func(e otter.Entry[prefixKey, affinityRecord]) time.Duration {
			return cacheTTL1h
		}),
	})}
}

// affinityTable returns the group's table, made at its first use.
func (s *groupState) affinityTable() *affinityTable {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.affinity == nil {
		s.affinity = newAffinityTable(maxAffinityEntries)
	}
	return s.affinity
}

// warm is the channel with a live record of p's longest prefix that has
// one, and until when; "" when none has.
func (t *affinityTable) warm(p *cachePrefix, now time.Time) (string, int64) {
	for i := int(p.nkeys) - 1; i >= 0; i-- {
		if rec, ok := t.entries.GetIfPresent(p.keys[i]); ok && rec.until > now.UnixNano() {
			return rec.channel, rec.until
		}
	}
	return "", 0
}

// record notes that channel served every prefix of p at now.
func (t *affinityTable) record(p *cachePrefix, channel string, now time.Time) {
	for i := range int(p.nkeys) {
		t.set(p.keys[i], channel, now.Add(p.ttlOf(i)).UnixNano())
	}
}

// set notes channel for k until then, unless a record that lasts longer
// is there (a 1h write read later with a 5m breakpoint keeps its hour).
func (t *affinityTable) set(k prefixKey, channel string, until int64) {
	if rec, ok := t.entries.GetIfPresent(k); ok && rec.channel == channel && rec.until > until {
		return
	}
	t.entries.Set(k, affinityRecord{channel: channel, until: until})
}

func (p *cachePrefix) ttlOf(i int) time.Duration {
	if p.ttl1h[i] {
		return cacheTTL1h
	}
	return cacheTTL
}

// affinitySeed keys the prefixes' digests: derived from the resource
// secret, which every relay of a fleet shares, so that the nodes' keys in
// Redis match; no client ever sees a digest.
type affinitySeed struct {
	seed atomic.Uint64
	ok   atomic.Bool
}

// affinitySeed returns the seed, false while a fleet's secret is not
// known yet.
func (r *Relay) affinitySeed() (uint64, bool) {
	if r.affinity == nil {
		return 0, false
	}
	if r.affinity.ok.Load() {
		return r.affinity.seed.Load(), true
	}
	if r.secret == nil {
		return 0, false
	}
	key, ok := r.secret.get()
	if !ok {
		return 0, false
	}
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString("relay prompt-cache affinity\x00")
	_, _ = d.Write(key)
	r.affinity.seed.Store(d.Sum64())
	r.affinity.ok.Store(true)
	return r.affinity.seed.Load(), true
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
	if !ok || !p.digest(seed, g.name, in.ask.model, in.ask.body) {
		return nil
	}
	p.table, p.group = g.table, g.name
	now := r.now()
	p.warm, _ = g.table.warm(p, now)
	if p.warm == "" && r.fleet != nil {
		if ch, i, until := r.fleet.affinityWarm(g.name, p, now); ch != "" {
			p.warm = ch
			g.table.set(p.keys[i], ch, until)
		}
	}
	return p
}

// route is the first pick's channel for p among the best tier: the one
// where its prefix is warm, noting the result; nil when none is, or when
// affinity does not apply (a failover, a fallback model).
func (p *cachePrefix) route(tier []*channel, s *selection) *channel {
	if p == nil || len(s.tried) > 0 || s.model != p.model {
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
	metricCacheAffinity.WithLabelValues(p.group, p.result).Inc()
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
			metricCacheMissUSD.WithLabelValues(p.group, reason).Add(usd)
		}
	}
	now := r.now()
	p.table.record(p, ch.name, now)
	if r.fleet != nil {
		r.fleet.recordAffinity(p, ch.name, now)
	}
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
