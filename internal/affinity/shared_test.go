package affinity

import (
	"context"
	"encoding/hex"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// sharedClient is one node's records of the fleet on the Redis at addr
// under prefix, stopped when the test ends.
func sharedClient(t *testing.T, addr, prefix string) *Shared {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	c, err := fleet.New(ctx, &fleet.Config{Address: []string{addr}, Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	s := NewShared(c)
	t.Cleanup(func() { c.Stop(); _ = c.Close() })
	return s
}

// waitFor waits for cond, at most bound.
func waitFor(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestAnotherNodeFindsTheRecordsInRedis(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	one, two := sharedClient(t, srv.Addr, "aff:"), sharedClient(t, srv.Addr, "aff:")
	now := time.Now()
	p := twoKeys()

	NewTable(16).Record(p, "chan-a", now, one)
	key := "aff:{a:g}:" + hex.EncodeToString(p.Keys[1][:])
	var v string
	waitFor(t, "the record in Redis", 2*time.Second, func() bool {
		v, _ = rdb.Get(context.Background(), key).Result()
		return v != ""
	})
	ms, ch, _ := strings.Cut(v, " ")
	if until, err := strconv.ParseInt(ms, 10, 64); err != nil || ch != "chan-a" || until != now.Add(CacheTTL1h).UnixMilli() {
		t.Fatalf("%s = %q, want <until in ms> chan-a", key, v)
	}
	if ttl := rdb.TTL(context.Background(), key).Val(); ttl <= 59*time.Minute || ttl > CacheTTL1h {
		t.Fatalf("%s expires in %v, want the hour of its cache", key, ttl)
	}

	// the other node's table has no record: it asks Redis, and keeps the answer
	tbl := NewTable(16)
	if ch := tbl.Warm(p, now, two); ch != "chan-a" {
		t.Fatalf("the other node finds %q, want chan-a", ch)
	}
	if ch := tbl.Warm(p, now, nil); ch != "chan-a" {
		t.Fatalf("its table keeps %q, want chan-a", ch)
	}
	// a record past its time is not warm
	if ch := NewTable(16).Warm(p, now.Add(CacheTTL1h), two); ch != "" {
		t.Fatalf("a record past its cache is warm on %q", ch)
	}
}

func TestAnUnreachableRedisFindsNothing(t *testing.T) {
	srv := redistest.Start(t)
	s := sharedClient(t, srv.Addr, "aff:")
	srv.Kill()
	p := twoKeys()
	tbl := NewTable(16)
	tbl.Record(p, "chan-a", testNow, s) // queued, then dropped by the writer: no panic, no wait
	if ch := NewTable(16).Warm(p, testNow, s); ch != "" {
		t.Fatalf("found %q without Redis", ch)
	}
	if ch := tbl.Warm(p, testNow, s); ch != "chan-a" {
		t.Fatalf("the node's own record: %q, want chan-a", ch)
	}
}
