package signatures

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// sharedTable is one node's table, shared with the fleet on the Redis at
// addr under prefix, and its Shared, stopped when the test ends.
func sharedTable(t *testing.T, addr, prefix, node string) (*Table, *Shared) {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	c, err := fleet.New(ctx, &fleet.Config{Address: []string{addr}, Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	c.Node = node
	tbl := NewTable(16)
	s := NewShared(c, tbl)
	t.Cleanup(func() { c.Stop(); _ = c.Close() })
	return tbl, s
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

func TestWhatOneNodeLearnsTheOthersLearn(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	one, sOne := sharedTable(t, srv.Addr, "sig:", "node-one")
	two, _ := sharedTable(t, srv.Addr, "sig:", "node-two")
	waitFor(t, "both nodes subscribe", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(ctx, "sig:signatures").Result()
		return n["sig:signatures"] == 2
	})
	sub := rdb.Subscribe(ctx, "sig:signatures")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}

	d := Digest([]byte(`"sig-learned-on-one"`))
	one.Learn(d, "org-one", sOne)
	waitFor(t, "the other node learns it", 2*time.Second, func() bool { return two.DomainOf(d) == "org-one" })
	m, err := sub.ReceiveMessage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := "node-one\n" + strconv.FormatUint(d, 16) + " org-one"; m.Payload != want {
		t.Errorf("published %q, want %q", m.Payload, want)
	}
	if strings.Contains(m.Payload, "sig-learned-on-one") {
		t.Error("the message holds the signature")
	}

	// without a fleet, nothing travels
	alone := Digest([]byte(`"sig-alone"`))
	one.Learn(alone, "org-one", nil)
	time.Sleep(50 * time.Millisecond)
	if got := two.DomainOf(alone); got != "" {
		t.Errorf("a signature learned without the fleet reached the other node: %q", got)
	}
}
