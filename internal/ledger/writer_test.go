package ledger

import (
	"context"
	"errors"
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
	dropped := testutil.ToFloat64(metricDropped)
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
	if got := testutil.ToFloat64(metricDropped) - dropped; got != 15 {
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
	if got := testutil.ToFloat64(metricDropped) - dropped; got != 15 {
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
