package limits

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// newShared connects to the Redis of cfg as one node of a fleet that
// keeps limits; its workers stop and what it holds goes back at the
// test's end.
func newShared(t testing.TB, cfg *fleet.Config) *Shared {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	c, err := fleet.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.Go(c.Heartbeat)
	f := New(c)
	t.Cleanup(func() {
		c.Stop()
		f.Flush()
		_ = c.Close()
	})
	return f
}

// testFleet connects to the Redis at addr as one node of a fleet whose
// keys start with prefix; each call is another node (its own client,
// leases and background work).
func testFleet(t testing.TB, addr, prefix string, lease time.Duration) *Shared {
	t.Helper()
	return newShared(t, &fleet.Config{Address: []string{addr}, Prefix: prefix, Lease: caddy.Duration(lease), Timeout: caddy.Duration(time.Second)})
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

// admitOps is the number of admissions sent to Redis so far, as
// relay_storage_seconds{op="admit"} counts them.
func admitOps(t testing.TB) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(fleet.Collectors()...)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "relay_storage_seconds" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "op" && l.GetValue() == "admit" {
					return math.Max(0, float64(m.GetHistogram().GetSampleCount()))
				}
			}
		}
	}
	return 0
}

// stop is what the end of the fleet does to its limits: the workers stop,
// what the node holds goes back, the client closes.
func stop(f *Shared) error {
	f.Stop()
	f.Flush()
	return f.Close()
}
