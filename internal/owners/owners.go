// Package owners keeps who made each batch and file: the group of the key
// that made it.
//
// Every batch and file made through the relay has an owner. The relay
// records it once the upstream has made the item and before the client
// learns its id, and checks it on every later call and on every list: a
// group sees and touches only its own items. An id's MAC says which group
// the id was sealed for (internal/resourceid); the record says which group
// made the item. Only both together let a call through, so an id sealed
// for the wrong group (as merged lists did before the relay kept owners)
// still names nothing, and an upstream item with no record (made outside
// the relay, or before it kept owners) is no group's.
//
// Records are kept where the relay keeps its other lasting state:
//
//   - in a fleet, in Redis: one hash per channel and kind,
//     <prefix>{c:<channel>}:owners:<files|batches>, whose fields are the
//     upstream's ids and whose values are the owners' group names, so the
//     owners of one upstream page of a list are one HMGET;
//   - otherwise in Caddy's storage: one small JSON record per item, at
//     relay/owners/<files|batches>/<hex>, where hex is the first 16 bytes
//     of the sha256 of the channel's name, a zero byte and the upstream's
//     id.
//
// A record is written once and never changed; it is removed when the item
// is deleted through the relay, or when the upstream answers a get or a
// delete of it with 404 not_found_error. That lets a bounded in-memory
// cache (one per relay handler, empty again after a reload) keep what it
// has read. In Caddy's
// storage, where each look-up is a read of its own, the cache also
// remembers for a minute that an item has no record, so that a list that
// scans many items made outside the relay does not read them all again on
// every request; a get, content, results, cancel or delete never trusts
// that memory, and a record this relay writes replaces it at once. A
// fleet's nodes remember only records (another node may have just written
// one).
package owners

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddyserver/certmagic"
	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Store keeps the owners of batches and files.
type Store struct {
	fleet   *fleet.Client     // set in fleet mode
	storage certmagic.Storage // Caddy's storage; nil in a unit test's context
	now     func() time.Time

	mu     sync.Mutex
	cache  *simplelru.LRU[string, entry]
	memory map[string]string // the records, with neither fleet nor storage
}

// entry is what the cache knows of one item.
type entry struct {
	group string    // the owner; "" for an item that had no record
	until time.Time // for "": until when that is trusted in a list
}

// Bounds of the owners' cache.
const (
	// cacheSize bounds the items whose owner is kept in memory
	// (about 150 bytes each).
	cacheSize = 50_000
	// missFor is how long a list trusts that an item has no record,
	// in Caddy's storage.
	missFor = time.Minute
)

// New returns the owners of a relay handler: kept in the Redis of fleet f
// when f is not nil, else in storage, else (a unit test's context) in
// memory; now is the clock of the cache's memory of items with no record.
func New(f *fleet.Client, storage certmagic.Storage, now func() time.Time) *Store {
	cache, err := simplelru.NewLRU[string, entry](cacheSize, nil)
	if err != nil {
		panic(err) // the size is a positive constant
	}
	o := &Store{fleet: f, storage: storage, now: now, cache: cache}
	if f == nil && storage == nil {
		o.memory = map[string]string{}
	}
	return o
}

// cacheKey names an item in the cache.
func cacheKey(kind resourceid.Kind, channel, up string) string {
	return string(rune('0'+kind)) + channel + "\x00" + up
}

// StorageKey is where, in Caddy's storage, the owner of an item is
// recorded. The channel and the upstream's id are hashed: either may hold
// characters a path must not.
func StorageKey(kind resourceid.Kind, channel, up string) string {
	sum := sha256.Sum256([]byte(channel + "\x00" + up))
	return "relay/owners/" + kind.String() + "/" + hex.EncodeToString(sum[:16])
}

// hash is the Redis hash of a channel's owners of one kind.
func (o *Store) hash(kind resourceid.Kind, channel string) string {
	return o.fleet.Key(fleet.Tag("c:", channel), "owners:"+kind.String())
}

// record is a record in Caddy's storage. The channel and the upstream's
// id are kept beside the owner so that an operator can read what a record
// is about.
type record struct {
	Group   string    `json:"group"`
	Channel string    `json:"channel"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
}

// Record notes that group owns the item up of kind at channel.
func (o *Store) Record(ctx context.Context, kind resourceid.Kind, channel, up, group string) error {
	switch {
	case o.fleet != nil:
		f := o.fleet
		if err := f.Do("owners", func(ctx context.Context) error {
			return f.Redis.HSet(ctx, o.hash(kind, channel), up, group).Err()
		}); err != nil {
			return err
		}
	case o.storage != nil:
		b, _ := json.Marshal(record{Group: group, Channel: channel, ID: up, Created: o.now().UTC()})
		if err := o.storage.Store(ctx, StorageKey(kind, channel, up), b); err != nil {
			return err
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.memory != nil {
		o.memory[cacheKey(kind, channel, up)] = group
	}
	o.cache.Add(cacheKey(kind, channel, up), entry{group: group})
	return nil
}

// Forget removes the record of the item up of kind at channel, which the
// upstream no longer has.
func (o *Store) Forget(ctx context.Context, kind resourceid.Kind, channel, up string) error {
	k := cacheKey(kind, channel, up)
	o.mu.Lock()
	o.cache.Remove(k)
	delete(o.memory, k)
	o.mu.Unlock()
	switch {
	case o.fleet != nil:
		f := o.fleet
		return f.Do("owners", func(ctx context.Context) error {
			return f.Redis.HDel(ctx, o.hash(kind, channel), up).Err()
		})
	case o.storage != nil:
		if err := o.storage.Delete(ctx, StorageKey(kind, channel, up)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// Lookup returns the owners of the items ups of kind at channel, "" for
// an item with no record. In a fleet the items the cache does not know
// take one round trip, whatever their number. inList says the look-up is
// a list's, which may trust that an item had no record a moment ago.
func (o *Store) Lookup(ctx context.Context, kind resourceid.Kind, channel string, ups []string, inList bool) ([]string, error) {
	out := make([]string, len(ups))
	var missing []int // indexes of the items to read
	now := o.now()
	o.mu.Lock()
	for i, up := range ups {
		k := cacheKey(kind, channel, up)
		if o.memory != nil {
			out[i] = o.memory[k]
			continue
		}
		e, ok := o.cache.Get(k)
		switch {
		case ok && e.group != "":
			out[i] = e.group
		case ok && inList && now.Before(e.until):
		default:
			missing = append(missing, i)
		}
	}
	o.mu.Unlock()
	if len(missing) == 0 {
		return out, nil
	}
	var err error
	if o.fleet != nil {
		err = o.readRedis(kind, channel, ups, missing, out)
	} else {
		err = o.readStorage(ctx, kind, channel, ups, missing, out)
	}
	if err != nil {
		return nil, err
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, i := range missing {
		k := cacheKey(kind, channel, ups[i])
		if out[i] != "" {
			o.cache.Add(k, entry{group: out[i]})
			continue
		}
		if o.fleet != nil {
			continue
		}
		// an item that has no record is remembered so, unless a record
		// was written meanwhile
		if e, ok := o.cache.Peek(k); !ok || e.group == "" {
			o.cache.Add(k, entry{until: now.Add(missFor)})
		}
	}
	return out, nil
}

// readRedis reads the owners of ups[missing] from the channel's hash, in
// one HMGET.
func (o *Store) readRedis(kind resourceid.Kind, channel string, ups []string, missing []int, out []string) error {
	f := o.fleet
	fields := make([]string, len(missing))
	for j, i := range missing {
		fields[j] = ups[i]
	}
	var vals []any
	err := f.Do("owners", func(ctx context.Context) error {
		v, err := f.Redis.HMGet(ctx, o.hash(kind, channel), fields...).Result()
		vals = v
		return err
	})
	if err != nil {
		return err
	}
	for j, i := range missing {
		if j < len(vals) {
			out[i], _ = vals[j].(string)
		}
	}
	return nil
}

// readStorage reads the owners of ups[missing] from Caddy's storage.
func (o *Store) readStorage(ctx context.Context, kind resourceid.Kind, channel string, ups []string, missing []int, out []string) error {
	if o.storage == nil {
		return nil
	}
	for _, i := range missing {
		b, err := o.storage.Load(ctx, StorageKey(kind, channel, ups[i]))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		var rec record
		if err := json.Unmarshal(b, &rec); err != nil {
			return err
		}
		// a record is about its own item: the key is a hash, the record
		// says what it is of
		if rec.Channel == channel && rec.ID == ups[i] {
			out[i] = rec.Group
		}
	}
	return nil
}
