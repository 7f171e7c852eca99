package relay

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"net/http"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/dedup"
	"github.com/zeebo/xxh3"
)

// Duplicate requests. The official SDKs retry a request that timed out or
// lost its connection, while the upstream may still be working on the first
// attempt: a retry (x-stainless-retry-count >= 1, or an idempotency-key)
// with the same principal and the same request as one in flight, or
// answered within dedup_window, is answered from it instead of paying the
// upstream again. A first attempt is never answered from another request,
// but one that may be retried (it carries either header) is recorded so
// that its retries can attach. The same flight, a broadcast buffer the
// leading request writes into and followers replay, coalesces identical
// misses of a group's response cache (cache.go). The flights and their
// table, with their bounds, are internal/dedup's.

const (
	defaultDedupWindow = 60 * time.Second
	defaultDedupGrace  = 5 * time.Second
)

// dedups is the process's table of the flights of the requests that may
// be retried.
var dedups = dedup.NewTable()

// digestSeed keys the digests of requests no other principal can match
// (requestDigest); chosen at start, never shown.
var digestSeed = func() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand never fails on the platforms Go supports
	return binary.LittleEndian.Uint64(b[:])
}()

// requestDigest digests in. A digest the response cache keeps (shared) is
// matched by every key of the group, so it is SHA-256: no tenant can make
// a request whose digest is another's. A dedup entry only ever matches the
// requests of its own principal (dedupKey), and every official SDK marks
// every request for it, so the common digest is the cheap one: 128 bits of
// XXH3 with a seed no client sees (a tenant that made two of its own
// requests collide would only be answered one of its own answers, and
// cannot see a digest to search for one). The body, most of the bytes, is
// hashed in one call; the other parts then with the body's hash.
func requestDigest(in *inbound, shared bool) dedup.Digest {
	if shared {
		var buf [256 + sha256.Size]byte
		// the parts, then the body's own SHA-256: on the stack, where a
		// hash.Hash took the parts through an interface and kept them on
		// the heap
		b := in.appendDigestParts(buf[:0])
		body := sha256.Sum256(in.ask.body)
		return sha256.Sum256(append(b, body[:]...))
	}
	var d dedup.Digest
	var buf [256]byte
	b := in.appendDigestParts(buf[:0])
	body := xxh3.Hash128Seed(in.ask.body, digestSeed)
	b = binary.LittleEndian.AppendUint64(b, body.Lo)
	b = binary.LittleEndian.AppendUint64(b, body.Hi)
	h := xxh3.Hash128Seed(b, digestSeed)
	binary.LittleEndian.PutUint64(d[0:8], h.Lo)
	binary.LittleEndian.PutUint64(d[8:16], h.Hi)
	return d
}

// appendDigestParts appends what a request's digest covers but its body,
// each part closed by a NUL.
func (in *inbound) appendDigestParts(b []byte) []byte {
	b = append(b, in.route.upstreamPath()...)
	for _, name := range [...]string{"Anthropic-Version", "Anthropic-Beta"} {
		b = append(b, 0)
		for _, v := range in.ask.header[name] {
			b = append(b, v...)
			b = append(b, ',')
		}
	}
	b = append(b, 0)
	if m := in.grant.degrade.model; m != "" { // served as another model: another answer
		b = append(b, m...)
	}
	return append(b, 0)
}

var nul = []byte{0}

// retryMarks reads the headers by which an SDK's request says it may be
// retried (marked) and that it is a retry.
func retryMarks(h http.Header) (idem string, marked, retry bool) {
	count, hasCount := h["X-Stainless-Retry-Count"]
	keys, hasKey := h["Idempotency-Key"]
	if !hasCount && !hasKey {
		return "", false, false
	}
	if hasKey && len(keys) > 0 {
		idem, retry = keys[0], true
	}
	if hasCount && len(count) > 0 {
		if n, err := strconv.Atoi(count[0]); err == nil && n >= 1 {
			retry = true
		}
	}
	return idem, true, retry
}

// share answers a Messages request from an answer the relay has or is
// getting for the same request (a retry attached to its first attempt, the
// group's response cache, an identical miss in flight), or relays it while
// keeping its answer for those that follow. Requests that neither may be
// retried nor use a cache go straight to relay.
func (r *Relay) share(w http.ResponseWriter, req *http.Request, in *inbound) *failure {
	c := in.group().cache
	idem, marked, retry := "", false, false
	if r.dedupWindow > 0 {
		idem, marked, retry = retryMarks(in.ask.header)
	}
	if in.route != routeMessages || c == nil && !marked {
		return r.relay(w, req, in)
	}
	g := in.group().name
	if c != nil && noCache(in.ask.header) {
		metricCache.WithLabelValues(g, cacheBypass).Inc()
		c = nil
	}
	d := requestDigest(in, c != nil)
	now := r.now()
	if c != nil {
		if e, result := c.get(d, now); e != nil {
			if rerr := r.admitPending(in); rerr != nil {
				return refused(rerr)
			}
			metricCache.WithLabelValues(g, result).Inc()
			if result == cacheStale {
				r.revalidate(req, in, c, d)
			}
			r.serveStored(w, in, e, result)
			return nil
		}
	}
	dk := dedup.NewKey(in.who.stateID, idem, d)
	if retry {
		if f := dedups.Find(dk, now, r.dedupWindow); f != nil {
			if rerr := r.admitPending(in); rerr != nil {
				return refused(rerr)
			}
			if r.replay(w, req.Context(), in, f, sharedDedup) {
				metricDedup.WithLabelValues(g).Inc()
				return nil
			}
		}
	}
	f := dedup.NewFlight()
	if c != nil {
		if other := c.join(d, f); other != nil {
			if rerr := r.admitPending(in); rerr != nil {
				return refused(rerr)
			}
			if r.replay(w, req.Context(), in, other, sharedCoalesced) {
				metricCache.WithLabelValues(g, cacheHit).Inc()
				return nil
			}
		} else {
			defer c.leave(d, f)
		}
		metricCache.WithLabelValues(g, cacheMiss).Inc()
	}
	if !marked || !dedups.Put(dk, in.who.key.stateID, f, now, r.dedupWindow) {
		defer f.Release() // nobody finds it once its cache entry is stored
	}
	grace := time.Duration(0) // a request no SDK will retry ends with its client, unless followed
	if marked {
		grace = r.dedupGrace
	}
	fail := r.lead(w, req, in, f, grace)
	if c != nil && f.OK() {
		c.store(d, f, r.now())
	}
	return fail
}

// What answered a request that no upstream answered for it: the log
// line's `shared` field.
const (
	sharedDedup        = "dedup"     // a retry, attached to its first attempt
	sharedCache        = "cache"     // the group's response cache
	sharedCoalesced    = "coalesced" // an identical cache miss in flight
	sharedRevalidation = "revalidation"
)

// replay writes f to the client: from its first byte, then live as the
// leading request gets it. It reports false when nothing was written
// because f failed (or outgrew its bounds) first: the request is then
// relayed itself, since a failed answer is never replayed.
func (r *Relay) replay(w http.ResponseWriter, ctx context.Context, in *inbound, f *dedup.Flight, how string) bool {
	status, header, ok, err := f.Head(ctx)
	if err != nil {
		in.end.sharedBy(how)
		return true // the client is gone
	}
	if !ok {
		return false
	}

	in.end.sharedBy(how)
	h := w.Header()
	header.CopyTo(h)
	r.ratelimitHeaders(h, in)
	w.WriteHeader(status)
	rc := http.NewResponseController(w)
	for pos := 0; ; {
		p := f.Read(pos)
		if p.Dropped { // the leader's answer outgrew what is kept
			_, _ = w.Write(sseError("api_error", "the answer this retry attached to grew too large to replay", in.id))
			in.end.cut()
			_ = rc.Flush()
			return true
		}
		if len(p.Chunk) > 0 {
			if _, err := w.Write(p.Chunk); err != nil {
				in.end.cut()
				return true
			}
			pos += len(p.Chunk)
			_ = rc.Flush()
		}
		if p.Done {
			in.end.whole(p.OK)
			if p.OK {
				r.saved(in, p.Tokens, p.USD)
			}
			return true
		}
		select {
		case <-p.Wake:
		case <-ctx.Done():
			in.end.cut()
			return true
		}
	}
}

// saved counts what an answer that reached the client without an
// upstream would have cost: its tokens and US dollars.
func (r *Relay) saved(in *inbound, tokens int64, usd float64) {
	g := in.group().name
	if tokens > 0 {
		metricSavedTokens.WithLabelValues(g).Add(float64(tokens))
	}
	if usd > 0 {
		metricSavedUSD.WithLabelValues(g).Add(usd)
	}
}
