package main

import (
	"context"
	"testing"
)

// TestHarnessSmoke runs every target and workload of the harness briefly,
// so that it cannot rot: each row must have numbers and no failed request.
func TestHarnessSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/caddy and runs it under load")
	}
	o := smokeRun()
	o.logf = t.Logf
	rep, err := run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	// every target under every load workload, (b) and (c) with idle streams
	if want := (len(o.concurrency)+1)*len(targets) + 2; len(rep.rows) != want {
		t.Errorf("%d rows, want %d", len(rep.rows), want)
	}
	for _, x := range rep.rows {
		if x.success != 1 {
			t.Errorf("%s, %s: success %.4f, errors %q", x.target.name, x.workload, x.success, x.errors)
		}
		if !positive(x) {
			t.Errorf("%s, %s: a number is not positive: %+v", x.target.name, x.workload, x)
		}
	}
	t.Logf("\n%s", rep.markdown())
}

// positive reports whether every number the row's workload measures is
// above zero.
func positive(x row) bool {
	switch x.workload.kind {
	case idle:
		return x.kibPerStream > 0
	case streaming:
		if x.firstByte <= 0 {
			return false
		}
	}
	return x.reqPerSec > 0 && x.p50 > 0 && x.p99 > 0
}
