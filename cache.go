package relay

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/dedup"
	"github.com/caddyserver/caddy/v2"
	"github.com/maypok86/otter/v2"
	"go.uber.org/zap"
)

// ResponseCache is a group's opt-in cache of Messages answers: an answer
// is kept by its request (the body byte for byte, anthropic-version and
// anthropic-beta) and served again, byte for byte, to any key of the group
// that sends the same request. Only complete, successful answers are kept.
// A cached answer costs its key nothing. Identical requests get identical
// answers: leave it off for groups whose requests sample (temperature
// above 0) and expect a new answer each time.
type ResponseCache struct {
	// TTL is how long an answer is served as fresh. Default: 10m.
	TTL caddy.Duration `json:"ttl,omitempty"`

	// Stale is how long after TTL an answer is still served while one
	// request in the background fetches a new one. Default: 0 (none).
	Stale caddy.Duration `json:"stale,omitempty"`

	// MaxSize bounds the bytes the group's cache holds (bodies and
	// headers); the least useful answers leave first. Default: 256 MiB.
	MaxSize int64 `json:"max_size,omitempty"`
}

const (
	defaultCacheTTL     = 10 * time.Minute
	defaultCacheMaxSize = 256 << 20
)

// Results of relay_cache_total.
const (
	cacheHit    = "hit"
	cacheMiss   = "miss"
	cacheStale  = "stale"
	cacheBypass = "bypass"
)

// cached is one answer of the cache.
type cached struct {
	status   int
	header   dedup.Header
	body     []byte
	stored   time.Time
	tokens   int64   // what the answer cost upstream
	savedUSD float64 // and in US dollars
}

// weight is what an entry counts against max_size.
func (e *cached) weight() uint32 {
	return uint32(len(e.body) + 64 + e.header.Size())
}

// responseCache is a provisioned ResponseCache: the answers, and the
// flights of the misses being fetched, so identical misses share one.
type responseCache struct {
	cfg     ResponseCache
	ttl     time.Duration
	stale   time.Duration
	entries *otter.Cache[dedup.Digest, *cached]
	mu      sync.Mutex
	flights map[dedup.Digest]*dedup.Flight
}

func newResponseCache(cfg ResponseCache) *responseCache {
	c := &responseCache{cfg: cfg, ttl: time.Duration(cfg.TTL), stale: time.Duration(cfg.Stale), flights: map[dedup.Digest]*dedup.Flight{}}
	if c.ttl <= 0 {
		c.ttl = defaultCacheTTL
	}
	size := cfg.MaxSize
	if size <= 0 {
		size = defaultCacheMaxSize
	}
	c.entries = otter.Must(&otter.Options[dedup.Digest, *cached]{
		MaximumWeight:    uint64(size),
		Weigher:          func(_ dedup.Digest, e *cached) uint32 { return e.weight() },
		ExpiryCalculator: otter.ExpiryWriting[dedup.Digest, *cached](c.ttl + c.stale),
	})
	return c
}

// get returns the answer to serve, fresh (hit) or stale, if there is one.
func (c *responseCache) get(d dedup.Digest, now time.Time) (*cached, string) {
	e, ok := c.entries.GetIfPresent(d)
	if !ok {
		return nil, ""
	}
	switch age := now.Sub(e.stored); {
	case age < c.ttl:
		return e, cacheHit
	case age < c.ttl+c.stale:
		return e, cacheStale
	}
	return nil, ""
}

// join makes f the flight of d, or returns the one already fetching it.
func (c *responseCache) join(d dedup.Digest, f *dedup.Flight) *dedup.Flight {
	c.mu.Lock()
	defer c.mu.Unlock()
	if other := c.flights[d]; other != nil {
		other.Follow()
		return other
	}
	c.flights[d] = f
	return nil
}

func (c *responseCache) leave(d dedup.Digest, f *dedup.Flight) {
	c.mu.Lock()
	if c.flights[d] == f {
		delete(c.flights, d)
	}
	c.mu.Unlock()
}

// store keeps f's answer, when it is complete and successful.
func (c *responseCache) store(d dedup.Digest, f *dedup.Flight, now time.Time) {
	a := f.Answer()
	e := &cached{status: a.Status, header: a.Header, body: a.Body, stored: now, tokens: a.Tokens, savedUSD: a.USD}
	if !a.OK || e.status < 200 || e.status > 299 {
		return
	}
	c.entries.Set(d, e)
}

// noCache reports whether the client asks for an answer from the upstream.
func noCache(h http.Header) bool {
	for _, v := range h["Cache-Control"] {
		for _, d := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(d), "no-cache") {
				return true
			}
		}
	}
	return false
}

// serveStored writes a cached answer, byte for byte.
func (r *Relay) serveStored(w http.ResponseWriter, in *inbound, e *cached, result string) {
	in.end.sharedBy(sharedCache)
	h := w.Header()
	e.header.CopyTo(h)
	h.Set("X-Relay-Cache", result)
	r.ratelimitHeaders(h, in)
	w.WriteHeader(e.status)
	_, _ = w.Write(e.body)
	r.saved(in, e.tokens, e.savedUSD)
}

// revalidate fetches a stale answer again, in the background, once at a
// time: the request that found it stale gets it at once, and its key pays
// for the new one (the log line of the fetch has shared: revalidation).
func (r *Relay) revalidate(req *http.Request, in *inbound, c *responseCache, d dedup.Digest) {
	f := dedup.NewFlight()
	if other := c.join(d, f); other != nil {
		return // being fetched already
	}
	// what was asked, with its own header and body (the client's go back to
	// their pool); no translated chat (only Messages are cached)
	ask := in.ask
	ask.header, ask.body, ask.chat = in.ask.header.Clone(), bytes.Clone(in.ask.body), nil
	bg := &inbound{id: newRequestID(), start: time.Now(), route: in.route, who: in.who, ask: ask,
		grant: granted{target: in.grant.target, pinned: in.grant.pinned, degrade: in.grant.degrade}}
	bg.end.begin(bg.chainBuf[:0])
	bg.end.sharedBy(sharedRevalidation)
	bgReq := req.WithContext(context.WithoutCancel(req.Context())) // the client's leaving ends nothing
	go func() {
		defer c.leave(d, f)
		defer f.Release()
		defer r.account(bg)
		defer func() {
			if p := recover(); p != nil {
				r.logger.Error("cache revalidation panicked", zap.Any("panic", p), zap.String("request_id", bg.id))
			}
		}()
		w := bg.rec.install(discard{header: http.Header{}}, bg) // answers nobody, and records what it would have
		if rerr := r.planHolds(bg); rerr != nil {               // it holds against the key's budgets as its request would
			r.answer(w, bg, refused(rerr))
			return
		}
		if fail := r.lead(w, bgReq, bg, f, 0); fail != nil {
			r.answer(w, bg, fail)
		}
		if f.OK() {
			c.store(d, f, r.now())
		}
	}()
}

// discard is the writer of a request without a client.
type discard struct{ header http.Header }

func (d discard) Header() http.Header       { return d.header }
func (discard) WriteHeader(int)             {}
func (discard) Write(p []byte) (int, error) { return len(p), nil }
func (discard) FlushError() error           { return nil }
