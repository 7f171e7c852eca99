package ledger

import (
	"context"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// testRows are rows of two keys over two days.
func testRows(day1, day2 time.Time) []Row {
	return []Row{
		{ID: "a", At: day1, Key: "k1", Group: "g", Channel: "c1", Served: "claude-sonnet-4-5", Status: 200, Input: 10, Output: 5, CostNano: 1_000_000_000, Session: "s1"},
		{ID: "b", At: day1.Add(time.Hour), Key: "k1", Group: "g", Channel: "c2", Served: "claude-sonnet-4-5", Status: 200, Input: 20, Output: 5, CacheRead: 3, CostNano: 500_000_000},
		{ID: "c", At: day2, Key: "k2", User: "alice", Group: "g", Channel: "c1", Served: "claude-opus-4-1", Status: 200, Input: 1, Output: 1, CacheWrite: 7, CostNano: 3},
		{ID: "d", At: day2, Key: "k2", Group: "g", Status: 429, Cause: "client"},
	}
}

// checkStore writes testRows to s (twice: a write retried keeps one row
// per request) and checks what usage answers.
func checkStore(t *testing.T, s *sqlStore) {
	t.Helper()
	ctx := context.Background()
	day1 := time.Date(2026, 3, 2, 10, 0, 0, 0, time.UTC)
	day2 := time.Date(2026, 3, 3, 23, 59, 0, 0, time.UTC)
	for range 2 {
		if err := s.Write(ctx, testRows(day1, day2)); err != nil {
			t.Fatal(err)
		}
	}
	q := Query{From: day1.AddDate(0, 0, -1), To: day2.AddDate(0, 0, 1), GroupBy: []string{"key", "day"}}
	var got []string
	err := s.Usage(ctx, q, func(u UsageRow) error {
		got = append(got, strings.Join(u.Values, "|")+" "+strings.Join([]string{
			i64(u.Requests), i64(u.Input), i64(u.Output), i64(u.CacheRead), i64(u.CacheWrite), usdDecimal(u.CostNano)}, " "))
		return nil
	})
	want := []string{"k1|2026-03-02 2 30 10 3 0 1.5", "k2|2026-03-03 2 1 1 0 7 0.000000003"}
	if err != nil || strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("usage by key and day: %v\n%s\nwant\n%s", err, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// over whole days, the daily rollup answers the same (the batch
	// written twice counted once there too)
	got = nil
	q.From, q.To = time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC), time.Date(2026, 3, 4, 0, 0, 0, 0, time.UTC)
	err = s.Usage(ctx, q, func(u UsageRow) error {
		got = append(got, strings.Join(u.Values, "|")+" "+strings.Join([]string{
			i64(u.Requests), i64(u.Input), i64(u.Output), i64(u.CacheRead), i64(u.CacheWrite), usdDecimal(u.CostNano)}, " "))
		return nil
	})
	if err != nil || strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("usage by key and day from the rollup: %v\n%s\nwant\n%s", err, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	got = nil
	q.GroupBy = nil
	q.To = day1.AddDate(0, 0, 1)
	_ = s.Usage(ctx, q, func(u UsageRow) error { got = append(got, i64(u.Requests)+" "+usdDecimal(u.CostNano)); return nil })
	if strings.Join(got, ",") != "2 1.5" {
		t.Errorf("total of day 1: %v", got)
	}
	n, err := s.Prune(ctx, day2)
	if err != nil || n != 2 {
		t.Errorf("pruned %d rows (%v), want day 1's 2", n, err)
	}
	var digest string
	if err := s.db.QueryRow(`SELECT session_digest FROM relay_usage WHERE request_id = 'c'`).Scan(&digest); err != nil || digest != "" {
		t.Errorf("session digest of a request without a session: %q %v", digest, err)
	}
}

func i64(n int64) string { return strconv.FormatInt(n, 10) }

func TestLedgerSQLiteOnDisk(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sub", "ledger.db")
	s, err := openSQLiteStore(path, testDigest)
	if err != nil {
		t.Fatal(err)
	}
	checkStore(t, s)
	var mode string
	if err := s.db.QueryRow(`PRAGMA journal_mode`).Scan(&mode); err != nil || mode != "wal" {
		t.Errorf("journal_mode %q %v, want wal", mode, err)
	}
	_ = s.Close()
	// opened again, the schema is not migrated twice
	s, err = openSQLiteStore(path, testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var v, n int
	if err := s.db.QueryRow(`SELECT MAX(version), COUNT(*) FROM schema_version`).Scan(&v, &n); err != nil || v != len(sqliteDialect.migrations) || n != 1 {
		t.Errorf("schema_version %d (%d rows) %v", v, n, err)
	}
	// a database a newer relay migrated is refused, not written
	if _, err := s.db.Exec(`UPDATE schema_version SET version = 99`); err != nil {
		t.Fatal(err)
	}
	_ = s.Close()
	if _, err := openSQLiteStore(path, testDigest); err == nil || !strings.Contains(err.Error(), "newer than this relay's") {
		t.Errorf("opening a newer schema: %v", err)
	}
}

// A row's session is stored as its digest: a short id as the writer
// digests it, a long one (digested when its row was queued,
// SessionDigested) as it came.
func TestASessionIsStoredAsItsDigest(t *testing.T) {
	long := strings.Repeat("s", 4096)
	s := &sqlStore{d: sqliteDialect, digest: testDigest, digests: map[string]any{}}
	for _, r := range []Row{{Session: "cc-session-1"}, {Session: testDigest(long), SessionDigested: true}} {
		args := s.rowArgs(nil, &r, nil, []int64{1})
		want := testDigest(map[bool]string{false: "cc-session-1", true: long}[r.SessionDigested])
		if args[11] != want {
			t.Errorf("stored session %v, want %s", args[11], want)
		}
	}
}
