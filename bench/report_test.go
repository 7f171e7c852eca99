package main

import (
	"strings"
	"testing"
	"time"
)

// TestCPUOnlyReport renders the report of a -cpu-only run with a baseline
// from made-up rows: the CPU columns and ratios, the CPU targets met and
// missed at their bounds, and the (c) vs (c0) line; none of the targets of
// the workloads the run left out.
func TestCPUOnlyReport(t *testing.T) {
	o := fullRun()
	o.cpuOnly, o.baseline = true, "2f0c701"
	c0 := baselineTarget(o.baseline)
	o.targets = []*target{reverseProxy, relayOne, c0, relayFeatures, relayLedger}
	w := o.cpuWorkload()
	rep := &report{options: o, machine: "test machine", rows: []row{
		{target: reverseProxy, workload: w, reqPerSec: 4000, success: 1, p50: 10 * time.Millisecond, p99: 30 * time.Millisecond, cpuPerReq: 200 * time.Microsecond},
		{target: relayOne, workload: w, reqPerSec: 4400, success: 1, p50: 9 * time.Millisecond, p99: 27 * time.Millisecond, cpuPerReq: 170 * time.Microsecond},
		{target: c0, workload: w, reqPerSec: 4000, success: 1, p50: 10 * time.Millisecond, p99: 30 * time.Millisecond, cpuPerReq: 200 * time.Microsecond},
		{target: relayFeatures, workload: w, reqPerSec: 3900, success: 1, p50: 11 * time.Millisecond, p99: 33 * time.Millisecond, cpuPerReq: 182 * time.Microsecond},
		{target: relayLedger, workload: w, reqPerSec: 4300, success: 1, p50: 9 * time.Millisecond, p99: 28 * time.Millisecond, cpuPerReq: 173 * time.Microsecond, ledgerPerRow: 3450 * time.Nanosecond},
	}}
	got := rep.markdown()
	for _, want := range []string{
		"the medians of 8 rounds of 3s (targets taking turns), closed loop (vegeta), 10 KB request bodies; CPU/req: ",
		"\nTargets, against (b) unless named:\n",
		"| non-streaming c=50 | (b) reverse_proxy | 4000 | 100% | 10.00 ms | 30.00 ms |  | 200 µs |  |  |  |  |  |\n",
		"| non-streaming c=50 | (c) relay, 1 channel | 4400 | 100% | 9.00 ms | 27.00 ms |  | 170 µs |  | 1.10x | 0.90x | 0.90x | 0.85x |\n",
		"| non-streaming c=50 | (c0) relay, 1 channel, 2f0c701 | 4000 | 100% | 10.00 ms | 30.00 ms |  | 200 µs |  | 1.00x | 1.00x | 1.00x | 1.00x |\n",
		"| non-streaming c=50 | (h) relay, budgets, identity and dedup headers | 3900 | 100% | 11.00 ms | 33.00 ms |  | 182 µs |  | 0.97x | 1.10x | 1.10x | 0.91x |\n",
		"- CPU comparison: CPU per request <= 0.85x reverse_proxy: 0.85x at (c) relay, 1 channel, non-streaming c=50: met\n",
		"- CPU comparison: throughput >= 1.10x reverse_proxy: 1.10x at (c) relay, 1 channel, non-streaming c=50: met\n",
		"- CPU comparison: CPU per request with budgets, identity and dedup headers <= 0.90x reverse_proxy: 0.91x at (h) relay, budgets, identity and dedup headers, non-streaming c=50: **MISSED**\n",
		"- ledger: the writer's CPU a row <= 2% of (i)'s CPU per request: 2.0% (3.45 µs a row of 173 µs a request; (i)/(c) CPU per request 1.02x, reported) at (i) relay, 1 channel, ledger, non-streaming c=50: met\n",
		"- (c) vs (c0): CPU/req 0.85x, throughput 1.10x (non-streaming c=50; (c0) is 2f0c701; reported, not a target)\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the report has no %q; it is:\n%s", want, got)
		}
	}
	if n := strings.Count(got, "\n- "); n != 5 {
		t.Errorf("%d lines of targets, want the 4 CPU targets and the baseline line:\n%s", n, got)
	}
	// a writer that spends 2.1% of (i)'s CPU per request a row misses its
	// target
	rep.rows[4].ledgerPerRow = 3600 * time.Nanosecond
	if want := "- ledger: the writer's CPU a row <= 2% of (i)'s CPU per request: 2.1% (3.60 µs a row of 173 µs a request; (i)/(c) CPU per request 1.02x, reported) at (i) relay, 1 channel, ledger, non-streaming c=50: **MISSED**\n"; !strings.Contains(rep.markdown(), want) {
		t.Errorf("the report has no %q; it is:\n%s", want, rep.markdown())
	}
}

// TestFleetGoals checks (g) against (f): the p50 it adds at the fixed rate
// and the closed-loop throughput it keeps at its worst concurrency, each
// met at its bound and missed past it.
func TestFleetGoals(t *testing.T) {
	rep := &report{options: fullRun(), machine: "test machine"}
	fixed := workload{kind: fixedRate, rate: 2000}
	mk := func(tg *target, w workload, reqs float64, p50 time.Duration) row {
		return row{target: tg, workload: w, reqPerSec: reqs, success: 1, p50: p50, p99: 2 * p50, cpuPerReq: 100 * time.Microsecond}
	}
	rep.rows = []row{
		mk(relayKeyLimits, fixed, 2000, 500*time.Microsecond),
		mk(relayRedis, fixed, 2000, 800*time.Microsecond),
	}
	for _, c := range []int{1, 10, 100} {
		w := workload{kind: nonStreaming, concurrency: c}
		rep.rows = append(rep.rows, mk(relayKeyLimits, w, 1000, time.Millisecond), mk(relayRedis, w, 950, time.Millisecond))
	}
	rep.rows[5].reqPerSec = 900 // (g) at c=10 keeps 0.90x: the worst, at the bound
	got := rep.fleetGoals()
	want := []string{
		"fleet: added p50 at 2000 req/s, (g) minus (f) <= 0.3 ms: +0.30 ms at (g) relay, key limits in Redis, non-streaming 2000 req/s: met",
		"fleet: closed-loop throughput (g)/(f) >= 0.90x: 0.90x at (g) relay, key limits in Redis, non-streaming c=10 (the worst concurrency): met",
	}
	for i := range want {
		if i >= len(got) || got[i] != want[i] {
			t.Fatalf("fleet goals:\n%q\nwant\n%q", got, want)
		}
	}
	rep.rows[5].reqPerSec = 890
	if got := rep.fleetGoals()[1]; !strings.HasSuffix(got, "0.89x at (g) relay, key limits in Redis, non-streaming c=10 (the worst concurrency): **MISSED**") {
		t.Errorf("at 0.89x: %q, want it missed", got)
	}
}
