package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// Ledger keeps one row per request in a database that finance can query
// (GET /relay/usage on the admin API, or SQL): who asked, what was served,
// its tokens and its cost. It is `ledger` in the JSON config and the
// Caddyfile. Without it, the relay keeps no such record. Rows are written
// off the request path, in batches; a database that is away never slows or
// fails a request.
type Ledger struct {
	// SQLite keeps the ledger in a SQLite file of this machine: right for
	// a single relay. It is the default when neither is set.
	SQLite *LedgerSQLite `json:"sqlite,omitempty"`

	// Postgres keeps the ledger in a PostgreSQL database, which the
	// relays of a fleet share.
	Postgres *LedgerPostgres `json:"postgres,omitempty"`

	// Retention is how long rows are kept: older ones are deleted once an
	// hour. Default: 400d (a year and a month, for a year-on-year
	// comparison).
	Retention caddy.Duration `json:"retention,omitempty"`
}

// LedgerSQLite is a SQLite ledger file, written in WAL mode.
type LedgerSQLite struct {
	// Path is the database file. Placeholders such as {env.NAME} are
	// resolved. Default: relay/ledger.db in Caddy's data directory.
	Path string `json:"path,omitempty"`
}

// LedgerPostgres is a PostgreSQL ledger.
type LedgerPostgres struct {
	// DSN is the connection string (postgres://user:pass@host/db?... or
	// key=value pairs). Use a placeholder such as {env.RELAY_PG_DSN}: it is
	// resolved when the config loads and never shows in GET /config/ or
	// the logs.
	DSN string `json:"dsn,omitempty"`
}

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

// ledgerQueue is how many rows may wait for the database (about 30 MB):
// more are dropped. A variable for the tests that reach it.
var ledgerQueue = 100_000

func (l *Ledger) validate() error {
	if l.SQLite != nil && l.Postgres != nil {
		return fmt.Errorf("ledger: sqlite or postgres, not both")
	}
	if l.Postgres != nil && l.Postgres.DSN == "" {
		return fmt.Errorf("ledger postgres: dsn is required")
	}
	if l.Retention < 0 {
		return fmt.Errorf("ledger_retention must not be negative")
	}
	return nil
}

// ledgers keeps each ledger's writer across config reloads, by its
// database: one writer per database in a process, whatever the number of
// relay handlers and configs that use it. The last config to go writes its
// queue out and closes it.
var ledgers = caddy.NewUsagePool()

// ledgerRow is one request's record, as account hands it over: the
// strings refer to what the request already holds, so handing it over
// allocates nothing. The session id is digested by the writer, off the
// request path; the raw id is never stored. A session id longer than
// maxIDLen (a client's choice, as long as a header) is digested at once,
// so that a queue of rows waiting for a database that is down holds no
// more than their bound: sessionDigested says so.
type ledgerRow struct {
	at                                   time.Time
	id, key, user, group, channel        string
	model, served, cause, session        string
	status                               int
	input, output, cacheRead, cacheWrite int64
	costNano                             int64
	toolNano                             int64 // of costNano, what server tools cost
	estimated, incomplete                bool
	estimatedPrice                       bool // the cost is at an unpriced model's estimate
	sessionDigested                      bool
	duration, firstByte                  time.Duration
}

// record hands the request's row to the ledger's queue, with its cost and
// the part of it server tools made (tools), in USD; a nil ledger (none
// configured) does nothing. Only requests of a principal (a key or an
// identity) are recorded: an unauthenticated one is nobody's usage.
func (l *ledger) record(in *inbound, at time.Time, duration time.Duration, cost, tools float64) {
	if l == nil || in.who.key == nil {
		return
	}
	row := ledgerRow{
		at: at, id: in.id, key: in.who.key.name, group: in.who.key.group.name,
		model: in.ask.model, served: in.grant.target, cause: in.causeLabel(),
		session: in.agentSession(), status: in.end.status,
		input: in.end.usage.input, output: in.end.usage.output,
		cacheRead: in.end.usage.cacheRead, cacheWrite: in.end.usage.cacheWrite,
		costNano:  int64(money.ToNano(cost)), // as the budgets' spend counts it
		toolNano:  int64(money.ToNano(tools)),
		estimated: in.end.estimated, incomplete: in.end.incomplete, estimatedPrice: in.end.estimatedPrice,
		duration: duration, firstByte: in.end.firstByte,
	}
	if len(row.session) > maxIDLen {
		row.session, row.sessionDigested = sessionDigest(row.session), true
	}
	if in.who.key.kind() == kindUser {
		row.user, _ = strings.CutPrefix(in.who.stateID, userStatePrefix)
	}
	if ch := in.end.charged(); ch != nil {
		row.channel = ch.name
	}
	if in.end.batch != nil {
		l.addBatch(row, in.end.batch)
		return
	}
	l.add(row)
}

// causeBatch is the cause of the rows of a batch's results, charged by the
// request that read them first.
const causeBatch = "batch"

// addBatch queues the rows of the request (row) that accounted a batch's
// results: one per model the results used, each with that model's tokens
// and cost, the first under the request's id and each further one under
// <request id>/<model>; one row without a model when no result succeeded.
// They are the principal's that paid (the batch's maker's), cause batch.
// Their costs add up, to the nano-USD, to the cost the budgets charged.
func (l *ledger) addBatch(row ledgerRow, b *batchCharge) {
	row.cause, row.model, row.served = causeBatch, "", ""
	if b.payer != nil {
		row.key, row.user = principalOf(b.payer)
	}
	if len(b.models) == 0 {
		l.add(row)
		return
	}
	// each row's cost is what it adds to the running sum, rounded as the
	// budgets round the whole: never negative, and the last row ends at
	// the whole the budgets charged (accountBatch sums in the same order)
	id, total := row.id, row.costNano
	var sum float64
	var prev int64
	for i, m := range b.models {
		sum += m.cost
		upTo := int64(money.ToNano(sum))
		if i == len(b.models)-1 {
			upTo = total
		}
		row.model, row.served = m.model, m.model
		row.input, row.output, row.cacheRead, row.cacheWrite = m.usage.input, m.usage.output, m.usage.cacheRead, m.usage.cacheWrite
		row.costNano, prev = upTo-prev, upTo
		row.toolNano = int64(money.ToNano(m.tools))
		row.estimatedPrice = m.estimated
		if i > 0 {
			row.id = id + "/" + m.model
		}
		l.add(row)
	}
}

// ledger is one database's writer: a bounded queue that requests hand
// rows to, and a goroutine that writes them in batches.
type ledger struct {
	store  ledgerStore
	name   string // the database, for logs: "sqlite <path>" or "postgres" (never the DSN)
	logger *zap.Logger

	mu      sync.Mutex
	pending []ledgerRow // handed over, not taken by the writer yet
	held    int         // rows pending plus those the writer holds: bounded by limit
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

// ledgerStore is a ledger's database.
type ledgerStore interface {
	write(ctx context.Context, rows []ledgerRow) error
	prune(ctx context.Context, before time.Time) (int64, error)
	usage(ctx context.Context, q usageQuery, emit func(usageRow) error) error
	close() error
}

// loadLedger returns the ledger of config c, from the pool, and the key the
// caller gives back with ledgers.Delete when its config ends. A reload
// that keeps the database keeps its writer and its queue, and takes the
// new retention.
func loadLedger(ctx caddy.Context, c *Ledger) (*ledger, string, error) {
	if err := c.validate(); err != nil {
		return nil, "", err
	}
	key, open, err := ledgerBackend(ctx, c)
	if err != nil {
		return nil, "", err
	}
	v, _, err := ledgers.LoadOrNew(key, func() (caddy.Destructor, error) {
		store, name, err := open()
		if err != nil {
			return nil, err
		}
		l := newLedger(store, name, ctx.Logger(), ledgerQueue)
		go l.run()
		return l, nil
	})
	if err != nil {
		return nil, "", err
	}
	l := v.(*ledger)
	l.mu.Lock()
	l.retain = defaultLedgerRetention
	if c.Retention > 0 {
		l.retain = time.Duration(c.Retention)
	}
	l.logger = ctx.Logger()
	l.mu.Unlock()
	return l, key, nil
}

// ledgerBackend says which database c names (the pool's key: a SQLite
// file's absolute path, or the DSN as configured, a placeholder, never
// resolved) and how to open it.
func ledgerBackend(ctx caddy.Context, c *Ledger) (string, func() (ledgerStore, string, error), error) {
	if c.Postgres != nil {
		dsn, err := resolveSecret(c.Postgres.DSN)
		if err != nil {
			return "", nil, fmt.Errorf("ledger postgres: dsn: %w", err)
		}
		if !strings.HasPrefix(c.Postgres.DSN, "{") {
			ctx.Logger().Warn("the ledger's postgres dsn is written in the config; use a placeholder such as {env.RELAY_PG_DSN} to keep its password out of GET /config/ and autosave.json")
		}
		raw, _ := json.Marshal(c.Postgres)
		return "postgres:" + string(raw), func() (ledgerStore, string, error) {
			s, err := openPostgresLedger(dsn)
			return s, "postgres", err
		}, nil
	}
	path, err := sqliteLedgerPath(c.SQLite)
	if err != nil {
		return "", nil, err
	}
	return "sqlite:" + path, func() (ledgerStore, string, error) {
		s, err := openSQLiteFile(path)
		return s, "sqlite " + path, err
	}, nil
}

func newLedger(store ledgerStore, name string, logger *zap.Logger, limit int) *ledger {
	return &ledger{
		store: store, name: name, logger: logger, limit: limit,
		pending: make([]ledgerRow, 0, ledgerRoom),
		kick:    make(chan struct{}, 1),
		wake:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
		retain:  defaultLedgerRetention,
	}
}

// add queues row; it never waits on the database. Past the queue's bound,
// or after the ledger stopped, the row is dropped and counted.
func (l *ledger) add(row ledgerRow) {
	l.mu.Lock()
	if l.closed || l.held >= l.limit {
		l.dropped++
		l.mu.Unlock()
		metricLedgerDropped.Inc()
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
func (l *ledger) run() {
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
	own := make([]ledgerRow, 0, ledgerRoom) // taken from pending, not written yet; swapped with it
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
func (l *ledger) countCPU(last *time.Duration) {
	now := threadCPU()
	if d := now - *last; d > 0 {
		metricLedgerWriterCPU.Add(d.Seconds())
	}
	*last = now
}

// take gives the writer the queued rows when it has written all of its
// own; a writer with rows left from a failed write retries those first.
func (l *ledger) take(own []ledgerRow) []ledgerRow {
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
func (l *ledger) flush(ctx context.Context, own *[]ledgerRow) bool {
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
		metricLedgerWritten.Add(float64(n))
	}
	l.back()
	*own = (*own)[:0]
	return true
}

// write writes one batch. A store kept in a file first makes sure that
// the file it writes is the one its path names (fileStore): SQLite writes
// on, without an error, to a file deleted under it, and those rows would
// be lost with it.
func (l *ledger) write(ctx context.Context, rows []ledgerRow) error {
	if f, ok := l.store.(fileStore); ok {
		ch, err := f.reopen(ctx)
		if ch.changed {
			l.fileChanged(ch)
		}
		if err != nil {
			return err
		}
	}
	return l.store.write(ctx, rows)
}

// fileChanged logs what became of the ledger's file, and counts the rows
// that went with it in relay_ledger_rows_lost_total.
func (l *ledger) fileChanged(ch fileChange) {
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
		metricLedgerLost.Add(float64(ch.lost))
		logger.Error("ledger: its file was deleted or replaced under the running relay: the rows it held are lost (relay_ledger_rows_lost_total); later rows go to a new file at its path",
			zap.String("ledger", l.name), zap.Int64("rows_lost", ch.lost))
	}
}

// failed logs the first failed write of an outage, once.
func (l *ledger) failed(err error, waiting int) {
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
func (l *ledger) back() {
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
func (l *ledger) prune(now time.Time) {
	l.mu.Lock()
	retain := l.retain
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	n, err := l.store.prune(ctx, now.Add(-retain))
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
func (l *ledger) Destruct() error {
	close(l.stop)
	<-l.done
	l.mu.Lock()
	l.closed = true
	lost := l.held
	l.mu.Unlock()
	if lost > 0 {
		metricLedgerDropped.Add(float64(lost))
		l.logger.Error("ledger: rows not written at stop", zap.String("ledger", l.name), zap.Int("rows", lost))
	}
	return l.store.close()
}

// theLedger is the ledger GET /relay/usage reads: the only one the
// process writes. With none or several, it says why not.
func theLedger() (*ledger, error) {
	var found []*ledger
	ledgers.Range(func(_, v any) bool {
		found = append(found, v.(*ledger))
		return true
	})
	switch len(found) {
	case 0:
		return nil, fmt.Errorf("no ledger is configured (the relay's ledger option)")
	case 1:
		return found[0], nil
	}
	return nil, fmt.Errorf("%d ledgers are configured in this process; GET /relay/usage reads one", len(found))
}

// openLedger takes the config's ledger from the pool (opening its
// database when no config holds it yet).
func (r *Relay) openLedger(ctx caddy.Context) error {
	if r.Ledger == nil {
		return nil
	}
	if err := register(ctx.GetMetricsRegistry(), ledgerCollectors); err != nil {
		return err
	}
	l, key, err := loadLedger(ctx, r.Ledger)
	if err != nil {
		return err
	}
	r.ledger = l
	r.held.addLedger(key)
	return nil
}
