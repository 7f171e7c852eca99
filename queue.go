package relay

import (
	"container/list"
	"context"
	"strconv"
	"sync"
	"time"
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

// waitQueue holds the requests of a group that found every channel busy:
// one FIFO per priority class. A slot that frees goes to the best waiter:
// the oldest of the highest class. Batch waits while anything better does;
// that is the point.
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
	q.mu.Unlock()
	q.wakeBest()
}

// bestLocked is the waiter a freed slot goes to, or nil.
func (q *waitQueue) bestLocked() *waiter {
	for i := range q.levels {
		if e := q.levels[i].Front(); e != nil {
			return e.Value.(*waiter)
		}
	}
	return nil
}

// isBest reports whether w is the waiter a freed slot goes to.
func (q *waitQueue) isBest(w *waiter) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.bestLocked() == w
}

// ahead reports whether a waiter of class p or better is queued: a new
// request of class p must queue behind it rather than overtake it.
func (q *waitQueue) ahead(p priority) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i := priority(0); i <= p; i++ {
		if q.levels[i].Len() > 0 {
			return true
		}
	}
	return false
}

// wakeBest tells the best waiter to try again.
func (q *waitQueue) wakeBest() {
	q.mu.Lock()
	w := q.bestLocked()
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
		q.wakeBest()
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
		metricRateLimited.WithLabelValues(in.key.name, string(scopeQueue)).Inc()
		return errQueue(msg, retryIn)
	}
	if q.w == nil {
		if g.maxQueue <= 0 {
			return refuse("every channel of group " + strconv.Quote(g.name) + " is at its limit")
		}
		w, ok := g.state.queue.enqueue(in.key.prio, g.maxQueue, now)
		if !ok {
			return refuse("every channel of group " + strconv.Quote(g.name) + " is at its limit and its queue is full")
		}
		q.w = w
		metricQueueDepth.WithLabelValues(g.name, in.key.prio.String()).Inc()
	}
	deadline := q.w.since.Add(g.maxWait[in.key.prio])
	if _, err := g.state.queue.wait(ctx, q.w, freeAt, deadline, q.r.now); err != nil {
		if err == errQueueTimeout {
			return refuse("waited " + g.maxWait[in.key.prio].String() + " (max_wait of class " + in.key.prio.String() + ") for a channel of group " + strconv.Quote(g.name))
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
	return !at.After(since.Add(q.g.maxWait[q.in.key.prio]))
}

// leave takes the request out of the queue, if it is in it.
func (q *queued) leave() {
	if q.w == nil {
		return
	}
	q.g.state.queue.leave(q.w)
	p := q.in.key.prio.String()
	metricQueueDepth.WithLabelValues(q.g.name, p).Dec()
	metricQueueWait.WithLabelValues(q.g.name, p).Observe(q.r.now().Sub(q.w.since).Seconds())
	q.w = nil
}
