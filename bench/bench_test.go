package main

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestHarnessSmoke runs every target and workload of the harness briefly,
// so that it cannot rot: each target must have a row under every workload
// it applies to, with numbers and no failed request, and the report its
// CPU targets and the comparison with a baseline build (here the
// checkout's own binary, not built again). The ledger's target (i) must
// start and serve, and its ledger hold a row for every request the run
// sent it (run fails otherwise). Without redis-server
// the targets that need it are left out, and a subtest says so as a skip;
// under CI=true, that fails instead.
func TestHarnessSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/caddy and runs it under load")
	}
	o := smokeRun()
	o.logf = t.Logf
	o.baseline, o.baselineFromCheckout = "HEAD", true
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server is not installed (CI must have it): %s", installRedis)
		}
		t.Run("targets needing Redis", func(t *testing.T) {
			t.Skipf("redis-server is not installed, so %s is not measured; to measure it: %s", targetNames(needRedis(o.targets)), installRedis)
		})
		o.targets = withoutRedis(o.targets)
	}
	rep, err := run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if baselineOf(rep.targets) == nil {
		t.Errorf("the run has no baseline target")
	}
	want := 0
	for _, w := range rep.workloads() {
		for _, tg := range rep.targets {
			if !tg.runs(w) {
				continue
			}
			want++
			if _, ok := rep.find(tg, w); !ok {
				t.Errorf("%s, %s: no row", tg.name, w)
			}
		}
	}
	if len(rep.rows) != want {
		t.Errorf("%d rows, want %d", len(rep.rows), want)
	}
	for _, x := range rep.rows {
		if x.success != 1 || len(x.errors) > 0 {
			t.Errorf("%s, %s: success %.4f, errors %q", x.target.name, x.workload, x.success, x.errors)
		}
		if !positive(x) {
			t.Errorf("%s, %s: a number is not positive: %+v", x.target.name, x.workload, x)
		}
	}
	table := rep.markdown()
	t.Logf("\n%s", table)
	for _, want := range []string{"| CPU/req |", "| CPU/req vs reverse_proxy |", "(h) relay, budgets, identity and dedup headers", "(c0) relay, 1 channel, HEAD",
		"| (i) relay, 1 channel, ledger |", "\n- ledger: the writer's CPU a row <= 2% of (i)'s CPU per request: ", "\n- (c) vs (c0): CPU/req "} {
		if !strings.Contains(table, want) {
			t.Errorf("the report has no %q", want)
		}
	}
	for _, line := range strings.Split(table, "\n") {
		if strings.Contains(line, "not measured") && !strings.HasPrefix(line, "- fleet:") {
			t.Errorf("a target was not measured: %s", line)
		}
	}
}

// TestLedgerTargetIsCWithALedger: (i) is (c)'s config and one line more,
// the ledger's, so that the two differ by the ledger alone.
func TestLedgerTargetIsCWithALedger(t *testing.T) {
	const line = "\t\tledger sqlite $LEDGER\n"
	if !strings.Contains(relayLedger.caddyfile, line) || strings.Replace(relayLedger.caddyfile, line, "", 1) != relayOne.caddyfile {
		t.Errorf("(i)'s config is not (c)'s with %q:\n%s", line, relayLedger.caddyfile)
	}
	if !relayLedger.runs(fullRun().cpuWorkload()) || relayLedger.runs(workload{kind: nonStreaming, concurrency: 10}) || relayLedger.runs(workload{kind: streaming, concurrency: 10}) {
		t.Errorf("(i) must be measured in the CPU comparison alone")
	}
}

// positive reports whether every number the row's workload measures is
// above zero. CPU per request is measured in clock ticks of 10ms: the
// smoke's fixed-rate rounds (a few dozen requests) may use less than one,
// so it must be positive in the closed-loop rows of a caddy process only.
func positive(x row) bool {
	switch x.workload.kind {
	case idle:
		return x.kibPerStream > 0
	case streaming:
		if x.firstByte <= 0 {
			return false
		}
	}
	if x.workload.kind != fixedRate && x.target != direct && x.cpuPerReq <= 0 {
		return false
	}
	return x.reqPerSec > 0 && x.p50 > 0 && x.p99 > 0
}

// TestReloadSmoke runs the reload-under-load mode for a few seconds, with
// its chaos channel: every request, streams spanning reloads and requests
// failed over included, must succeed, every reload must load, and the
// relay must keep its upstream connections and its goroutine count.
func TestReloadSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/caddy and runs it under load")
	}
	o := reloadOptions{duration: 4 * time.Second, rate: 40, streamLength: 1500 * time.Millisecond, chaos: true, logf: t.Logf}
	res, err := runReload(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Log(reloadReport(o, res))
	if err := res.ok(); err != nil {
		t.Fatal(err)
	}
	if res.reloads < 3 || res.streams == 0 {
		t.Fatalf("%d reloads and %d streams: the smoke did not exercise reloads under load", res.reloads, res.streams)
	}
}

// TestBigConfigSmoke runs the big-config mode on a small config: caddy
// must load it from JSON, reload it through the admin endpoint and report
// its memory.
func TestBigConfigSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/caddy and runs it")
	}
	for _, inFile := range []bool{false, true} {
		res, err := runBigConfig(context.Background(), bigConfigOptions{channels: 10, keys: 100, keysFile: inFile, reloads: 1, logf: t.Logf})
		if err != nil {
			t.Fatal(err)
		}
		t.Log(res)
		if res.firstLoad <= 0 || res.reload <= 0 || res.rssKiB <= 0 || res.heapKiB <= 0 {
			t.Errorf("a figure is not positive: %+v", res)
		}
		if (res.keysFileBytes > 0) != inFile {
			t.Errorf("keys in a file: %v, but the keys file has %d bytes", inFile, res.keysFileBytes)
		}
	}
}
