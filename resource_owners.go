package relay

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/certmagic"
	"github.com/hashicorp/golang-lru/v2/simplelru"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

// Every batch and file made through the relay has an owner: the group of
// the key that made it. The relay records it once the upstream has made
// the item and before the client learns its id, and checks it on every
// later call and on every list: a group sees and touches only its own
// items. An id's MAC says which group the id was sealed for; the record
// says which group made the item. Only both together let a call through,
// so an id sealed for the wrong group (as merged lists did before the
// relay kept owners) still names nothing, and an upstream item with no
// record (made outside the relay, or before it kept owners) is no group's.
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

// ownerStore keeps the owners of batches and files.
type ownerStore struct {
	fleet   *member           // set in fleet mode
	storage certmagic.Storage // Caddy's storage; nil in a unit test's context
	now     func() time.Time

	mu     sync.Mutex
	cache  *simplelru.LRU[string, ownerEntry]
	memory map[string]string // the records, with neither fleet nor storage
}

// ownerEntry is what the cache knows of one item.
type ownerEntry struct {
	group string    // the owner; "" for an item that had no record
	until time.Time // for "": until when that is trusted in a list
}

// Bounds of the owners' cache.
const (
	// ownerCacheSize bounds the items whose owner is kept in memory
	// (about 150 bytes each).
	ownerCacheSize = 50_000
	// ownerMissFor is how long a list trusts that an item has no record,
	// in Caddy's storage.
	ownerMissFor = time.Minute
)

func newOwnerStore(f *member, storage certmagic.Storage, now func() time.Time) *ownerStore {
	cache, err := simplelru.NewLRU[string, ownerEntry](ownerCacheSize, nil)
	if err != nil {
		panic(err) // the size is a positive constant
	}
	o := &ownerStore{fleet: f, storage: storage, now: now, cache: cache}
	if f == nil && storage == nil {
		o.memory = map[string]string{}
	}
	return o
}

// ownerCacheKey names an item in the cache.
func ownerCacheKey(kind resourceKind, channel, up string) string {
	return string(rune('0'+kind)) + channel + "\x00" + up
}

// ownerStorageKey is where, in Caddy's storage, the owner of an item is
// recorded. The channel and the upstream's id are hashed: either may hold
// characters a path must not.
func ownerStorageKey(kind resourceKind, channel, up string) string {
	sum := sha256.Sum256([]byte(channel + "\x00" + up))
	return "relay/owners/" + kind.String() + "/" + hex.EncodeToString(sum[:16])
}

// ownerHash is the Redis hash of a channel's owners of one kind.
func (f *member) ownerHash(kind resourceKind, channel string) string {
	return f.Key(fleet.Tag("c:", channel), "owners:"+kind.String())
}

// ownerRecord is a record in Caddy's storage. The channel and the
// upstream's id are kept beside the owner so that an operator can read
// what a record is about.
type ownerRecord struct {
	Group   string    `json:"group"`
	Channel string    `json:"channel"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
}

// record notes that group owns the item up of kind at channel.
func (o *ownerStore) record(ctx context.Context, kind resourceKind, channel, up, group string) error {
	switch {
	case o.fleet != nil:
		f := o.fleet
		if err := f.Do("owners", func(ctx context.Context) error {
			return f.Redis.HSet(ctx, f.ownerHash(kind, channel), up, group).Err()
		}); err != nil {
			return err
		}
	case o.storage != nil:
		b, _ := json.Marshal(ownerRecord{Group: group, Channel: channel, ID: up, Created: o.now().UTC()})
		if err := o.storage.Store(ctx, ownerStorageKey(kind, channel, up), b); err != nil {
			return err
		}
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.memory != nil {
		o.memory[ownerCacheKey(kind, channel, up)] = group
	}
	o.cache.Add(ownerCacheKey(kind, channel, up), ownerEntry{group: group})
	return nil
}

// forget removes the record of the item up of kind at channel, which the
// upstream no longer has.
func (o *ownerStore) forget(ctx context.Context, kind resourceKind, channel, up string) error {
	k := ownerCacheKey(kind, channel, up)
	o.mu.Lock()
	o.cache.Remove(k)
	delete(o.memory, k)
	o.mu.Unlock()
	switch {
	case o.fleet != nil:
		f := o.fleet
		return f.Do("owners", func(ctx context.Context) error {
			return f.Redis.HDel(ctx, f.ownerHash(kind, channel), up).Err()
		})
	case o.storage != nil:
		if err := o.storage.Delete(ctx, ownerStorageKey(kind, channel, up)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// lookup returns the owners of the items ups of kind at channel, "" for
// an item with no record. In a fleet the items the cache does not know
// take one round trip, whatever their number. inList says the look-up is
// a list's, which may trust that an item had no record a moment ago.
func (o *ownerStore) lookup(ctx context.Context, kind resourceKind, channel string, ups []string, inList bool) ([]string, error) {
	out := make([]string, len(ups))
	var missing []int // indexes of the items to read
	now := o.now()
	o.mu.Lock()
	for i, up := range ups {
		k := ownerCacheKey(kind, channel, up)
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
		k := ownerCacheKey(kind, channel, ups[i])
		if out[i] != "" {
			o.cache.Add(k, ownerEntry{group: out[i]})
			continue
		}
		if o.fleet != nil {
			continue
		}
		// an item that has no record is remembered so, unless a record
		// was written meanwhile
		if e, ok := o.cache.Peek(k); !ok || e.group == "" {
			o.cache.Add(k, ownerEntry{until: now.Add(ownerMissFor)})
		}
	}
	return out, nil
}

// readRedis reads the owners of ups[missing] from the channel's hash, in
// one HMGET.
func (o *ownerStore) readRedis(kind resourceKind, channel string, ups []string, missing []int, out []string) error {
	f := o.fleet
	fields := make([]string, len(missing))
	for j, i := range missing {
		fields[j] = ups[i]
	}
	var vals []any
	err := f.Do("owners", func(ctx context.Context) error {
		v, err := f.Redis.HMGet(ctx, f.ownerHash(kind, channel), fields...).Result()
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
func (o *ownerStore) readStorage(ctx context.Context, kind resourceKind, channel string, ups []string, missing []int, out []string) error {
	if o.storage == nil {
		return nil
	}
	for _, i := range missing {
		b, err := o.storage.Load(ctx, ownerStorageKey(kind, channel, ups[i]))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		var rec ownerRecord
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

// errOwnersUnavailable answers a call on batches or files when the
// relay's storage could not say, or could not record, who owns an item:
// the relay serves no item without knowing whose it is.
func errOwnersUnavailable(msg string) *relayError {
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "storage_unavailable",
		msg: msg, retryAfter: time.Second, cause: causeRelay}
}

// recordOwner records the group as the owner of the item the upstream has
// just made (obj, its answer), before the client learns its id.
//
// When the record cannot be written, the item would be no one's: no list
// would show it and no call could reach it. So the relay takes it back at
// the upstream (deletes a file; cancels a batch, which can be deleted only
// once it has ended), logs that, and answers 503 storage_unavailable, which
// the SDKs retry. Only when taking it back fails too is an item left that
// no group sees; the relay then logs an error with the channel and the
// upstream's id, for an operator to remove it.
func (c *resourceCtx) recordOwner(ch *channel, rp provider.ResourceProvider, obj []byte) *relayError {
	id := gjson.GetBytes(obj, "id")
	if id.Type != gjson.String || id.Str == "" {
		return nil // nothing a client could call it by: passed on as it is
	}
	ctx := context.WithoutCancel(c.req.Context()) // the client may be gone; the record is the relay's
	err := c.r.owners.record(ctx, c.rq.kind, ch.name, id.Str, c.group.name)
	if err == nil {
		return nil
	}
	noun, undone := c.rq.kind.noun(), "deleted"
	if c.rq.kind == kindBatch {
		undone = "cancelled"
	}
	fields := []zap.Field{zap.String("channel", ch.name), zap.String("group", c.group.name), zap.String("upstream_id", id.Str),
		zap.String("request_id", c.in.id), zap.NamedError("record_error", err)}
	if undoErr := c.undoCreate(ctx, ch, rp, id.Str); undoErr != nil {
		c.r.logger.Error("the owner of a new "+noun+" could not be recorded, and it could not be "+undone+
			" at the upstream either: no group sees it through the relay; remove it at the upstream", append(fields, zap.NamedError("undo_error", undoErr))...)
		return errOwnersUnavailable("the relay could not record that the new " + noun + " is your group's; retry later")
	}
	c.r.logger.Warn("the owner of a new "+noun+" could not be recorded; it was "+undone+" at the upstream", fields...)
	return errOwnersUnavailable("the relay could not record that the new " + noun + " is your group's, so it " + undone + " it at the upstream; retry later")
}

// undoCreate takes back the item up the channel has just made: a file is
// deleted, a batch cancelled.
func (c *resourceCtx) undoCreate(ctx context.Context, ch *channel, rp provider.ResourceProvider, up string) error {
	h := c.req.Header.Clone()
	h.Del("Content-Type") // the create's, not this call's
	call := &provider.ResourceCall{Channel: ch.name, Method: http.MethodDelete, Path: pathFiles + "/" + url.PathEscape(up), Header: h, ContentLength: -1}
	if c.rq.kind == kindBatch {
		call.Method, call.Path = http.MethodPost, pathBatches+"/"+url.PathEscape(up)+"/cancel"
	}
	ctx, cancel := context.WithTimeout(ctx, ch.response)
	defer cancel()
	req, err := rp.NewResourceRequest(ctx, call)
	if err != nil {
		return err
	}
	resp, err := ch.rt.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("the upstream answered %d", resp.StatusCode)
	}
	return nil
}
