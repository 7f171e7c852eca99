package relay

import (
	"context"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/dedup"
)

// The lead: a request that others may follow (a retry attached to its first
// attempt, an identical miss of a group's response cache) is relayed as it
// would be, its answer also written into its flight, and its upstream
// attempt no longer ends with its client: when the client leaves, it runs
// on for the grace, and to its end when another request follows it by
// then.

// lead relays the request, writing its answer into f too. (Once the
// attempt runs on, settle_grace, from the client's leaving too, may read
// on a little longer for the usage: settle.go.)
func (r *Relay) lead(w http.ResponseWriter, req *http.Request, in *inbound, f *dedup.Flight, grace time.Duration) *failure {
	lc := &leadCtx{client: req.Context(), r: r, in: in, grace: grace}
	lc.after = lc.afterBuf[:0]
	lc.tee = teeWriter{ResponseWriter: w, f: f}
	defer lc.end()
	stop := context.AfterFunc(req.Context(), lc.clientLeft)
	defer stop()
	fail := r.relay(&lc.tee, req.WithContext(lc), in)
	ok := fail == nil && in.end.answered != nil && !in.end.incomplete && f.Status() >= 200 && f.Status() <= 299 // what the upstream answered: a Chat Completions answer reaches its client later
	var usd float64
	if ok {
		if rates := r.prices.Lookup(in.grant.target); rates != nil {
			usd = rates.Cost(in.end.usage.priced()) * in.end.answered.priceFactor
		}
	}
	f.Finish(ok, in.end.usage.total(), usd, r.now())
	return fail
}

// leadCtx is the context a lead is relayed with: the values of its client's
// request, and an end of its own instead of the client's, which comes when
// the client has left and nobody followed within the grace, or when the
// lead is over. It is what context.WithCancel(context.WithoutCancel(...))
// and a context.AfterFunc would make, in the one allocation that also holds
// the lead's writer, and it takes the functions to call at its end itself
// (afterFuncer) rather than in a map of children made for every request.
//
// Like the attempt's detached parent, it answers every value, the
// context package's own included, from the client's context: context.Cause
// of a context derived from it may report the client's cause, which the
// relay never asks of it.
type leadCtx struct {
	client context.Context
	r      *Relay
	in     *inbound
	grace  time.Duration
	tee    teeWriter

	ended    atomic.Bool
	mu       sync.Mutex
	done     chan struct{} // made by the first Done
	after    []leadAfter   // the functions to call at the end
	afterBuf [2]leadAfter
	seq      uint64
}

// leadAfter is a function to call at a lead's end, and its number, by
// which it is stopped.
type leadAfter struct {
	id uint64
	f  func()
}

// afterFuncer is a context that calls functions at its end itself, the
// interface the context package looks for as well.
type afterFuncer interface {
	AfterFunc(func()) func() bool
}

func (*leadCtx) Deadline() (time.Time, bool) { return time.Time{}, false }
func (c *leadCtx) Value(key any) any         { return c.client.Value(key) }

// Err implements context.Context.
func (c *leadCtx) Err() error {
	if c.ended.Load() {
		return context.Canceled
	}
	return nil
}

// Done implements context.Context.
func (c *leadCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.ended.Load() {
			close(c.done)
		}
	}
	return c.done
}

// AfterFunc arranges to call f in its own goroutine at c's end (at once
// when c has ended), as context.AfterFunc does; stop keeps f from being
// called, and reports whether it did.
func (c *leadCtx) AfterFunc(f func()) (stop func() bool) {
	c.mu.Lock()
	if c.ended.Load() {
		c.mu.Unlock()
		go f()
		return func() bool { return false }
	}
	c.seq++
	id := c.seq
	c.after = append(c.after, leadAfter{id, f})
	c.mu.Unlock()
	return func() bool { return c.stopAfter(id) }
}

func (c *leadCtx) stopAfter(id uint64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, a := range c.after {
		if a.id == id {
			c.after = slices.Delete(c.after, i, i+1) // which lets go of f
			return true
		}
	}
	return false
}

// end ends c: once, at the lead's end or when its client left and the
// grace passed with nobody following.
func (c *leadCtx) end() {
	c.mu.Lock()
	if c.ended.Load() {
		c.mu.Unlock()
		return
	}
	c.ended.Store(true)
	if c.done != nil {
		close(c.done)
	}
	after := c.after
	c.after = nil
	c.mu.Unlock()
	for _, a := range after {
		go a.f()
	}
}

// clientLeft is the client leaving: the lead records when, and ends c
// after the grace unless another request follows the flight by then.
func (c *leadCtx) clientLeft() {
	c.in.leftAt(c.r.now())
	time.AfterFunc(c.grace, c.graceOver)
}

func (c *leadCtx) graceOver() {
	if !c.tee.f.Followed() {
		c.end()
	}
}

// teeWriter is the leading request's writer: what its client gets goes to
// the flight as well. When the client leaves, the answer goes on into the
// flight alone, for as long as the attempt's context lets it run.
type teeWriter struct {
	http.ResponseWriter
	f    *dedup.Flight
	gone bool
}

func (t *teeWriter) WriteHeader(code int) {
	h := t.ResponseWriter.Header()
	t.f.Begin(code, h, isEventStream(h), clientsOwn)
	t.ResponseWriter.WriteHeader(code)
}

func (t *teeWriter) Write(p []byte) (int, error) {
	if t.f.Status() == 0 { // read by this goroutine only, which sets it
		t.WriteHeader(http.StatusOK)
	}
	t.f.Add(p)
	if !t.gone {
		if _, err := t.ResponseWriter.Write(p); err != nil {
			t.gone = true
		}
	}
	return len(p), nil
}

// FlushError is what http.ResponseController calls to flush.
func (t *teeWriter) FlushError() error {
	if !t.gone {
		if err := http.NewResponseController(t.ResponseWriter).Flush(); err != nil {
			t.gone = true
		}
	}
	return nil
}

func (t *teeWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// clientsOwn reports whether the header field named k of an answer is its
// client's own, never replayed to another: its request id, its budget's
// remainder, its key's rate limits.
func clientsOwn(k string) bool {
	return k == "X-Relay-Request-Id" || k == headerBudgetRemaining || isRatelimitHeader(k)
}
