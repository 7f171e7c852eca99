package ledger

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/pgtest"
)

// BenchmarkLedgerSQLiteWrite is the rate at which rows go into a SQLite
// ledger on this machine's disk, in full batches, and the CPU the writer
// spends on a row (cpu-µs/row: the process's user and system time over
// the writes, the garbage collector's included). Rows come as requests
// make them: random request ids, in time order. "many-keys": every row of
// a batch a different key, group, channel and model (the rollup's worst
// case); "one-key": one key, group, channel and model, as bench/ drives.
func BenchmarkLedgerSQLiteWrite(b *testing.B) {
	b.Run("many-keys", func(b *testing.B) { benchSQLiteWrite(b, false) })
	b.Run("one-key", func(b *testing.B) { benchSQLiteWrite(b, true) })
}

func benchSQLiteWrite(b *testing.B, oneKey bool) {
	s, err := openSQLiteStore(filepath.Join(b.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	start := time.Now()
	rows := benchRows(ledgerBatch, start, 0)
	ctx := context.Background()
	n := 0
	var cpu time.Duration
	for b.Loop() {
		b.StopTimer()
		for i := range rows {
			r := &rows[i]
			r.ID = newRequestID()
			r.At = start.Add(time.Duration(n) * 100 * time.Microsecond) // 10,000 rows/s
			if oneKey {
				r.Key, r.Group, r.Channel, r.Model, r.Served = "key-00", "group-0", "channel-0", "claude-sonnet-4-5", "claude-sonnet-4-5"
			}
			n++
		}
		before := cpuTime()
		b.StartTimer()
		if err := s.Write(ctx, rows); err != nil {
			b.Fatal(err)
		}
		cpu += cpuTime() - before
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "rows/s")
	b.ReportMetric(float64(cpu.Microseconds())/float64(n), "cpu-µs/row")
}

// cpuTime is the CPU time the process has used, all its threads.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// benchRows are n rows of 50 keys, from 8 groups, 6 channels and 3
// models, spread over a month from start.
func benchRows(n int, start time.Time, from int) []Row {
	models := []string{"claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5"}
	session := []string{"s", "", "", ""} // a quarter of the requests in a session
	rows := make([]Row, n)
	for i := range rows {
		k := from + i
		rows[i] = Row{
			ID: fmt.Sprintf("relay_%024d", k), At: start.Add(time.Duration(k%(30*24*3600)) * time.Second),
			Key: fmt.Sprintf("key-%02d", k%50), Group: fmt.Sprintf("group-%d", k%8), Channel: fmt.Sprintf("channel-%d", k%6),
			Model: models[k%3], Served: models[k%3], Status: 200, Cause: causeOK,
			Input: 1200, Output: 300, CacheRead: 8000, CacheWrite: 400, CostNano: 12_345_678,
			Session: session[k%4], Duration: 2 * time.Second, FirstByte: 400 * time.Millisecond,
		}
	}
	return rows
}

// TestLedgerMillionRowMonth fills a SQLite ledger with a month of 1M rows
// and times the usage queries, which must answer in under a second: over
// whole days, and over a range that is not (the whole days from the
// rollup, the partial days at its edges from the rows, through the key
// on time). It takes about a minute to fill, so it runs only with
// RELAY_LEDGER_1M=1.
func TestLedgerMillionRowMonth(t *testing.T) {
	if os.Getenv("RELAY_LEDGER_1M") != "1" {
		t.Skip("set RELAY_LEDGER_1M=1 to fill a ledger with 1M rows and time the usage query")
	}
	s, err := openSQLiteStore(filepath.Join(t.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	millionRowMonth(t, s, func(stmt string, args []any) string { return explainSQLite(t, s, stmt, args) })
}

// TestLedgerPostgresMillionRowMonth is TestLedgerMillionRowMonth in a real
// Postgres (a few minutes to fill), with RELAY_LEDGER_1M=1.
func TestLedgerPostgresMillionRowMonth(t *testing.T) {
	if os.Getenv("RELAY_LEDGER_1M") != "1" {
		t.Skip("set RELAY_LEDGER_1M=1 to fill a ledger with 1M rows and time the usage query")
	}
	pg := pgtest.Start(t)
	s, err := openPostgresStore(pg.DSN(), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	millionRowMonth(t, s, func(stmt string, args []any) string {
		rows, err := s.db.Query("EXPLAIN "+stmt, args...)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var plan []string
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				t.Fatal(err)
			}
			plan = append(plan, line)
		}
		return strings.Join(plan, "\n")
	})
}

// millionRowMonth fills s with 1M rows over March 2026 and times the usage
// queries; explain returns the plan of a statement.
func millionRowMonth(t *testing.T, s *sqlStore, explain func(stmt string, args []any) string) {
	start := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	ctx := context.Background()
	began := time.Now()
	for from := 0; from < 1_000_000; from += ledgerBatch {
		if err := s.Write(ctx, benchRows(ledgerBatch, start, from)); err != nil {
			t.Fatal(err)
		}
	}
	fill := time.Since(began)
	t.Logf("1M rows written in %v (%.0f rows/s)", fill, 1e6/fill.Seconds())
	month := Query{From: start, To: start.AddDate(0, 1, 0)}
	// noon to noon: 29 whole days and two halves
	noon := Query{From: start.Add(12 * time.Hour), To: start.AddDate(0, 1, 0).Add(-12 * time.Hour)}
	for _, c := range []struct {
		q       Query
		groupBy []string
		want    int64
	}{
		{month, []string{"key", "day"}, 1_000_000},
		{month, []string{"group", "model"}, 1_000_000},
		{month, nil, 1_000_000},
		{noon, []string{"key", "day"}, 0},
		{noon, []string{"group", "model"}, 0},
		{noon, nil, 0},
	} {
		q := c.q
		q.GroupBy = c.groupBy
		began = time.Now()
		rows, requests := 0, int64(0)
		if err := s.Usage(ctx, q, func(u UsageRow) error { rows++; requests += u.Requests; return nil }); err != nil {
			t.Fatal(err)
		}
		took := time.Since(began)
		t.Logf("usage %s..%s by %v: %d rows, %d requests, in %v", q.From.Format(time.RFC3339), q.To.Format(time.RFC3339), q.GroupBy, rows, requests, took)
		if (c.want != 0 && requests != c.want) || requests == 0 || took > time.Second {
			t.Errorf("usage by %v: %d requests in %v, want %d in under 1s", q.GroupBy, requests, took, c.want)
		}
		if q.From != noon.From {
			continue
		}
		// the same from the rows alone: what the answer took before the
		// rollup answered the whole days of such a range
		began = time.Now()
		rowsOnly := int64(0)
		if err := s.usageOf(ctx, q.GroupBy, []usageSpan{{from: q.From, to: q.To}}, func(u UsageRow) error { rowsOnly += u.Requests; return nil }); err != nil {
			t.Fatal(err)
		}
		t.Logf("  the same from the rows alone: %v", time.Since(began))
		if rowsOnly != requests {
			t.Errorf("usage by %v: %d requests, but the rows hold %d", q.GroupBy, requests, rowsOnly)
		}
	}
	edge, args := s.spanSQL([]string{"key", "day"}, usageSpans(noon.From, noon.To)[0], nil)
	plan := explain(edge, args)
	t.Logf("the plan of an edge's rows:\n%s", plan)
	if !strings.Contains(plan, "USING PRIMARY KEY (time>? AND time<?)") && !strings.Contains(plan, "relay_usage_pkey") {
		t.Errorf("the rows of an edge are not read through the key on time")
	}
}

// TestLedgerMillionRowMigration times the migration to the names table of
// a month of 1M rows written by a relay before it (schema version 3), in
// SQLite and in Postgres, with RELAY_LEDGER_1M=1; the rows' count through
// the view must be the table's.
func TestLedgerMillionRowMigration(t *testing.T) {
	if os.Getenv("RELAY_LEDGER_1M") != "1" {
		t.Skip("set RELAY_LEDGER_1M=1 to migrate a ledger of 1M rows")
	}
	t.Run("sqlite", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "ledger.db")
		db, err := sql.Open("sqlite", "file:"+path)
		if err != nil {
			t.Fatal(err)
		}
		millionRowMigration(t, sqliteDialect, db, func() (*sqlStore, error) { return openSQLiteStore(path, testDigest) })
	})
	t.Run("postgres", func(t *testing.T) {
		pg := pgtest.Start(t)
		db, err := sql.Open("pgx", pg.DSN())
		if err != nil {
			t.Fatal(err)
		}
		millionRowMigration(t, postgresDialect, db, func() (*sqlStore, error) { return openPostgresStore(pg.DSN(), testDigest) })
	})
}

func millionRowMigration(t *testing.T, d dialect, db *sql.DB, open func() (*sqlStore, error)) {
	ctx := context.Background()
	old := &sqlStore{db: db, d: d, digests: map[string]any{}}
	old.d.migrations = d.migrations[:3]
	if err := old.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)
	tx, err := db.Begin()
	if err != nil {
		t.Fatal(err)
	}
	const chunk = 100
	st, err := tx.Prepare("INSERT INTO relay_usage (" + strings.Join(ledgerColumns, ", ") + ") VALUES " + old.valuesSQL(chunk, len(ledgerColumns)))
	if err != nil {
		t.Fatal(err)
	}
	args := make([]any, 0, chunk*len(ledgerColumns))
	for from := 0; from < 1_000_000; from += chunk {
		args = args[:0]
		for _, r := range benchRows(chunk, start, from) {
			args = append(args, r.ID, d.timeArg(r.At), r.Key, r.User, r.Group, r.Channel, r.Model, r.Served, int64(r.Status), r.Cause,
				r.Input, r.Output, r.CacheRead, r.CacheWrite, r.CostNano, r.Estimated, r.Incomplete, testDigest(r.Session),
				r.Duration.Milliseconds(), r.FirstByte.Milliseconds())
		}
		if _, err := st.Exec(args...); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	_ = db.Close()
	began := time.Now()
	s, err := open()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	t.Logf("1M rows migrated to the names table in %v", time.Since(began))
	if n := countOf(t, s.db, "relay_usage"); n != 1_000_000 {
		t.Errorf("%d rows through the view, want 1M", n)
	}
}
