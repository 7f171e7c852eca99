// Package dedup holds the answers one request gets for others: a flight,
// the broadcast buffer the leading request writes its answer into and
// followers replay from its first byte, then live; and the table of the
// flights of the requests an SDK may retry, bounded in entries and in
// bytes, fairly between principals and keys.
//
// The official SDKs retry a request that timed out or lost its connection,
// while the upstream may still be working on the first attempt: the relay
// answers such a retry from the flight of the attempt it repeats instead of
// paying the upstream again. The same flights coalesce identical misses of
// a group's response cache. What a request is, who it is and when it may
// follow are the relay's; this package only keeps the answers, within
// their bounds.
package dedup

import (
	"context"
	"crypto/sha256"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Bounds of what the flights keep.
const (
	// MaxAnswer bounds the bytes kept of one answer; a larger answer is
	// not kept, and its retries (or coalesced misses) go upstream.
	MaxAnswer = 4 << 20
	// maxBytes bounds the bytes kept by all flights of the process
	// together (in flight, and answered ones within the dedup window).
	maxBytes = 64 << 20
	// MaxEntries bounds the requests the dedup table remembers.
	MaxEntries = 10_000
	// MaxPerPrincipal bounds those of one principal (a key, an identity),
	// so that no tenant's flood of recorded requests fills the table and
	// leaves the retries of the others to be paid twice.
	MaxPerPrincipal = MaxEntries / 10
	// maxBytesPerPrincipal bounds the bytes kept by the flights of one
	// principal that the dedup table holds, so that no tenant's large
	// answers take every byte kept and leave the others' retries to be
	// paid twice.
	maxBytesPerPrincipal = maxBytes / 10
)

// Digest identifies a request for dedup and the cache: its route, its
// anthropic-version and anthropic-beta headers and its body.
type Digest [sha256.Size]byte

// sharedBytes counts the bytes all flights keep, against maxBytes.
var sharedBytes byteBudget

// SharedBytes is the bytes all flights of the process keep now.
func SharedBytes() int64 { return sharedBytes.used.Load() }

type byteBudget struct{ used atomic.Int64 }

func (b *byteBudget) take(n, limit int64) bool {
	if b.used.Add(n) > limit {
		b.used.Add(-n)
		return false
	}
	return true
}

func (b *byteBudget) give(n int64) { b.used.Add(-n) }

// Flight is one upstream answer as the leading request writes it to its
// client: status, headers and every byte of the body, which followers
// replay from the first byte and then live.
type Flight struct {
	mu        sync.Mutex
	wake      chan struct{} // closed when the flight changes; nil: nobody waits
	status    int
	header    Header // as the client got it, less what is its own
	stream    bool
	buf       []byte
	done      bool
	ok        bool // done, complete and successful: it may be replayed
	dropped   bool // it outgrew its bounds: nobody may follow it
	followers int
	ended     time.Time
	tokens    int64   // what the answer cost upstream, in tokens
	usd       float64 // and in US dollars
	kept      int64   // bytes counted in sharedBytes
	// table, share and owner are the dedup table that holds it and the
	// holdings of its principal and its key there: kept counts there too
	// (set by Table.Put, before the first byte; written with the table's
	// mu held too)
	table        *Table
	share, owner *holding
	entry        entry // where the dedup table holds it
}

// NewFlight is a flight with nothing in it yet.
func NewFlight() *Flight { return new(Flight) }

// changed wakes those waiting for f to change; f.mu is held. A flight that
// nobody follows allocates nothing.
func (f *Flight) changed() {
	if f.wake != nil {
		close(f.wake)
		f.wake = nil
	}
}

// waiter returns the channel closed at f's next change; f.mu is held.
func (f *Flight) waiter() <-chan struct{} {
	if f.wake == nil {
		f.wake = make(chan struct{})
	}
	return f.wake
}

// Begin records the status and headers of the answer, but for the fields
// that are the client's own (own reports them; nil: none is); stream says
// the answer is an event stream.
func (f *Flight) Begin(status int, h http.Header, stream bool, own func(name string) bool) {
	kept := make(Header, 0, len(h))
	for k, vs := range h {
		if own != nil && own(k) {
			continue
		}
		kept = append(kept, field{k, vs})
	}
	f.mu.Lock()
	f.status, f.header, f.stream = status, kept, stream
	if n, err := strconv.Atoi(h.Get("Content-Length")); err == nil && n > 0 && n <= MaxAnswer {
		f.buf = make([]byte, 0, n)
	} else if f.stream {
		f.buf = make([]byte, 0, 8<<10)
	}
	f.changed()
	f.mu.Unlock()
}

// Status is the status Begin recorded, 0 before it. Only the goroutine that
// writes the flight may ask it: it reads without the lock.
func (f *Flight) Status() int { return f.status }

// Add appends a piece of the body, or drops the flight when it outgrows
// its bounds.
func (f *Flight) Add(p []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.dropped {
		return
	}
	n := int64(len(p))
	if int64(len(f.buf))+n > MaxAnswer || !f.take(n) {
		f.drop()
		return
	}
	f.kept += n
	f.buf = append(f.buf, p...)
	f.changed()
}

// take counts n more bytes kept: in its principal's share, within it, in
// the process's bytes, within maxBytes (once its key made room, when
// every byte is taken: Table.makeRoom), and in its key's share; f.mu is
// held, and let go of while room is made.
func (f *Flight) take(n int64) bool {
	share, owner := f.share, f.owner
	if share != nil && !share.principal.bytes.take(n, maxBytesPerPrincipal) {
		return false
	}
	if !sharedBytes.take(n, maxBytes) && (owner == nil || !f.makeRoom(owner, n)) {
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
func (f *Flight) makeRoom(owner *holding, n int64) bool {
	t := f.table
	f.mu.Unlock()
	freed := t.makeRoom(owner, n)
	f.mu.Lock()
	return freed && !f.dropped && sharedBytes.take(n, maxBytes)
}

// drop lets go of the body; f.mu is held.
func (f *Flight) drop() {
	f.dropped, f.buf = true, nil
	f.giveBack()
	f.changed()
}

// giveBack gives back the bytes f counts; f.mu is held.
func (f *Flight) giveBack() {
	sharedBytes.give(f.kept)
	if f.share != nil {
		f.share.principal.bytes.give(f.kept)
		f.owner.key.bytes.give(f.kept)
	}
	f.kept = 0
}

// stopped reports whether the flight ended: done, or dropped.
func (f *Flight) stopped() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.done || f.dropped
}

// Finish ends the flight; ok says its answer may be replayed, tokens and
// usd what it cost upstream.
func (f *Flight) Finish(ok bool, tokens int64, usd float64, now time.Time) {
	f.mu.Lock()
	f.done, f.ok, f.tokens, f.usd, f.ended = true, ok && !f.dropped && f.status != 0, tokens, usd, now
	f.changed()
	f.mu.Unlock()
}

// OK reports whether the flight ended complete and successful: whether it
// may be replayed.
func (f *Flight) OK() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ok
}

// Release gives back the bytes f counts.
func (f *Flight) Release() {
	f.mu.Lock()
	f.giveBack()
	f.mu.Unlock()
}

// Follow counts one more request that follows f.
func (f *Flight) Follow() {
	f.mu.Lock()
	f.followers++
	f.mu.Unlock()
}

// Followed reports whether a request follows f.
func (f *Flight) Followed() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.followers > 0
}

// Followers is the number of requests that follow f.
func (f *Flight) Followers() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.followers
}

// Awaited reports whether a follower waits for f's next change.
func (f *Flight) Awaited() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.wake != nil
}

// Head waits until f may be replayed from its start: a stream once its
// headers are in, any other answer once whole. It returns the status and
// the header to write; ok is false when f failed (or outgrew its bounds)
// first, and nothing may be replayed. err is ctx's when ctx ended while it
// waited.
func (f *Flight) Head(ctx context.Context) (status int, h Header, ok bool, err error) {
	f.mu.Lock()
	// a stream is replayed from its headers on; any other answer once whole
	for !f.dropped && !f.done && (f.status == 0 || !f.stream) {
		wake := f.waiter()
		f.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return 0, nil, false, ctx.Err()
		}
		f.mu.Lock()
	}
	if f.dropped || f.done && !f.ok {
		f.mu.Unlock()
		return 0, nil, false, nil
	}
	status, h = f.status, f.header
	f.mu.Unlock()
	return status, h, true, nil
}

// Part is what a follower finds of a flight at once.
type Part struct {
	// Chunk is the body past the position asked (none once dropped).
	Chunk []byte
	// Wake is closed at the flight's next change; nil once it ended.
	Wake <-chan struct{}
	// Done says the flight ended; OK, Tokens and USD are then Finish's.
	Done bool
	// Dropped says the answer outgrew its bounds and let go of its bytes.
	Dropped bool
	OK      bool
	Tokens  int64
	USD     float64
}

// Read is what f holds past the first pos bytes of its body.
func (f *Flight) Read(pos int) Part {
	f.mu.Lock()
	defer f.mu.Unlock()
	p := Part{Done: f.done, Dropped: f.dropped, OK: f.ok, Tokens: f.tokens, USD: f.usd}
	if !f.dropped { // a dropped flight has let go of its bytes
		p.Chunk = f.buf[pos:len(f.buf)]
		if !f.done {
			p.Wake = f.waiter()
		}
	}
	return p
}

// Answer is a flight's answer: what a cache keeps of it.
type Answer struct {
	Status int
	Header Header
	Body   []byte
	// OK says the flight ended complete and successful.
	OK bool
	// Tokens and USD are what the answer cost upstream.
	Tokens int64
	USD    float64
}

// Answer is f's answer as it is now.
func (f *Flight) Answer() Answer {
	f.mu.Lock()
	defer f.mu.Unlock()
	return Answer{Status: f.status, Header: f.header, Body: f.buf, OK: f.ok, Tokens: f.tokens, USD: f.usd}
}

// Header is the header fields of an answer as a flight keeps them, a copy
// that every recorded request makes: a slice, filled without hashing a
// name or growing a map.
type Header []field

type field struct {
	name   string
	values []string
}

// CopyTo sets the kept fields in h.
func (k Header) CopyTo(h http.Header) {
	for _, f := range k {
		h[f.name] = f.values
	}
}

// Size is the bytes of the kept fields' names and values.
func (k Header) Size() int {
	n := 0
	for _, f := range k {
		n += len(f.name)
		for _, v := range f.values {
			n += len(v)
		}
	}
	return n
}
