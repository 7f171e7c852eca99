package relay

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

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
// misses of a group's response cache (cache.go).

const (
	defaultDedupWindow = 60 * time.Second
	defaultDedupGrace  = 5 * time.Second

	// maxSharedAnswer bounds the bytes kept of one answer; a larger answer
	// is not kept, and its retries (or coalesced misses) go upstream.
	maxSharedAnswer = 4 << 20
	// maxSharedBytes bounds the bytes kept by all flights of the process
	// together (in flight, and answered ones within dedup_window).
	maxSharedBytes = 64 << 20
	// maxDedupEntries bounds the requests the dedup table remembers.
	maxDedupEntries = 10_000
	// maxDedupPerPrincipal bounds those of one principal (a key, an
	// identity), so that no tenant's flood of recorded requests fills the
	// table and leaves the retries of the others to be paid twice.
	maxDedupPerPrincipal = maxDedupEntries / 10
	// maxSharedBytesPerPrincipal bounds the bytes kept by the flights of
	// one principal that the dedup table holds, so that no tenant's large
	// answers take every byte kept and leave the others' retries to be
	// paid twice.
	maxSharedBytesPerPrincipal = maxSharedBytes / 10
)

// bodyDigest identifies a request for dedup and the cache: its route, its
// anthropic-version and anthropic-beta headers and its body.
type bodyDigest [sha256.Size]byte

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
func requestDigest(in *inbound, shared bool) bodyDigest {
	if shared {
		var buf [256 + sha256.Size]byte
		// the parts, then the body's own SHA-256: on the stack, where a
		// hash.Hash took the parts through an interface and kept them on
		// the heap
		b := in.appendDigestParts(buf[:0])
		body := sha256.Sum256(in.ask.body)
		return sha256.Sum256(append(b, body[:]...))
	}
	var d bodyDigest
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

// sharedBytes counts the bytes all flights keep, against maxSharedBytes.
var sharedBytes byteBudget

type byteBudget struct{ used atomic.Int64 }

func (b *byteBudget) take(n, limit int64) bool {
	if b.used.Add(n) > limit {
		b.used.Add(-n)
		return false
	}
	return true
}

func (b *byteBudget) give(n int64) { b.used.Add(-n) }

// flight is one upstream answer as the leading request writes it to its
// client: status, headers and every byte of the body, which followers
// replay from the first byte and then live.
type flight struct {
	mu        sync.Mutex
	wake      chan struct{} // closed when the flight changes; nil: nobody waits
	status    int
	header    keptHeader // as the client got it, less what is its own
	stream    bool
	buf       []byte
	done      bool
	ok        bool // done, complete and successful: it may be replayed
	dropped   bool // it outgrew its bounds: nobody may follow it
	followers int
	ended     time.Time
	saved     usage   // what the answer cost upstream
	savedUSD  float64 // and in US dollars
	kept      int64   // bytes counted in sharedBytes
	// share and owner are those of its principal and its key, while the
	// dedup table holds it: kept counts there too (set by dedupTable.put,
	// before the first byte; written with dedups.mu held too)
	share, owner *dedupShare
	entry        dedupEntry // where the dedup table holds it
}

func newFlight() *flight { return new(flight) }

// changed wakes those waiting for f to change; f.mu is held. A flight that
// nobody follows allocates nothing.
func (f *flight) changed() {
	if f.wake != nil {
		close(f.wake)
		f.wake = nil
	}
}

// waiter returns the channel closed at f's next change; f.mu is held.
func (f *flight) waiter() <-chan struct{} {
	if f.wake == nil {
		f.wake = make(chan struct{})
	}
	return f.wake
}

// begin records the status and headers of the answer.
func (f *flight) begin(status int, h http.Header) {
	kept := make(keptHeader, 0, len(h))
	for k, vs := range h {
		if k == "X-Relay-Request-Id" || k == headerBudgetRemaining || isRatelimitHeader(k) {
			continue
		}
		kept = append(kept, keptField{k, vs})
	}
	f.mu.Lock()
	f.status, f.header, f.stream = status, kept, isEventStream(h)
	if n, err := strconv.Atoi(h.Get("Content-Length")); err == nil && n > 0 && n <= maxSharedAnswer {
		f.buf = make([]byte, 0, n)
	} else if f.stream {
		f.buf = make([]byte, 0, 8<<10)
	}
	f.changed()
	f.mu.Unlock()
}

// add appends a piece of the body, or drops the flight when it outgrows
// its bounds.
func (f *flight) add(p []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.dropped {
		return
	}
	n := int64(len(p))
	if int64(len(f.buf))+n > maxSharedAnswer || !f.take(n) {
		f.drop()
		return
	}
	f.kept += n
	f.buf = append(f.buf, p...)
	f.changed()
}

// take counts n more bytes kept: in its principal's share, within it, in
// the process's bytes, within maxSharedBytes (once its key made room, when
// every byte is taken: dedupTable.makeRoom), and in its key's share; f.mu
// is held, and let go of while room is made.
func (f *flight) take(n int64) bool {
	share, owner := f.share, f.owner
	if share != nil && !share.principal.bytes.take(n, maxSharedBytesPerPrincipal) {
		return false
	}
	if !sharedBytes.take(n, maxSharedBytes) && (owner == nil || !f.makeRoom(owner, n)) {
		if share != nil {
			share.principal.bytes.give(n)
		}
		return false
	}
	if owner != nil {
		owner.key.bytes.used.Add(n)
	}
	return true
}

// makeRoom takes n bytes once the dedup table made room for them; f.mu is
// held, and let go of meanwhile: the table locks a flight after itself.
// Only the leading request adds to f, and f is in flight, so none of it
// changes meanwhile but for its followers.
func (f *flight) makeRoom(owner *dedupShare, n int64) bool {
	f.mu.Unlock()
	freed := dedups.makeRoom(owner, n)
	f.mu.Lock()
	return freed && !f.dropped && sharedBytes.take(n, maxSharedBytes)
}

// drop lets go of the body; f.mu is held.
func (f *flight) drop() {
	f.dropped, f.buf = true, nil
	f.giveBack()
	f.changed()
}

// giveBack gives back the bytes f counts; f.mu is held.
func (f *flight) giveBack() {
	sharedBytes.give(f.kept)
	if f.share != nil {
		f.share.principal.bytes.give(f.kept)
		f.owner.key.bytes.give(f.kept)
	}
	f.kept = 0
}

// stopped reports whether the flight ended: done, or dropped.
func (f *flight) stopped() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.done || f.dropped
}

// finish ends the flight; ok says its answer may be replayed.
func (f *flight) finish(ok bool, u usage, usd float64, now time.Time) {
	f.mu.Lock()
	f.done, f.ok, f.saved, f.savedUSD, f.ended = true, ok && !f.dropped && f.status != 0, u, usd, now
	f.changed()
	f.mu.Unlock()
}

// release gives back the bytes f counts.
func (f *flight) release() {
	f.mu.Lock()
	f.giveBack()
	f.mu.Unlock()
}

func (f *flight) follow() {
	f.mu.Lock()
	f.followers++
	f.mu.Unlock()
}

func (f *flight) followed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.followers > 0
}

// keptHeader is the header fields of an answer as a flight keeps them, a
// copy that every recorded request makes: a slice, filled without hashing
// a name or growing a map.
type keptHeader []keptField

type keptField struct {
	name   string
	values []string
}

// writeTo sets the kept fields in h.
func (k keptHeader) writeTo(h http.Header) {
	for _, f := range k {
		h[f.name] = f.values
	}
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
	dk := newDedupKey(in.who.stateID, idem, d)
	if retry {
		if f := dedups.find(dk, now, r.dedupWindow); f != nil {
			if rerr := r.admitPending(in); rerr != nil {
				return refused(rerr)
			}
			if r.replay(w, req.Context(), in, f, sharedDedup) {
				metricDedup.WithLabelValues(g).Inc()
				return nil
			}
		}
	}
	f := newFlight()
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
	if !marked || !dedups.put(dk, in.who.key.stateID, f, now, r.dedupWindow) {
		defer f.release() // nobody finds it once its cache entry is stored
	}
	grace := time.Duration(0) // a request no SDK will retry ends with its client, unless followed
	if marked {
		grace = r.dedupGrace
	}
	fail := r.lead(w, req, in, f, grace)
	if c != nil && f.ok {
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
func (r *Relay) replay(w http.ResponseWriter, ctx context.Context, in *inbound, f *flight, how string) bool {
	f.mu.Lock()
	// a stream is replayed from its headers on; any other answer once whole
	for !f.dropped && !f.done && (f.status == 0 || !f.stream) {
		wake := f.waiter()
		f.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			in.end.sharedBy(how)
			return true // the client is gone
		}
		f.mu.Lock()
	}
	if f.dropped || f.done && !f.ok {
		f.mu.Unlock()
		return false
	}
	status, header := f.status, f.header
	f.mu.Unlock()

	in.end.sharedBy(how)
	h := w.Header()
	header.writeTo(h)
	r.ratelimitHeaders(h, in)
	w.WriteHeader(status)
	rc := http.NewResponseController(w)
	for pos := 0; ; {
		f.mu.Lock()
		done, dropped := f.done, f.dropped
		var chunk []byte
		var wake <-chan struct{}
		if !dropped { // a dropped flight has let go of its bytes
			chunk = f.buf[pos:len(f.buf)]
			if !done {
				wake = f.waiter()
			}
		}
		ok, saved, usd := f.ok, f.saved, f.savedUSD
		f.mu.Unlock()
		if dropped { // the leader's answer outgrew what is kept
			_, _ = w.Write(sseError("api_error", "the answer this retry attached to grew too large to replay", in.id))
			in.end.cut()
			_ = rc.Flush()
			return true
		}
		if len(chunk) > 0 {
			if _, err := w.Write(chunk); err != nil {
				in.end.cut()
				return true
			}
			pos += len(chunk)
			_ = rc.Flush()
		}
		if done {
			in.end.whole(ok)
			if ok {
				r.saved(in, saved, usd)
			}
			return true
		}
		select {
		case <-wake:
		case <-ctx.Done():
			in.end.cut()
			return true
		}
	}
}

// saved counts what an answer that reached the client without an
// upstream would have cost.
func (r *Relay) saved(in *inbound, u usage, usd float64) {
	g := in.group().name
	if t := u.input + u.output + u.cacheRead + u.cacheWrite; t > 0 {
		metricSavedTokens.WithLabelValues(g).Add(float64(t))
	}
	if usd > 0 {
		metricSavedUSD.WithLabelValues(g).Add(usd)
	}
}
