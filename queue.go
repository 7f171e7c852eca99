package relay

import (
	"container/list"
	"context"
	"strconv"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
)

// priority is a key's class in the admission queue; a lower value is served
// first.
type priority uint8

const (
	priorityRealtime priority = iota
	priorityNormal
	priorityBatch
	priorityCount
)

var priorityNames = [priorityCount]string{"realtime", "normal", "batch"}

func (p priority) String() string { return priorityNames[p] }

func priorityByName(s string) (priority, bool) {
	switch s {
	case "", "normal":
		return priorityNormal, true
	case "realtime":
		return priorityRealtime, true
	case "batch":
		return priorityBatch, true
	}
	return 0, false
}

// Queue defaults.
var defaultMaxWait = [priorityCount]time.Duration{10 * time.Second, 30 * time.Second, 5 * time.Minute}

const defaultMaxQueue = 1000

// waitQueue holds the requests of a group that found every channel busy,
// and those whose budget is held by requests in flight: one FIFO per
// priority class. A slot that frees goes to the best waiter for a channel:
// the oldest of the highest class; a hold that settles wakes the best
// waiter on its account. Batch waits while anything better does; that is
// the point. The two kinds of waiter never pass each other a turn: a
// request held up by its budget does not hold up a request of another key
// that waits for a channel, nor the other way round.
type waitQueue struct {
	mu     sync.Mutex
	levels [priorityCount]list.List
}

// waiter is one queued request.
type waiter struct {
	prio  priority
	since time.Time
	wake  chan struct{} // capacity 1: a pending "try again"
	elem  *list.Element
	// acct is the spend account whose holds in flight the waiter waits
	// on to settle; nil while it waits for a channel. Guarded by the
	// queue's mu.
	acct *money.Account
}

// enqueue adds a waiter of class p unless the queue holds max already.
func (q *waitQueue) enqueue(p priority, max int, now time.Time) (*waiter, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.lenLocked() >= max {
		return nil, false
	}
	w := &waiter{prio: p, since: now, wake: make(chan struct{}, 1)}
	w.elem = q.levels[p].PushBack(w)
	return w, true
}

func (q *waitQueue) lenLocked() int {
	n := 0
	for i := range q.levels {
		n += q.levels[i].Len()
	}
	return n
}

// leave removes w, and tells the waiter now first in line to try: a
// channel may well have room for it (the one that left may have been served
// by a slot that was not its last, or given up a turn it did not use).
func (q *waitQueue) leave(w *waiter) {
	q.mu.Lock()
	q.levels[w.prio].Remove(w.elem)
	acct := w.acct
	q.mu.Unlock()
	q.wakeBest()
	if acct != nil {
		q.WakeFor(acct)
	}
}

// bestLocked is the best waiter on acct (nil: for a channel), or nil.
func (q *waitQueue) bestLocked(acct *money.Account) *waiter {
	for i := range q.levels {
		for e := q.levels[i].Front(); e != nil; e = e.Next() {
			if w := e.Value.(*waiter); w.acct == acct {
				return w
			}
		}
	}
	return nil
}

// isBest reports whether w is the waiter what it waits for goes to.
func (q *waitQueue) isBest(w *waiter) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.bestLocked(w.acct) == w
}

// ahead reports whether a waiter for a channel of class p or better is
// queued: a new request of class p must queue behind it rather than
// overtake it.
func (q *waitQueue) ahead(p priority) bool { return q.aheadOn(p, nil) }

// aheadOn reports whether a waiter on acct (nil: for a channel) of class p
// or better is queued.
func (q *waitQueue) aheadOn(p priority, acct *money.Account) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i := priority(0); i <= p; i++ {
		for e := q.levels[i].Front(); e != nil; e = e.Next() {
			if e.Value.(*waiter).acct == acct {
				return true
			}
		}
	}
	return false
}

// waitOn marks w as waiting on acct (nil: for a channel). A waiter that
// stops waiting for a channel passes on a turn it may have been given.
func (q *waitQueue) waitOn(w *waiter, acct *money.Account) {
	q.mu.Lock()
	was := w.acct
	w.acct = acct
	q.mu.Unlock()
	if was == nil && acct != nil {
		q.wakeBest()
	}
}

// wakeBest tells the best waiter for a channel to try again.
func (q *waitQueue) wakeBest() { q.WakeFor(nil) }

// WakeFor tells the best waiter on acct (nil: for a channel) to try
// again.
func (q *waitQueue) WakeFor(acct *money.Account) {
	q.mu.Lock()
	w := q.bestLocked(acct)
	q.mu.Unlock()
	if w != nil {
		select {
		case w.wake <- struct{}{}:
		default: // it has a wake-up pending already
		}
	}
}

// wait blocks until w should try again: a wake-up, the time a busy channel
// frees up (freeAt, zero when only a release can tell), the deadline, or
// the client leaving. It reports whether to try again. A waiter that is not
// the best when its timer fires passes the turn to the best one and waits
// on, so the order holds for limits that free up with time too.
func (q *waitQueue) wait(ctx context.Context, w *waiter, freeAt, deadline time.Time, now func() time.Time) (retry bool, err error) {
	for {
		until := deadline
		if !freeAt.IsZero() && freeAt.Before(until) {
			until = freeAt
		}
		d := until.Sub(now())
		if d <= 0 && until.Equal(deadline) {
			return false, errQueueTimeout
		}
		t := time.NewTimer(max(d, 0))
		select {
		case <-ctx.Done():
			t.Stop()
			return false, ctx.Err()
		case <-w.wake:
			t.Stop()
			return true, nil
		case <-t.C:
		}
		if !now().Before(deadline) {
			return false, errQueueTimeout
		}
		if q.isBest(w) {
			return true, nil
		}
		q.mu.Lock()
		acct := w.acct
		q.mu.Unlock()
		q.WakeFor(acct)
		freeAt = time.Time{}
	}
}

// errQueueTimeout is a request that waited its class's max_wait.
var errQueueTimeout = queueTimeout{}

type queueTimeout struct{}

func (queueTimeout) Error() string { return "queue wait exceeded" }

// queued is a request's place in its group's queue, once it has one.
type queued struct {
	r  *Relay
	g  *group
	in *inbound
	w  *waiter
}

// wait queues the request (when not queued yet) and waits for its turn,
// the time a busy channel frees up (freeAt; zero when unknown), or its
// class's max_wait. A non-nil error is the answer: the queue is full or
// disabled, the wait ran out, or the client left.
func (q *queued) wait(ctx context.Context, freeAt time.Time) *relayError {
	g, in, now := q.g, q.in, q.r.now()
	retryIn := time.Duration(0)
	if !freeAt.IsZero() {
		retryIn = freeAt.Sub(now)
	}
	refuse := func(msg string) *relayError {
		metricRateLimited.WithLabelValues(in.who.key.name, string(limits.ScopeQueue)).Inc()
		return errQueue(msg, retryIn)
	}
	return q.waitOn(ctx, nil, freeAt, nil, func(why queueRefusal) *relayError {
		switch why {
		case queueOff:
			return refuse("every channel of group " + strconv.Quote(g.name) + " is at its limit")
		case queueFull:
			return refuse("every channel of group " + strconv.Quote(g.name) + " is at its limit and its queue is full")
		}
		return refuse("waited " + g.maxWait[in.who.key.prio].String() + " (max_wait of class " + in.who.key.prio.String() + ") for a channel of group " + strconv.Quote(g.name))
	})
}

// queueRefusal is why a request could not wait on in the queue.
type queueRefusal uint8

const (
	queueOff    queueRefusal = iota // the group does not queue
	queueFull                       // max_queue requests wait already
	queueWaited                     // it waited its class's max_wait
)

// waitOn queues the request (when not queued yet) as waiting on acct
// (nil: for a channel) and waits for its turn, freeAt, or its class's
// max_wait; refuse makes the answer when it cannot wait on. ready, when
// given, is asked once the request is in line: true when what it waits
// for came already, between its last try and now (no wake-up would come
// for it), and it is to try again at once.
func (q *queued) waitOn(ctx context.Context, acct *money.Account, freeAt time.Time, ready func() bool, refuse func(queueRefusal) *relayError) *relayError {
	g, in, now := q.g, q.in, q.r.now()
	if q.w == nil {
		if g.maxQueue <= 0 {
			return refuse(queueOff)
		}
		w, ok := g.state.queue.enqueue(in.who.key.prio, g.maxQueue, now)
		if !ok {
			return refuse(queueFull)
		}
		q.w = w
		metricQueueDepth.WithLabelValues(g.name, in.who.key.prio.String()).Inc()
	}
	g.state.queue.waitOn(q.w, acct)
	if ready != nil && ready() {
		return nil
	}
	deadline := q.w.since.Add(g.maxWait[in.who.key.prio])
	if _, err := g.state.queue.wait(ctx, q.w, freeAt, deadline, q.r.now); err != nil {
		if err == errQueueTimeout {
			return refuse(queueWaited)
		}
		return &relayError{status: statusClientClosed, typ: "api_error", msg: "client left while queued"}
	}
	return nil
}

// fits reports whether at comes before the request's class would stop
// waiting in the queue (its max_wait, from when it entered).
func (q *queued) fits(at time.Time) bool {
	if q.g.maxQueue <= 0 {
		return false
	}
	since := q.r.now()
	if q.w != nil {
		since = q.w.since
	}
	return !at.After(since.Add(q.g.maxWait[q.in.who.key.prio]))
}

// leave takes the request out of the queue, if it is in it.
func (q *queued) leave() {
	if q.w == nil {
		return
	}
	q.g.state.queue.leave(q.w)
	p := q.in.who.key.prio.String()
	metricQueueDepth.WithLabelValues(q.g.name, p).Dec()
	wait := q.r.now().Sub(q.w.since)
	q.in.tr.observe(metricQueueWait.WithLabelValues(q.g.name, p), wait.Seconds())
	q.in.tr.queued(p, wait)
	q.w = nil
}
