package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ledgerWait bounds how long checkLedger waits for the ledger's last rows:
// its writer writes each second, or as soon as 5,000 rows wait. A variable
// for the test.
var ledgerWait = 10 * time.Second

// checkLedger fails unless the ledger of t, whose process serves its admin
// endpoint at admin, holds a row for each of the sent requests the harness
// sent it: then the rows of t measured a ledger that wrote every request,
// none dropped. It asks GET /relay/usage until the count is reached, for
// at most ledgerWait.
func (b *bench) checkLedger(ctx context.Context, t *target, admin string, sent int64) error {
	if sent == 0 {
		return fmt.Errorf("no request was sent to check its ledger with")
	}
	deadline := time.Now().Add(ledgerWait)
	for {
		rows, err := ledgerRows(ctx, admin)
		if err != nil {
			return fmt.Errorf("the ledger: %w", err)
		}
		if rows == sent {
			b.logf("%s: the ledger holds a row for each of the %d requests sent", t.name, sent)
			return nil
		}
		if rows > sent || time.Now().After(deadline) {
			return fmt.Errorf("the ledger holds %d rows for the %d requests sent (waited %s for its writer)", rows, sent, ledgerWait)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// ledgerRows is the number of requests the ledger of the process whose
// admin endpoint is at admin holds, of any day: the requests of GET
// /relay/usage's one total row.
func ledgerRows(ctx context.Context, admin string) (int64, error) {
	body, err := fetch(ctx, admin, "/relay/usage?from=2000-01-01&to=2099-12-31")
	if err != nil {
		return 0, err
	}
	var usage struct {
		Rows []struct {
			Requests int64 `json:"requests"`
		} `json:"rows"`
	}
	if err := json.Unmarshal(body, &usage); err != nil {
		return 0, fmt.Errorf("GET /relay/usage: %w: %q", err, body)
	}
	if len(usage.Rows) != 1 {
		return 0, fmt.Errorf("GET /relay/usage without group_by answered %d rows, not one: %q", len(usage.Rows), body)
	}
	return usage.Rows[0].Requests, nil
}

// ledgerWriterCPU is the CPU time the ledger's writer of the process whose
// admin endpoint is at admin spent a row, over the process's life: its
// relay_ledger_writer_cpu_seconds_total (the writer's own thread) over its
// relay_ledger_rows_total.
func ledgerWriterCPU(ctx context.Context, admin string) (time.Duration, error) {
	body, err := fetch(ctx, admin, "/metrics")
	if err != nil {
		return 0, err
	}
	cpu, okCPU := counterValue(body, "relay_ledger_writer_cpu_seconds_total")
	rows, okRows := counterValue(body, "relay_ledger_rows_total")
	switch {
	case !okCPU || !okRows:
		return 0, fmt.Errorf("the ledger's metrics are not in /metrics")
	case rows <= 0 || cpu <= 0:
		return 0, fmt.Errorf("the ledger wrote %v rows in %v s of its writer's CPU", rows, cpu)
	}
	return time.Duration(cpu / rows * float64(time.Second)), nil
}

// counterValue is the value of the metric name, without labels, in a
// Prometheus text exposition.
func counterValue(exposition []byte, name string) (float64, bool) {
	for line := range strings.Lines(string(exposition)) {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f, err == nil
		}
	}
	return 0, false
}
