package relay

import (
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// States made on demand, one per identity of a `user *` entry or per end
// user (metadata.user_id) of a key, are kept in an idleCache: their number
// is set by clients, so it is bounded twice. A state idle for a while is
// dropped, and a cache that is full drops its least recently used state to
// make room.
//
// The recency list is hashicorp's simplelru (golang-lru/v2), already in
// Caddy's dependency graph. Its neighbour, the expirable LRU, does not fit:
// it runs a goroutine per cache that nothing can stop (and caches go with
// their config), reads time.Now itself where the relay injects its clock,
// and expires an entry a fixed time after it was added, not after it was
// last used.

// settler is a state an idleCache can drop: Settled reports whether a new
// state would be the same (nothing in flight, buckets full), so that
// dropping it forgives nothing.
type settler interface {
	Settled(now time.Time) bool
}

// idleCache keeps states by id.
type idleCache[V settler] struct {
	mu   sync.Mutex
	lru  *simplelru.LRU[string, *idleEntry[V]]
	idle time.Duration
}

type idleEntry[V any] struct {
	v    V
	used time.Time
}

// Bounds of the states made on demand.
const (
	// idleAfter is how long a state goes unused before it may be dropped.
	idleAfter = 10 * time.Minute
	// maxIdentities bounds the identities of one user * entry kept.
	maxIdentities = 10_000
	// maxEndUsers bounds the end users of one key or user entry kept.
	maxEndUsers = 10_000
	// sweepSteps bounds the idle states one get looks at, so that a get
	// costs the same however many went idle at once.
	sweepSteps = 4
)

func newIdleCache[V settler](size int, idle time.Duration) *idleCache[V] {
	return newIdleCacheDropping[V](size, idle, nil)
}

// newIdleCacheDropping is newIdleCache whose states, once dropped (idle,
// or to make room), are handed to drop (under the cache's lock).
func newIdleCacheDropping[V settler](size int, idle time.Duration, drop func(V)) *idleCache[V] {
	var onEvict simplelru.EvictCallback[string, *idleEntry[V]]
	if drop != nil {
		onEvict = func(_ string, e *idleEntry[V]) { drop(e.v) }
	}
	lru, err := simplelru.NewLRU[string, *idleEntry[V]](size, onEvict)
	if err != nil {
		panic(err) // size is a positive constant
	}
	return &idleCache[V]{lru: lru, idle: idle}
}

// get returns id's state, made by create when there is none, and marks it
// used at now. On the way it drops a few states idle since idle before now.
func (c *idleCache[V]) get(id string, now time.Time, create func() V) V {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sweep(now)
	if e, ok := c.lru.Get(id); ok {
		e.used = now
		return e.v
	}
	v := create()
	c.lru.Add(id, &idleEntry[V]{v: v, used: now}) // when full, the least recently used goes
	return v
}

// peek is id's state, without marking it used or making one.
func (c *idleCache[V]) peek(id string) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.lru.Peek(id)
	if !ok {
		var zero V
		return zero, false
	}
	return e.v, true
}

// oldest is the least recently used state and its id, without marking it
// used.
func (c *idleCache[V]) oldest() (string, V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id, e, ok := c.lru.GetOldest()
	if !ok {
		var zero V
		return "", zero, false
	}
	return id, e.v, true
}

// dropOldest drops the least recently used state, settled or not; false
// when there is none.
func (c *idleCache[V]) dropOldest() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _, ok := c.lru.RemoveOldest()
	return ok
}

// remove drops id's state when it is still v.
func (c *idleCache[V]) remove(id string, v V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.lru.Peek(id); ok && any(e.v) == any(v) {
		c.lru.Remove(id)
	}
}

// purge drops every state.
func (c *idleCache[V]) purge() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lru.Purge()
}

// sweep looks at up to sweepSteps of the least recently used states and
// drops those idle for long enough and settled. One idle but not settled
// (a request in flight, a bucket in debt) is kept, as if used now.
func (c *idleCache[V]) sweep(now time.Time) {
	for range sweepSteps {
		id, e, ok := c.lru.GetOldest()
		if !ok || now.Sub(e.used) < c.idle {
			return
		}
		if e.v.Settled(now) {
			c.lru.RemoveOldest()
			continue
		}
		e.used = now
		c.lru.Get(id) // to the front
	}
}

// each calls f with every state kept, without marking any used.
func (c *idleCache[V]) each(f func(id string, v V)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range c.lru.Keys() {
		if e, ok := c.lru.Peek(id); ok {
			f(id, e.v)
		}
	}
}

// len is the number of states kept.
func (c *idleCache[V]) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len()
}
