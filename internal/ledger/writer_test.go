package ledger

import (
	"context"
	"errors"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// flakyStore is a ledger database that fails while told to, and keeps
// what it was given.
type flakyStore struct {
	mu    sync.Mutex
	down  bool
	rows  []Row
	calls int
}

func (s *flakyStore) Write(_ context.Context, rows []Row) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	if s.down {
		return errors.New("connection refused")
	}
	s.rows = append(s.rows, rows...)
	return nil
}
func (s *flakyStore) Prune(context.Context, time.Time) (int64, error) { return 0, nil }
func (s *flakyStore) Usage(context.Context, Query, func(UsageRow) error) error {
	return nil
}
func (s *flakyStore) Close() error { return nil }

func TestLedgerRowsWaitThenDropPastTheQueueBoundOneLogLinePerOutage(t *testing.T) {
	store := &flakyStore{down: true}
	core, logs := observer.New(zap.InfoLevel)
	l := newWriter(store, "test", zap.New(core), 10)
	dropped := testutil.ToFloat64(metricLedgerDropped)
	var own []Row
	for i := range 25 {
		l.Add(Row{ID: "r" + string(rune('a'+i))})
		if i%5 == 4 { // the writer tries while the database is away
			own = l.take(own)
			if l.flush(context.Background(), &own) {
				t.Fatal("a write to a database that is down succeeded")
			}
		}
	}
	if got := testutil.ToFloat64(metricLedgerDropped) - dropped; got != 15 {
		t.Errorf("dropped %v rows, want 15: the 10 the queue holds wait", got)
	}
	if n := logs.FilterMessageSnippet("ledger unavailable").Len(); n != 1 {
		t.Errorf("%d log lines for one outage, want 1", n)
	}
	store.mu.Lock()
	store.down = false
	store.mu.Unlock()
	own = l.take(own)
	if !l.flush(context.Background(), &own) {
		t.Fatal("the write failed once the database was back")
	}
	own = l.take(own)
	l.flush(context.Background(), &own)
	if len(store.rows) != 10 || store.rows[0].ID != "ra" || store.rows[9].ID != "rj" {
		t.Fatalf("written %d rows (%v...), want the first 10 in order", len(store.rows), store.rows)
	}
	if logs.FilterMessageSnippet("ledger is back").Len() != 1 {
		t.Error("no log line when the ledger came back")
	}
	// the queue is empty again: rows are taken
	l.Add(Row{ID: "later"})
	if got := testutil.ToFloat64(metricLedgerDropped) - dropped; got != 15 {
		t.Errorf("a row was dropped with room in the queue (%v dropped)", got)
	}
}

func TestLedgerStopWritesTheQueueOut(t *testing.T) {
	store := &flakyStore{}
	l := newWriter(store, "test", zap.NewNop(), 100)
	go l.run()
	for range 42 {
		l.Add(Row{ID: newRequestID()})
	}
	if err := l.Destruct(); err != nil {
		t.Fatal(err)
	}
	if len(store.rows) != 42 {
		t.Fatalf("%d rows written at the stop, want 42", len(store.rows))
	}
}

// TestAnIdleLedgerWriterSleeps: a writer that finds the queue empty does
// not wake again until a row comes, and then writes it within about a
// second: an idle relay's ledger costs no CPU.
func TestAnIdleLedgerWriterSleeps(t *testing.T) {
	t.Parallel()
	store := &flakyStore{}
	l := newWriter(store, "test", zap.NewNop(), 100)
	go l.run()
	t.Cleanup(func() { _ = l.Destruct() })
	written := func() int {
		store.mu.Lock()
		defer store.mu.Unlock()
		return len(store.rows)
	}
	var slept int64 // the writer's sleeps before the last row came
	for round := range 2 {
		waitFor(t, "the writer finds the queue empty", 3*time.Second, func() bool { return l.sleeps.Load() > slept })
		slept = l.sleeps.Load()
		// no signal says that nothing happens: wait two and a half of the
		// writer's seconds, in each of which a writer that still woke would
		// find the queue empty again
		time.Sleep(2500 * time.Millisecond)
		if got := l.sleeps.Load(); got != slept {
			t.Fatalf("round %d: the idle writer woke %d times in 2.5s, want none", round, got-slept)
		}
		added := time.Now()
		l.Add(Row{ID: newRequestID()})
		waitFor(t, "the row written", 3*time.Second, func() bool { return written() == round+1 })
		if took := time.Since(added); took < ledgerEvery/2 {
			t.Errorf("round %d: the row was written after %v: a partial batch waits for its second", round, took)
		}
	}
}

// TestAFullLedgerBatchIsWrittenAtOnce: once ledgerBatch rows wait, the
// writer writes them without waiting for its second, and never more than
// ledgerBatch rows in one write.
func TestAFullLedgerBatchIsWrittenAtOnce(t *testing.T) {
	t.Parallel()
	store := &flakyStore{}
	l := newWriter(store, "test", zap.NewNop(), 3*ledgerBatch)
	go l.run()
	t.Cleanup(func() { _ = l.Destruct() })
	// asleep, the writer is woken by the first row and then waits a
	// second for more, unless the batch fills
	waitFor(t, "the writer finds the queue empty", 3*time.Second, func() bool { return l.sleeps.Load() > 0 })
	added := time.Now()
	for range ledgerBatch + 1 {
		l.Add(Row{ID: newRequestID()})
	}
	waitFor(t, "a full batch written", 3*time.Second, func() bool {
		store.mu.Lock()
		defer store.mu.Unlock()
		return len(store.rows) >= ledgerBatch
	})
	if took := time.Since(added); took >= ledgerEvery {
		t.Errorf("the full batch was written after %v: it waited for the writer's second", took)
	}
	waitFor(t, "the last row written", 3*time.Second, func() bool {
		store.mu.Lock()
		defer store.mu.Unlock()
		return len(store.rows) == ledgerBatch+1
	})
	store.mu.Lock()
	defer store.mu.Unlock()
	if store.calls != 2 {
		t.Errorf("%d rows in %d writes, want a full batch, then the row after it", len(store.rows), store.calls)
	}
}

// TestTheLedgerQueueHasRoomPastAFullBatch: the rows that come between a
// full batch's kick and the writer taking it go into room the queue has,
// rather than growing (copying) a slice of a batch under the queue's lock
// on a request's path.
func TestTheLedgerQueueHasRoomPastAFullBatch(t *testing.T) {
	l := newWriter(&flakyStore{}, "test", zap.NewNop(), 3*ledgerBatch) // no writer: nothing takes the rows
	room := cap(l.pending)
	for range ledgerBatch + ledgerBatch/10 {
		l.Add(Row{ID: "r"})
	}
	if got := cap(l.pending); got != room {
		t.Errorf("the queue grew from %d to %d rows on a request's path, %d rows past a full batch", room, got, ledgerBatch/10)
	}
}

func TestUsageQueryParameters(t *testing.T) {
	now := time.Date(2026, 3, 17, 12, 0, 0, 0, time.UTC)
	q, err := ParseQuery(url.Values{}, now)
	if err != nil || !q.From.Equal(time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)) || !q.To.Equal(time.Date(2026, 4, 1, 0, 0, 0, 0, time.UTC)) || q.CSV || len(q.GroupBy) != 0 {
		t.Errorf("default query %+v %v, want the current UTC month", q, err)
	}
	q, err = ParseQuery(url.Values{"from": {"2026-01-01"}, "to": {"2026-01-31"}, "group_by": {"key,day"}, "format": {"csv"}}, now)
	if err != nil || !q.To.Equal(time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC)) || strings.Join(q.GroupBy, ",") != "key,day" || !q.CSV {
		t.Errorf("query %+v %v: a date as to covers its day", q, err)
	}
	for _, c := range []struct {
		v    url.Values
		want string
	}{
		{url.Values{"group_by": {"key,tenant"}}, `group_by: unknown column "tenant" (key, user, group, channel, model, day)`},
		{url.Values{"group_by": {"key,key"}}, `column "key" is given twice`},
		{url.Values{"format": {"xml"}}, `format must be json or csv, not "xml"`},
		{url.Values{"from": {"yesterday"}}, `from: "yesterday" is neither a date`},
		{url.Values{"from": {"2026-02-01"}, "to": {"2026-01-01"}}, `must be after from`},
		{url.Values{"group": {"key"}}, `unknown parameter "group"`},
	} {
		if _, err := ParseQuery(c.v, now); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: error %v, want %q", c.v, err, c.want)
		}
	}
}

func TestUSDDecimalIsExact(t *testing.T) {
	for n, want := range map[int64]string{0: "0", 1: "0.000000001", 1_500_000_000: "1.5", 123_456_789_012: "123.456789012", -2_000_000_000: "-2"} {
		if got := usdDecimal(n); got != want {
			t.Errorf("usdDecimal(%d) = %q, want %q", n, got, want)
		}
	}
}

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
func checkStore(t *testing.T, s *sqlLedger) {
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
	s, err := openSQLiteLedger(path, testDigest)
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
	s, err = openSQLiteLedger(path, testDigest)
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
	if _, err := openSQLiteLedger(path, testDigest); err == nil || !strings.Contains(err.Error(), "newer than this relay's") {
		t.Errorf("opening a newer schema: %v", err)
	}
}

// A row's session is stored as its digest: a short id as the writer
// digests it, a long one (digested when its row was queued,
// SessionDigested) as it came.
func TestASessionIsStoredAsItsDigest(t *testing.T) {
	long := strings.Repeat("s", 4096)
	s := &sqlLedger{d: sqliteDialect, digest: testDigest, digests: map[string]any{}}
	for _, r := range []Row{{Session: "cc-session-1"}, {Session: testDigest(long), SessionDigested: true}} {
		args := s.rowArgs(nil, &r, nil, []int64{1})
		want := testDigest(map[bool]string{false: "cc-session-1", true: long}[r.SessionDigested])
		if args[11] != want {
			t.Errorf("stored session %v, want %s", args[11], want)
		}
	}
}
