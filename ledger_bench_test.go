package relay

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap"
)

// discardStore takes every row and keeps none.
type discardStore struct{ *flakyStore }

func (discardStore) write(context.Context, []ledgerRow) error { return nil }

// BenchmarkLedgerEnqueue is what account pays for the ledger: the row
// built from the request and handed to the queue, with the writer
// draining it. It allocates nothing.
func BenchmarkLedgerEnqueue(b *testing.B) {
	l := newLedger(discardStore{new(flakyStore)}, "bench", zap.NewNop(), ledgerQueue)
	go l.run()
	defer l.Destruct()
	in := &inbound{id: newRequestID(), who: requester{key: &key{name: "bench-key", group: &group{name: "bench-g"}}}}
	in.ask.model, in.grant.target, in.end.status = "claude-sonnet-4-5", "claude-sonnet-4-5", 200
	in.ask.userID = "user_1_account__session_5f1c"
	now := time.Now()
	b.ReportAllocs()
	for b.Loop() {
		l.record(in, now, time.Millisecond, 0.0123)
	}
}

// BenchmarkLedgerSQLiteWrite is the rate at which rows go into a SQLite
// ledger on this machine's disk, in full batches.
func BenchmarkLedgerSQLiteWrite(b *testing.B) {
	s, err := openSQLiteLedger(filepath.Join(b.TempDir(), "ledger.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.close()
	rows := benchRows(ledgerBatch, time.Now(), 0)
	ctx := context.Background()
	n := 0
	for b.Loop() {
		for i := range rows {
			rows[i].id = fmt.Sprintf("relay_%024d", n)
			n++
		}
		if err := s.write(ctx, rows); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "rows/s")
}

// benchRows are n rows of 50 keys, from 8 groups, 6 channels and 3
// models, spread over a month from start.
func benchRows(n int, start time.Time, from int) []ledgerRow {
	models := []string{"claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5"}
	rows := make([]ledgerRow, n)
	for i := range rows {
		k := from + i
		rows[i] = ledgerRow{
			id: fmt.Sprintf("relay_%024d", k), at: start.Add(time.Duration(k%(30*24*3600)) * time.Second),
			key: fmt.Sprintf("key-%02d", k%50), group: fmt.Sprintf("group-%d", k%8), channel: fmt.Sprintf("channel-%d", k%6),
			model: models[k%3], served: models[k%3], status: 200, cause: causeOK,
			input: 1200, output: 300, cacheRead: 8000, cacheWrite: 400, costNano: 12_345_678,
			session: "s", duration: 2 * time.Second, firstByte: 400 * time.Millisecond,
		}
	}
	return rows
}

// TestLedgerMillionRowMonth fills a SQLite ledger with a month of 1M rows
// and times the usage query by key and day, which must answer in under a
// second. It takes about a minute to fill, so it runs only with
// RELAY_LEDGER_1M=1.
func TestLedgerMillionRowMonth(t *testing.T) {
	if os.Getenv("RELAY_LEDGER_1M") != "1" {
		t.Skip("set RELAY_LEDGER_1M=1 to fill a ledger with 1M rows and time the usage query")
	}
	s, err := openSQLiteLedger(filepath.Join(t.TempDir(), "ledger.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	start := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	ctx := context.Background()
	began := time.Now()
	for from := 0; from < 1_000_000; from += ledgerBatch {
		if err := s.write(ctx, benchRows(ledgerBatch, start, from)); err != nil {
			t.Fatal(err)
		}
	}
	fill := time.Since(began)
	q := usageQuery{from: start, to: start.AddDate(0, 1, 0), groupBy: []string{"key", "day"}}
	for _, groupBy := range [][]string{{"key", "day"}, {"group", "model"}, nil} {
		q.groupBy = groupBy
		began = time.Now()
		rows, requests := 0, int64(0)
		if err := s.usage(ctx, q, func(u usageRow) error { rows++; requests += u.requests; return nil }); err != nil {
			t.Fatal(err)
		}
		took := time.Since(began)
		t.Logf("1M rows written in %v (%.0f rows/s); usage by %v: %d rows in %v", fill, 1e6/fill.Seconds(), groupBy, rows, took)
		if requests != 1_000_000 || took > time.Second {
			t.Errorf("usage by %v: %d requests in %v, want 1000000 in under 1s", groupBy, requests, took)
		}
	}
}
