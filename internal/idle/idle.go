// Package idle keeps states made on demand, bounded in number and dropped
// when idle.
//
// States made on demand, one per identity of a `user *` entry or per end
// user (metadata.user_id) of a key, are kept in a Cache: their number is
// set by clients, so it is bounded twice. A state idle for a while is
// dropped, and a cache that is full drops its least recently used state to
// make room.
//
// The recency list is hashicorp's simplelru (golang-lru/v2), already in
// Caddy's dependency graph. Its neighbour, the expirable LRU, does not fit:
// it runs a goroutine per cache that nothing can stop (and caches go with
// their config), reads time.Now itself where the relay injects its clock,
// and expires an entry a fixed time after it was added, not after it was
// last used.
package idle

import (
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Settler is a state a Cache can drop: Settled reports whether a new state
// would be the same (nothing in flight, buckets full), so that dropping it
// forgives nothing.
type Settler interface {
	Settled(now time.Time) bool
}

// Cache keeps states by id.
type Cache[V Settler] struct {
	mu   sync.Mutex
	lru  *simplelru.LRU[string, *entry[V]]
	idle time.Duration
}

type entry[V any] struct {
	v    V
	used time.Time
}

// SweepSteps bounds the idle states one Get looks at, so that a Get costs
// the same however many went idle at once.
const SweepSteps = 4

// New is a cache of at most size states (a positive constant), each
// dropped once unused for idle and settled.
func New[V Settler](size int, idle time.Duration) *Cache[V] {
	return NewDropping[V](size, idle, nil)
}

// NewDropping is New whose states, once dropped (idle, or to make room),
// are handed to drop (under the cache's lock).
func NewDropping[V Settler](size int, idle time.Duration, drop func(V)) *Cache[V] {
	var onEvict simplelru.EvictCallback[string, *entry[V]]
	if drop != nil {
		onEvict = func(_ string, e *entry[V]) { drop(e.v) }
	}
	lru, err := simplelru.NewLRU[string, *entry[V]](size, onEvict)
	if err != nil {
		panic(err) // size is a positive constant
	}
	return &Cache[V]{lru: lru, idle: idle}
}

// Get returns id's state, made by create when there is none, and marks it
// used at now. On the way it drops a few states idle since idle before now.
func (c *Cache[V]) Get(id string, now time.Time, create func() V) V {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sweep(now)
	if e, ok := c.lru.Get(id); ok {
		e.used = now
		return e.v
	}
	v := create()
	c.lru.Add(id, &entry[V]{v: v, used: now}) // when full, the least recently used goes
	return v
}

// Peek is id's state, without marking it used or making one.
func (c *Cache[V]) Peek(id string) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.lru.Peek(id)
	if !ok {
		var zero V
		return zero, false
	}
	return e.v, true
}

// Oldest is the least recently used state and its id, without marking it
// used.
func (c *Cache[V]) Oldest() (string, V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	id, e, ok := c.lru.GetOldest()
	if !ok {
		var zero V
		return "", zero, false
	}
	return id, e.v, true
}

// DropOldest drops the least recently used state, settled or not; false
// when there is none.
func (c *Cache[V]) DropOldest() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, _, ok := c.lru.RemoveOldest()
	return ok
}

// Remove drops id's state when it is still v.
func (c *Cache[V]) Remove(id string, v V) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.lru.Peek(id); ok && any(e.v) == any(v) {
		c.lru.Remove(id)
	}
}

// Purge drops every state.
func (c *Cache[V]) Purge() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.lru.Purge()
}

// sweep looks at up to SweepSteps of the least recently used states and
// drops those idle for long enough and settled. One idle but not settled
// (a request in flight, a bucket in debt) is kept, as if used now.
func (c *Cache[V]) sweep(now time.Time) {
	for range SweepSteps {
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

// Each calls f with every state kept, without marking any used.
func (c *Cache[V]) Each(f func(id string, v V)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range c.lru.Keys() {
		if e, ok := c.lru.Peek(id); ok {
			f(id, e.v)
		}
	}
}

// Len is the number of states kept.
func (c *Cache[V]) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.lru.Len()
}
