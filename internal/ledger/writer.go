package ledger

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Ledger defaults and bounds.
const (
	defaultLedgerRetention = 400 * 24 * time.Hour
	// ledgerBatch is the rows of one write (one transaction): the writer
	// writes each second, or as soon as this many wait. Under load a
	// write has a cost of its own, near a millisecond of CPU, most of it
	// bringing SQLite's code and pages back into the caches the requests
	// between two writes filled: spread over 5,000 rows rather than
	// 1,000, a row costs a fifth less (docs/ledger.md, "Figures")
	ledgerBatch = 5000
	// ledgerRoom is the capacity of the queue's two slices: a full batch
	// and room for the rows that come before the writer takes it, so that
	// a request's hand-off does not grow (copy) a slice of 5,000 rows
	ledgerRoom           = ledgerBatch + ledgerBatch/4
	ledgerStatement      = 1000        // rows of one insert: 15,000 parameters, under SQLite's 32,766
	ledgerEvery          = time.Second // a partial batch waits at most this
	ledgerPruneEvery     = time.Hour
	ledgerWriteTimeout   = 5 * time.Second  // one batch's write
	ledgerStopTimeout    = 10 * time.Second // writing the queue out at a stop
	ledgerMigrateTimeout = 30 * time.Minute // a schema migration, which may rewrite every row
)

// Queue is how many rows may wait for the database of a writer Load
// starts (about 30 MB): more are dropped.
const Queue = 100_000

// Writer is one database's writer: a bounded queue that requests hand
// rows to, and a goroutine that writes them in batches.
type Writer struct {
	store  Store
	name   string // the database, for logs: "sqlite <path>" or "postgres" (never the DSN)
	logger *zap.Logger

	mu      sync.Mutex
	pending []Row // handed over, not taken by the writer yet
	held    int   // rows pending plus those the writer holds: bounded by limit
	limit   int
	closed  bool          // Destruct ran: rows are not taken any more
	kick    chan struct{} // a batch is full
	wake    chan struct{} // a row came to an empty queue: an idle writer starts its second
	sleeps  atomic.Int64  // the rounds that found nothing to write, after which it slept (tests read it)
	stop    chan struct{}
	done    chan struct{}
	retain  time.Duration
	down    bool // the last write failed: one log line per outage
	dropped int64
}

// Start starts a writer of store's rows, outside the pool, whose queue
// holds up to queue rows; name is the database as its logs name it. Its
// Destruct writes the queue out and closes store.
func Start(store Store, name string, logger *zap.Logger, queue int) *Writer {
	l := newWriter(store, name, logger, queue)
	go l.run()
	return l
}

// Usage answers q from the writer's database, giving emit each row as it
// is read.
func (l *Writer) Usage(ctx context.Context, q Query, emit func(UsageRow) error) error {
	return l.store.Usage(ctx, q, emit)
}

func newWriter(store Store, name string, logger *zap.Logger, limit int) *Writer {
	return &Writer{
		store: store, name: name, logger: logger, limit: limit,
		pending: make([]Row, 0, ledgerRoom),
		kick:    make(chan struct{}, 1),
		wake:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
		retain:  defaultLedgerRetention,
	}
}

// Add queues row; it never waits on the database. Past the queue's bound,
// or after the ledger stopped, the row is dropped and counted.
func (l *Writer) Add(row Row) {
	l.mu.Lock()
	if l.closed || l.held >= l.limit {
		l.dropped++
		l.mu.Unlock()
		metricDropped.Inc()
		return
	}
	l.pending = append(l.pending, row)
	l.held++
	first, full := len(l.pending) == 1, len(l.pending) >= ledgerBatch
	l.mu.Unlock()
	switch {
	case full:
		select {
		case l.kick <- struct{}{}:
		default:
		}
	case first:
		select {
		case l.wake <- struct{}{}:
		default:
		}
	}
}

// run is the writer: each second, or when a batch is full, it writes what
// is queued; once an hour, after a write, it prunes old rows. A writer that
// found nothing to write sleeps until a row comes, and writes it a second
// later: an idle relay's writer costs nothing. At a stop it writes the
// queue out.
func (l *Writer) run() {
	defer close(l.done)
	// the writer has a thread of its own, whose CPU time is the writer's:
	// what the ledger costs off the request path, measured where it is
	// spent (relay_ledger_writer_cpu_seconds_total)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu := threadCPU()
	defer func() { l.countCPU(&cpu) }()
	tick := time.NewTicker(ledgerEvery)
	defer tick.Stop()
	own := make([]Row, 0, ledgerRoom) // taken from pending, not written yet; swapped with it
	var pruned time.Time
	idle := false
	for {
		ticks, wake := tick.C, l.wake
		if idle {
			ticks = nil
		} else {
			wake = nil
		}
		select {
		case <-wake:
			idle = false
			tick.Reset(ledgerEvery)
			continue
		case <-l.stop:
			ctx, cancel := context.WithTimeout(context.Background(), ledgerStopTimeout)
			for {
				own = l.take(own)
				if len(own) == 0 || !l.flush(ctx, &own) {
					break
				}
			}
			cancel()
			return
		case <-ticks:
		case <-l.kick:
		}
		own = l.take(own)
		if len(own) == 0 {
			// a row that comes now finds the queue empty and wakes
			// the writer
			idle = true
			tick.Stop()
			l.sleeps.Add(1)
			l.countCPU(&cpu)
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), ledgerWriteTimeout)
		ok := l.flush(ctx, &own)
		cancel()
		if now := time.Now(); ok && now.Sub(pruned) >= ledgerPruneEvery {
			pruned = now
			l.prune(now)
		}
		l.countCPU(&cpu)
	}
}

// countCPU adds the CPU time the writer's thread used since *last to
// relay_ledger_writer_cpu_seconds_total.
func (l *Writer) countCPU(last *time.Duration) {
	now := threadCPU()
	if d := now - *last; d > 0 {
		metricWriterCPU.Add(d.Seconds())
	}
	*last = now
}

// take gives the writer the queued rows when it has written all of its
// own; a writer with rows left from a failed write retries those first.
func (l *Writer) take(own []Row) []Row {
	if len(own) > 0 {
		return own
	}
	l.mu.Lock()
	own, l.pending = l.pending, own[:0]
	l.mu.Unlock()
	return own
}

// flush writes *own in batches; what a failed write leaves stays in *own
// for the next try. It reports whether all of it was written.
func (l *Writer) flush(ctx context.Context, own *[]Row) bool {
	rows := *own
	for len(rows) > 0 {
		n := min(len(rows), ledgerBatch)
		if err := l.write(ctx, rows[:n]); err != nil {
			l.failed(err, len(rows))
			*own = append((*own)[:0], rows...) // memmove: rows is a suffix of *own
			return false
		}
		rows = rows[n:]
		l.mu.Lock()
		l.held -= n
		l.mu.Unlock()
		metricWritten.Add(float64(n))
	}
	l.back()
	*own = (*own)[:0]
	return true
}

// write writes one batch. A store kept in a file first makes sure that
// the file it writes is the one its path names (fileStore): SQLite writes
// on, without an error, to a file deleted under it, and those rows would
// be lost with it.
func (l *Writer) write(ctx context.Context, rows []Row) error {
	if f, ok := l.store.(fileStore); ok {
		ch, err := f.reopen(ctx)
		if ch.changed {
			l.fileChanged(ch)
		}
		if err != nil {
			return err
		}
	}
	return l.store.Write(ctx, rows)
}

// fileChanged logs what became of the ledger's file, and counts the rows
// that went with it in relay_ledger_rows_lost_total.
func (l *Writer) fileChanged(ch fileChange) {
	l.mu.Lock()
	logger := l.logger
	l.mu.Unlock()
	switch {
	case ch.moved:
		logger.Warn("ledger: its file was moved away under the running relay: the rows it held are where it went; later rows go to a new file at its path",
			zap.String("ledger", l.name))
	case ch.lost < 0:
		logger.Error("ledger: its file was deleted or replaced under the running relay: the rows it held are lost, and could not be counted; later rows go to a new file at its path",
			zap.String("ledger", l.name))
	default:
		metricLost.Add(float64(ch.lost))
		logger.Error("ledger: its file was deleted or replaced under the running relay: the rows it held are lost (relay_ledger_rows_lost_total); later rows go to a new file at its path",
			zap.String("ledger", l.name), zap.Int64("rows_lost", ch.lost))
	}
}

// failed logs the first failed write of an outage, once.
func (l *Writer) failed(err error, waiting int) {
	l.mu.Lock()
	first := !l.down
	l.down = true
	dropped := l.dropped
	logger := l.logger
	l.mu.Unlock()
	if first {
		logger.Error("ledger unavailable: rows wait in memory, then are dropped (relay_ledger_dropped_total)",
			zap.String("ledger", l.name), zap.Int("waiting", waiting), zap.Int("queue", l.limit),
			zap.Int64("dropped_before", dropped), zap.Error(err))
	}
}

// back logs the end of an outage.
func (l *Writer) back() {
	l.mu.Lock()
	if !l.down {
		l.mu.Unlock()
		return
	}
	l.down = false
	dropped, logger := l.dropped, l.logger
	l.mu.Unlock()
	logger.Info("ledger is back: queued rows written", zap.String("ledger", l.name), zap.Int64("dropped_total", dropped))
}

// prune deletes the rows older than the retention.
func (l *Writer) prune(now time.Time) {
	l.mu.Lock()
	retain := l.retain
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	n, err := l.store.Prune(ctx, now.Add(-retain))
	if err != nil {
		l.logger.Warn("ledger: pruning old rows failed", zap.String("ledger", l.name), zap.Error(err))
		return
	}
	if n > 0 {
		l.logger.Info("ledger: old rows pruned", zap.String("ledger", l.name), zap.Int64("rows", n), zap.Duration("retention", retain))
	}
}

// Destruct implements caddy.Destructor: the last config that used the
// ledger is gone. The queue is written out (for at most
// ledgerStopTimeout), then the database is closed.
func (l *Writer) Destruct() error {
	close(l.stop)
	<-l.done
	l.mu.Lock()
	l.closed = true
	lost := l.held
	l.mu.Unlock()
	if lost > 0 {
		metricDropped.Add(float64(lost))
		l.logger.Error("ledger: rows not written at stop", zap.String("ledger", l.name), zap.Int("rows", lost))
	}
	return l.store.Close()
}
