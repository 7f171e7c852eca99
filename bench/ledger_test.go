package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestCheckLedger holds checkLedger to its word against an admin endpoint
// that answers GET /relay/usage as the relay does: it passes once the
// ledger's rows reach the requests sent, and fails when they stay short,
// when there are more, and when the endpoint answers no usage.
func TestCheckLedger(t *testing.T) {
	defer func(was time.Duration) { ledgerWait = was }(ledgerWait)
	ledgerWait = 500 * time.Millisecond
	var rows atomic.Int64
	var asked atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/relay/usage" || r.URL.Query().Get("group_by") != "" {
			http.NotFound(w, r)
			return
		}
		// the writer writes a batch between two questions
		if asked.Add(1) == 3 {
			rows.Store(100)
		}
		fmt.Fprintf(w, `{"rows":[{"requests":%d,"input_tokens":0,"output_tokens":0,"cache_read_tokens":0,"cache_write_tokens":0,"cost_usd":0}]}`, rows.Load())
	}))
	defer srv.Close()
	admin := strings.TrimPrefix(srv.URL, "http://")
	b := &bench{options: options{logf: t.Logf}}
	ctx := context.Background()
	rows.Store(40)
	if err := b.checkLedger(ctx, relayLedger, admin, 100); err != nil {
		t.Errorf("the rows reached the requests sent: %v", err)
	}
	for _, c := range []struct {
		sent int64
		want string
	}{
		{101, "the ledger holds 100 rows for the 101 requests sent"},
		{99, "the ledger holds 100 rows for the 99 requests sent"},
		{0, "no request was sent"},
	} {
		if err := b.checkLedger(ctx, relayLedger, admin, c.sent); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%d sent: %v, want %q", c.sent, err, c.want)
		}
	}
	srv.Config.Handler = http.NotFoundHandler()
	if err := b.checkLedger(ctx, relayLedger, admin, 100); err == nil || !strings.Contains(err.Error(), "status 404") {
		t.Errorf("an admin endpoint without usage: %v", err)
	}
}

// counterValue reads an unlabeled metric's value from an exposition, not
// its help or type lines, nor a metric whose name it starts.
func TestCounterValue(t *testing.T) {
	exp := []byte("# HELP relay_ledger_rows_total Rows written.\n# TYPE relay_ledger_rows_total counter\n" +
		"relay_ledger_rows_total_other 7\nrelay_ledger_rows_total 1.2e+06\nrelay_ledger_writer_cpu_seconds_total 3.5\n")
	if v, ok := counterValue(exp, "relay_ledger_rows_total"); !ok || v != 1.2e6 {
		t.Errorf("rows: %v %v", v, ok)
	}
	if v, ok := counterValue(exp, "relay_ledger_writer_cpu_seconds_total"); !ok || v != 3.5 {
		t.Errorf("cpu: %v %v", v, ok)
	}
	if _, ok := counterValue(exp, "relay_ledger_dropped_total"); ok {
		t.Error("a metric that is not there was found")
	}
}
