package money

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// discardLogger logs nothing.
func discardLogger() *zap.Logger { return zap.NewNop() }

// testFleet connects to the Redis at addr as one node of a fleet whose
// keys start with prefix, keeping limits and money as a relay does; each
// call is another node. It leaves as a relay does at the test's end
// (leave).
func testFleet(t testing.TB, addr, prefix string, lease time.Duration) *Shared {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	c, err := fleet.New(ctx, &fleet.Config{Address: []string{addr}, Prefix: prefix, Lease: caddy.Duration(lease), Timeout: caddy.Duration(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	c.Go(c.Heartbeat)
	f := New(c, limits.New(c))
	t.Cleanup(func() { leave(f) })
	return f
}

// leave is what the end of a fleet does: the workers stop, the spend is
// added, what the limits hold goes back, the client closes.
func leave(f *Shared) {
	f.Stop()
	f.Flush()
	f.limits.Flush()
	_ = f.Close()
}

// waitFor polls cond until it holds or the bound passes.
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
