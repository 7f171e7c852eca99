package affinity

import (
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/maypok86/otter/v2"
)

// Each group remembers which channel last served each prefix, for the TTL
// of the breakpoint that ends it, refreshed at each answer as the API
// refreshes its cache on each read.

// MaxEntries bounds the prefixes a group remembers on a node; past it the
// least useful are forgotten (otter's policy).
const MaxEntries = 1 << 16

// record is the channel that last served a prefix, and until when (Unix
// nanoseconds, by the relay's clock) its cache holds it.
type record struct {
	channel string
	until   int64
}

// Table is a group's records on this node, kept across reloads with the
// group. In a fleet, it is given the fleet's Shared at each lookup and
// record, and consults and feeds it.
type Table struct {
	entries *otter.Cache[Key, record]
}

// NewTable is an empty table of at most size records.
func NewTable(size int) *Table {
	return &Table{entries: otter.Must(&otter.Options[Key, record]{
		MaximumSize: size,
		// bounds memory by the clock of the process; lookups check until
		// by the relay's
		ExpiryCalculator: otter.ExpiryWritingFunc(func(e otter.Entry[Key, record]) time.Duration {
			return CacheTTL1h
		}),
	})}
}

// Warm is the channel with a live record of p's longest prefix that has
// one: in t, else, when s is not nil, in the fleet's records, in one
// round trip (t then keeps what the fleet knew); "" when none has.
func (t *Table) Warm(p *Prompt, now time.Time, s *Shared) string {
	if ch, _ := t.warm(p, now); ch != "" || s == nil {
		return ch
	}
	ch, i, until := s.warm(p, now)
	if ch != "" {
		t.Set(p.Keys[i], ch, until)
	}
	return ch
}

// warm is the channel with a live record in t of p's longest prefix that
// has one, and until when; "" when none has.
func (t *Table) warm(p *Prompt, now time.Time) (string, int64) {
	for i := int(p.N) - 1; i >= 0; i-- {
		if rec, ok := t.entries.GetIfPresent(p.Keys[i]); ok && rec.until > now.UnixNano() {
			return rec.channel, rec.until
		}
	}
	return "", 0
}

// Record notes that channel served every prefix of p at now, in t and,
// when s is not nil, in the fleet's records (off the caller's path).
func (t *Table) Record(p *Prompt, channel string, now time.Time, s *Shared) {
	for i := range int(p.N) {
		t.Set(p.Keys[i], channel, now.Add(p.TTL(i)).UnixNano())
	}
	if s != nil {
		s.record(p, channel, now)
	}
}

// Set notes channel for k until then (Unix ns), unless a record that lasts
// longer is there (a 1h write read later with a 5m breakpoint keeps its
// hour).
func (t *Table) Set(k Key, channel string, until int64) {
	if rec, ok := t.entries.GetIfPresent(k); ok && rec.channel == channel && rec.until > until {
		return
	}
	t.entries.Set(k, record{channel: channel, until: until})
}

// Seed keys the prefixes' digests: derived from a secret that every relay
// of a fleet shares, so that the nodes' keys in Redis match; no client
// ever sees a digest. The zero Seed is not derived yet.
type Seed struct {
	seed atomic.Uint64
	ok   atomic.Bool
}

// Get returns the seed, false until Derive made it.
func (s *Seed) Get() (uint64, bool) {
	if s.ok.Load() {
		return s.seed.Load(), true
	}
	return 0, false
}

// Derive makes the seed of secret, and returns it.
func (s *Seed) Derive(secret []byte) uint64 {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString("relay prompt-cache affinity\x00")
	_, _ = d.Write(secret)
	s.seed.Store(d.Sum64())
	s.ok.Store(true)
	return s.seed.Load()
}
