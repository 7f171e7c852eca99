package owners

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
)

// fakeClock is a clock the test moves.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// fleetClient is a client of the fleet on the Redis at addr under
// prefix, closed when the test ends.
func fleetClient(tb testing.TB, addr, prefix string) *fleet.Client {
	tb.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	tb.Cleanup(cancel)
	c, err := fleet.New(ctx, &fleet.Config{Address: []string{addr}, Prefix: prefix})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Stop(); _ = c.Close() })
	return c
}

func TestOwnerCacheNeverHidesARecordedItem(t *testing.T) {
	clock := &fakeClock{t: time.Date(2025, time.March, 14, 15, 9, 26, 0, time.UTC)}
	storage := &certmagic.FileStorage{Path: t.TempDir()}
	o := New(nil, storage, clock.now)
	ctx := context.Background()
	lookup := func(inList bool, ups ...string) []string {
		t.Helper()
		got, err := o.Lookup(ctx, resourceid.File, "c", ups, inList)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	// a list finds no record and remembers that for a while...
	if got := lookup(true, "file_1", "file_2"); !slices.Equal(got, []string{"", ""}) {
		t.Fatalf("before any record: %q", got)
	}
	// ...which a record written here replaces at once
	if err := o.Record(ctx, resourceid.File, "c", "file_1", "g"); err != nil {
		t.Fatal(err)
	}
	if got := lookup(true, "file_1"); !slices.Equal(got, []string{"g"}) {
		t.Errorf("after the record: %q", got)
	}
	// a record written by another relay of the same storage: a get reads
	// it at once, a list within a minute
	other := New(nil, storage, clock.now)
	if err := other.Record(ctx, resourceid.File, "c", "file_2", "h"); err != nil {
		t.Fatal(err)
	}
	if got := lookup(false, "file_2"); !slices.Equal(got, []string{"h"}) {
		t.Errorf("a get of another relay's record: %q", got)
	}
	o2 := New(nil, storage, clock.now)
	lookup2 := func(ups ...string) []string {
		got, _ := o2.Lookup(ctx, resourceid.File, "c", ups, true)
		return got
	}
	_ = lookup2("file_3")
	if err := other.Record(ctx, resourceid.File, "c", "file_3", "h"); err != nil {
		t.Fatal(err)
	}
	clock.advance(missFor + time.Second)
	if got := lookup2("file_3"); !slices.Equal(got, []string{"h"}) {
		t.Errorf("a list, a minute after another relay's record: %q", got)
	}
	// forgotten: gone from the storage and the cache
	if err := o.Forget(ctx, resourceid.File, "c", "file_1"); err != nil {
		t.Fatal(err)
	}
	if got := lookup(false, "file_1"); !slices.Equal(got, []string{""}) {
		t.Errorf("after forget: %q", got)
	}
	if storage.Exists(ctx, StorageKey(resourceid.File, "c", "file_1")) {
		t.Error("the record outlived forget in the storage")
	}
	// a record is about its own item
	b, _ := storage.Load(ctx, StorageKey(resourceid.File, "c", "file_2"))
	var rec record
	if err := json.Unmarshal(b, &rec); err != nil || rec.Group != "h" || rec.Channel != "c" || rec.ID != "file_2" {
		t.Errorf("the stored record: %s", b)
	}
}

// BenchmarkOwnerLookupPage is what a list pays for the owners of one
// upstream page of 1,000 items, half of them recorded: in Caddy's file
// storage read cold (a relay that just started) and warm (from the cache),
// and in a fleet's Redis (one HMGET).
func BenchmarkOwnerLookupPage(b *testing.B) {
	ctx := context.Background()
	ups := make([]string, 1000)
	for i := range ups {
		ups[i] = fmt.Sprintf("file_%04d", i)
	}
	seed := func(b *testing.B, o *Store) {
		for i, up := range ups {
			if i%2 == 0 {
				if err := o.Record(ctx, resourceid.File, "c", up, "g"); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	lookup := func(b *testing.B, o *Store) {
		got, err := o.Lookup(ctx, resourceid.File, "c", ups, true)
		if err != nil || got[0] != "g" || got[1] != "" {
			b.Fatal(got[:2], err)
		}
	}
	storage := &certmagic.FileStorage{Path: b.TempDir()}
	seed(b, New(nil, storage, time.Now))
	b.Run("storage-cold", func(b *testing.B) {
		for b.Loop() {
			lookup(b, New(nil, storage, time.Now))
		}
	})
	b.Run("storage-warm", func(b *testing.B) {
		o := New(nil, storage, time.Now)
		lookup(b, o)
		for b.Loop() {
			lookup(b, o)
		}
	})
	b.Run("redis", func(b *testing.B) {
		srv := redistest.Start(b)
		f := fleetClient(b, srv.Addr, "bench:")
		seed(b, New(f, nil, time.Now))
		for b.Loop() {
			lookup(b, New(f, nil, time.Now)) // nothing cached: every item asked
		}
	})
}

// TestAFleetKeepsOwnersInOneHashPerChannel: in a fleet, the owners of a
// channel's items of one kind are one hash, where another node reads them
// and an operator may write one.
func TestAFleetKeepsOwnersInOneHashPerChannel(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	a, b := New(fleetClient(t, srv.Addr, "own:"), nil, time.Now), New(fleetClient(t, srv.Addr, "own:"), nil, time.Now)
	if err := a.Record(ctx, resourceid.Batch, "ch", "msgbatch_1", "g"); err != nil {
		t.Fatal(err)
	}
	if got, err := srv.Command("HGET", "own:{c:ch}:owners:batches", "msgbatch_1"); err != nil || got != "g" {
		t.Fatalf("the record in Redis: %q %v", got, err)
	}
	if _, err := srv.Command("HSET", "own:{c:ch}:owners:batches", "msgbatch_2", "h"); err != nil {
		t.Fatal(err)
	}
	if got, err := b.Lookup(ctx, resourceid.Batch, "ch", []string{"msgbatch_1", "msgbatch_2", "msgbatch_3"}, true); err != nil || !slices.Equal(got, []string{"g", "h", ""}) {
		t.Errorf("another node's look-up: %q %v", got, err)
	}
	if err := b.Forget(ctx, resourceid.Batch, "ch", "msgbatch_1"); err != nil {
		t.Fatal(err)
	}
	// forgotten: gone from Redis and from the cache of the node that forgot it
	if got, _ := b.Lookup(ctx, resourceid.Batch, "ch", []string{"msgbatch_1"}, false); !slices.Equal(got, []string{""}) {
		t.Errorf("after forget: %q", got)
	}
	if got := (&Store{fleet: fleetClient(t, srv.Addr, "own:")}).hash(resourceid.File, "a{b}"); got != "own:{c:"+fleet.Digest("a{b}")+"}:owners:files" {
		t.Errorf("the hash of a channel whose name holds braces: %q", got)
	}
}
