package ledger

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// sqlLedger is a ledger in a SQL database through database/sql: SQLite
// and PostgreSQL differ only in their dialect.
type sqlLedger struct {
	db     *sql.DB
	d      dialect
	digest func(string) string // a session id as the rows keep it
	// insert holds the statements that write insertSizes[i] rows, and
	// upsert those that add upsertSizes[i] sums to the daily rollup,
	// prepared once: a statement of a thousand rows took longer to parse
	// than to run, and the rollup's upsert was parsed again for every sum
	insert [len(insertSizes)]*sql.Stmt
	upsert [len(upsertSizes)]*sql.Stmt
	// insertReturning are the inserts that also return the request ids
	// of the rows they wrote, for a write that may meet rows written
	// already
	insertReturning [len(insertSizes)]*sql.Stmt

	mu       sync.Mutex     // one write at a time: the ledger's writer
	retrying bool           // the last write failed: the next may meet its rows
	args     []any          // a batch's values, reused from batch to batch
	boxes    int64Boxes     // the int64s in args
	digests  map[string]any // the batch's session ids' digests, boxed
	raw      *rawWriter     // SQLite's: first tries past database/sql

	// names are the ids of the names in relay_usage_names the writer
	// knows (at most ledgerNamesKept), learned those the transaction
	// under way read or added (kept once it commits), ids the ids of the
	// batch's rows' names and missing the names not known yet
	names   map[ledgerNames]int64
	learned map[ledgerNames]int64
	ids     []int64
	missing []ledgerNames
}

// insertSizes are the row counts of the prepared inserts, largest first:
// a batch is written as whole statements of these sizes (a full one in
// five of the largest), so that no batch needs a statement parsed for it.
var insertSizes = [...]int{ledgerStatement, 100, 10, 1}

// upsertSizes are the sum counts of the prepared upserts of the rollup: a
// batch of rows of many keys, channels and models has hundreds of sums.
var upsertSizes = [...]int{100, 10, 1}

// ledgerKeepOnce ends an insert: a row already written (a write whose
// success was lost and was tried again: the same request id at the same
// time) is kept once, (time, request_id) being the table's key.
const ledgerKeepOnce = " ON CONFLICT (time, request_id) DO NOTHING"

// dialect is what differs between the databases: the schema's
// migrations, how a time is stored, how a day is told, placeholders.
type dialect struct {
	// migrations are the schema's steps, in order: step i brings the
	// schema to version i+1, recorded in schema_version
	migrations []string
	// lock, when set, runs in the migration's transaction first, so two
	// relays that start together migrate one after the other
	lock string
	// timeMilli: the time column holds Unix milliseconds (SQLite), else
	// a timestamp (timeArg)
	timeMilli bool
	// day is the expression of a row's UTC day, YYYY-MM-DD
	day string
	// sum wraps a SUM so it scans as an int64
	sum func(string) string
	// param is the n-th placeholder (from 1)
	param func(n int) string
	// rawFirstTries: a batch's first try goes through the driver's own
	// statements (rawWriter), so database/sql's are prepared only for
	// the tries that read back what they wrote
	rawFirstTries bool
	// shared: several relays may write at once (a fleet's database), so
	// a write takes its locks on the rollup's rows in one order
	shared bool
}

// timeArg is t as the time column stores it. (The writer boxes a row's
// milliseconds itself: rowArgs.)
func (d dialect) timeArg(t time.Time) any {
	if d.timeMilli {
		return t.UnixMilli()
	}
	return t.UTC()
}

// ledgerColumns are the columns of the ledger's rows as SQL reads them
// (the view relay_usage), and were those of its table before the names
// table.
var ledgerColumns = []string{
	"request_id", "time", "key_name", "user_name", "group_name", "channel_name",
	"model", "served_model", "status", "cause",
	"input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
	"cost_nano_usd", "estimated", "incomplete", "session_digest", "duration_ms", "first_byte_ms",
}

func newSQLLedger(ctx context.Context, db *sql.DB, d dialect, digest func(string) string) (*sqlLedger, error) {
	s := &sqlLedger{db: db, d: d, digest: digest, digests: map[string]any{},
		names: map[ledgerNames]int64{}, learned: map[ledgerNames]int64{}}
	if err := s.migrate(ctx); err != nil {
		_ = db.Close()
		return nil, err
	}
	// a migration may have taken longer than ctx gave reaching the
	// database: the statements get as long again
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ledgerWriteTimeout)
	defer cancel()
	for i, n := range insertSizes {
		for _, st := range []struct {
			to  **sql.Stmt
			sql string
		}{
			{&s.insert[i], s.insertSQL(n) + ledgerKeepOnce},
			{&s.insertReturning[i], s.insertSQL(n) + ledgerKeepOnce + " RETURNING request_id"},
		} {
			if st.to == &s.insert[i] && d.rawFirstTries {
				continue
			}
			prepared, err := db.PrepareContext(ctx, st.sql)
			if err != nil {
				_ = db.Close()
				return nil, fmt.Errorf("ledger: prepare the insert of %d rows: %w", n, err)
			}
			*st.to = prepared
		}
	}
	for i, n := range upsertSizes {
		st, err := db.PrepareContext(ctx, s.upsertDaily(n))
		if err != nil {
			_ = db.Close()
			return nil, fmt.Errorf("ledger: prepare the daily rollup: %w", err)
		}
		s.upsert[i] = st
	}
	return s, nil
}

// migrate brings the schema to the version this relay writes: the steps
// it has not taken yet, each in a transaction with its version. A database
// of a newer version (a newer relay wrote it) is refused. ctx bounds
// reaching the database; the steps, which may rewrite every row of a large
// ledger (seconds a million rows), are bounded by ledgerMigrateTimeout.
func (s *sqlLedger) migrate(ctx context.Context) error {
	if err := s.db.PingContext(ctx); err != nil {
		return fmt.Errorf("ledger: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ledgerMigrateTimeout)
	defer cancel()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("ledger: %w", err)
	}
	defer func() { _ = tx.Rollback() }()
	if s.d.lock != "" {
		if _, err := tx.ExecContext(ctx, s.d.lock); err != nil {
			return fmt.Errorf("ledger: lock for the migration: %w", err)
		}
	}
	if _, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)`); err != nil {
		return fmt.Errorf("ledger: schema_version: %w", err)
	}
	var version int
	if err := tx.QueryRowContext(ctx, `SELECT COALESCE(MAX(version), 0) FROM schema_version`).Scan(&version); err != nil {
		return fmt.Errorf("ledger: schema_version: %w", err)
	}
	if version > len(s.d.migrations) {
		return fmt.Errorf("ledger: the database's schema is version %d, newer than this relay's %d", version, len(s.d.migrations))
	}
	for i := version; i < len(s.d.migrations); i++ {
		if _, err := tx.ExecContext(ctx, s.d.migrations[i]); err != nil {
			return fmt.Errorf("ledger: migration to version %d: %w", i+1, err)
		}
	}
	if version < len(s.d.migrations) {
		if _, err := tx.ExecContext(ctx, `DELETE FROM schema_version`); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO schema_version (version) VALUES (`+strconv.Itoa(len(s.d.migrations))+`)`); err != nil {
			return err
		}
	}
	return tx.Commit()
}

// insertSQL is the statement that writes n rows at once.
func (s *sqlLedger) insertSQL(n int) string {
	return "INSERT INTO relay_usage_rows (" + strings.Join(ledgerRowColumns, ", ") + ") VALUES " +
		s.valuesOf(n, len(ledgerRowColumns), func(j int, p string) string {
			if ledgerRowColumns[j] == "session_digest" {
				// most rows have no session: their digest is bound as
				// NULL, which copies no text into the driver, and
				// stored as ''
				return "COALESCE(" + p + ", '')"
			}
			return p
		})
}

// Write adds rows to the table and their sums to the daily rollup, in one
// transaction, counting each request once in both. A first try cannot
// meet rows already written (request ids are unique), so it inserts
// without RETURNING and checks that every row was written; a Write after
// a failed one (whose commit may have been lost), or a first try that
// found rows written already, reads which rows the insert wrote
// (RETURNING) and adds only those to the rollup.
func (s *sqlLedger) Write(ctx context.Context, rows []Row) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.retrying {
		err := s.writeTx(ctx, rows, false)
		if err == nil {
			return nil
		}
		// a first try through SQLite's own connection that failed is
		// tried again at once through database/sql's pool: the
		// connection may be what failed
		if !errors.Is(err, errRowsWritten) && s.raw == nil {
			s.retrying = true
			return err
		}
	}
	err := s.writeTx(ctx, rows, true)
	s.retrying = err != nil
	return err
}

// errRowsWritten is a first try's insert that found rows written already.
var errRowsWritten = errors.New("ledger: rows of the batch were written already")

// writeTx is write's transaction; with returning, it adds to the rollup
// only the rows the insert wrote, else it fails with errRowsWritten when
// the insert did not write every row. A SQLite ledger's first try goes
// through the driver's own connection (rawWriter).
func (s *sqlLedger) writeTx(ctx context.Context, rows []Row, returning bool) (err error) {
	defer func() {
		// the rows' strings are not kept until the next batch
		clear(s.args)
		clear(s.digests)
		clear(s.missing)
		s.missing = s.missing[:0]
		// the names a transaction read or added are known once it
		// committed; one that failed may have added them in vain
		if err == nil {
			s.keepLearned()
		} else {
			clear(s.learned)
		}
	}()
	if s.raw != nil && !returning {
		return s.raw.write(ctx, func(tx batchTx) error { return s.writeIn(ctx, tx, rows, false) })
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if err := s.writeIn(ctx, sqlTx{s, tx}, rows, returning); err != nil {
		return err
	}
	return tx.Commit()
}

// batchTx is what a write does in its transaction: database/sql's, or the
// SQLite driver's own.
type batchTx interface {
	// insert runs the insert of insertSizes[i] rows, and reports how many
	// it wrote
	insert(ctx context.Context, i int, args []any) (int64, error)
	// insertReturning runs it, adding the ids of the rows it wrote to
	// written
	insertReturning(ctx context.Context, i int, args []any, written map[string]bool) error
	// upsert adds upsertSizes[i] sums to the rollup
	upsert(ctx context.Context, i int, args []any) error
	// exec runs a statement that is not prepared
	exec(ctx context.Context, query string, args []any) error
	// queryNames runs a query of names rows (id, then the seven names),
	// giving found each
	queryNames(ctx context.Context, query string, args []any, found func(int64, ledgerNames)) error
}

type sqlTx struct {
	s  *sqlLedger
	tx *sql.Tx
}

func (t sqlTx) insert(ctx context.Context, i int, args []any) (int64, error) {
	res, err := t.tx.StmtContext(ctx, t.s.insert[i]).ExecContext(ctx, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (t sqlTx) insertReturning(ctx context.Context, i int, args []any, written map[string]bool) error {
	res, err := t.tx.StmtContext(ctx, t.s.insertReturning[i]).QueryContext(ctx, args...)
	if err != nil {
		return err
	}
	return readWritten(res, written)
}

func (t sqlTx) upsert(ctx context.Context, i int, args []any) error {
	_, err := t.tx.StmtContext(ctx, t.s.upsert[i]).ExecContext(ctx, args...)
	return err
}

func (t sqlTx) exec(ctx context.Context, query string, args []any) error {
	_, err := t.tx.ExecContext(ctx, query, args...)
	return err
}

func (t sqlTx) queryNames(ctx context.Context, query string, args []any, found func(int64, ledgerNames)) error {
	res, err := t.tx.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer res.Close()
	for res.Next() {
		var id int64
		var n ledgerNames
		if err := res.Scan(&id, &n.key, &n.user, &n.group, &n.channel, &n.model, &n.served, &n.cause); err != nil {
			return err
		}
		found(id, n)
	}
	return res.Err()
}

// nextChunk splits rest into its head, as long as the largest of sizes
// (largest first, the last 1) that rest can fill, and what follows; i is
// that size's index.
func nextChunk[T any](rest []T, sizes []int) (i int, chunk, after []T) {
	for sizes[i] > len(rest) {
		i++
	}
	return i, rest[:sizes[i]], rest[sizes[i]:]
}

// writeIn writes rows and their sums in tx.
func (s *sqlLedger) writeIn(ctx context.Context, tx batchTx, rows []Row, returning bool) error {
	if err := s.resolveNames(ctx, tx, rows); err != nil {
		return err
	}
	var written map[string]bool
	if returning {
		written = make(map[string]bool, len(rows))
	}
	for rest := rows; len(rest) > 0; {
		var i int
		var chunk []Row
		at := len(rows) - len(rest) // chunk's first row's index in rows
		i, chunk, rest = nextChunk(rest, insertSizes[:])
		s.args = s.args[:0]
		s.boxes.reset()
		var prev *Row
		for j := range chunk {
			s.args = s.rowArgs(s.args, &chunk[j], prev, s.ids[at:at+j+1])
			prev = &chunk[j]
		}
		if returning {
			if err := tx.insertReturning(ctx, i, s.args, written); err != nil {
				return err
			}
			continue
		}
		if n, err := tx.insert(ctx, i, s.args); err != nil {
			return err
		} else if n != int64(len(chunk)) {
			return errRowsWritten
		}
	}
	sums := map[dailyKey]*UsageRow{}
	var order []dailyKey
	var day string           // the UTC day of [dayFrom, dayTo), as YYYY-MM-DD
	var dayFrom, dayTo int64 // Unix seconds
	var k dailyKey
	var u *UsageRow
	for i := range rows {
		r := &rows[i]
		if returning && !written[r.ID] {
			continue
		}
		if sec := r.At.Unix(); sec < dayFrom || sec >= dayTo {
			t := r.At.UTC()
			day = t.Format(time.DateOnly)
			dayFrom = time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC).Unix()
			dayTo = dayFrom + 24*3600
		}
		// most rows add to the sum the row before them added to
		if u == nil || k.day != day || k.key != r.Key || k.user != r.User || k.group != r.Group || k.channel != r.Channel || k.model != r.Served {
			k = dailyKey{day, r.Key, r.User, r.Group, r.Channel, r.Served}
			if u = sums[k]; u == nil {
				u = new(UsageRow)
				sums[k] = u
				order = append(order, k)
			}
		}
		u.Requests++
		u.Input += r.Input
		u.Output += r.Output
		u.CacheRead += r.CacheRead
		u.CacheWrite += r.CacheWrite
		u.CostNano += r.CostNano
	}
	if s.d.shared {
		// relays that write at once lock the rows they add to in one
		// order, so that they wait for each other rather than deadlock
		slices.SortFunc(order, func(a, b dailyKey) int {
			return cmp.Or(strings.Compare(a.day, b.day), strings.Compare(a.key, b.key),
				strings.Compare(a.user, b.user), strings.Compare(a.group, b.group),
				strings.Compare(a.channel, b.channel), strings.Compare(a.model, b.model))
		})
	}
	for rest := order; len(rest) > 0; {
		var i int
		var chunk []dailyKey
		i, chunk, rest = nextChunk(rest, upsertSizes[:])
		s.args = s.args[:0]
		for _, k := range chunk {
			u := sums[k]
			s.args = append(s.args, k.day, k.key, k.user, k.group, k.channel, k.model,
				u.Requests, u.Input, u.Output, u.CacheRead, u.CacheWrite, u.CostNano)
		}
		if err := tx.upsert(ctx, i, s.args); err != nil {
			return err
		}
	}
	return ctx.Err()
}

// rowArgs appends r's values to args, in the order of ledgerRowColumns;
// ids ends with the id of r's names, after prev's (the row before it in
// args). A value boxed in an interface is an allocation: the names id (and
// the time) r shares with prev, as most rows do (a key, a channel and a
// model serve many requests in a row), reuse prev's boxes, and a session's
// digest is made once a batch.
func (s *sqlLedger) rowArgs(args []any, r, prev *Row, ids []int64) []any {
	var was []any
	if prev != nil {
		was = args[len(args)-len(ledgerRowColumns):]
	}
	var at, names, session any
	if id := ids[len(ids)-1]; was != nil && id == ids[len(ids)-2] {
		names = was[2]
	} else {
		names = s.boxes.box(id)
	}
	if was != nil && r.At.Equal(prev.At) {
		at = was[1]
	} else if s.d.timeMilli {
		at = s.boxes.box(r.At.UnixMilli())
	} else {
		at = s.d.timeArg(r.At)
	}
	if was != nil && r.Session == prev.Session && r.SessionDigested == prev.SessionDigested {
		session = was[11]
	} else if r.Session == "" {
		session = nil // see insertSQL
	} else if r.SessionDigested {
		session = r.Session
	} else if session = s.digests[r.Session]; session == nil {
		session = s.digest(r.Session)
		s.digests[r.Session] = session
	}
	b := &s.boxes
	return append(args, r.ID, at, names, b.box(int64(r.Status)),
		b.box(r.Input), b.box(r.Output), b.box(r.CacheRead), b.box(r.CacheWrite),
		b.box(r.CostNano), r.Estimated, r.Incomplete, session,
		b.box(r.Duration.Milliseconds()), b.box(r.FirstByte.Milliseconds()), b.box(r.ToolNano), r.EstimatedPrice)
}

// readWritten adds the request ids of an insert's RETURNING to written:
// the rows it wrote, not those a retried batch had written already.
func readWritten(res *sql.Rows, written map[string]bool) error {
	for res.Next() {
		var id string
		if err := res.Scan(&id); err != nil {
			res.Close()
			return err
		}
		written[id] = true
	}
	if err := res.Close(); err != nil {
		return err
	}
	return res.Err()
}

// dailyKey is a row of the daily rollup: a UTC day and every column a
// usage answer may be grouped by.
type dailyKey struct{ day, key, user, group, channel, model string }

// upsertDaily adds n sums to the daily rollup, of n different rows of it.
func (s *sqlLedger) upsertDaily(n int) string {
	var b strings.Builder
	b.WriteString(`INSERT INTO relay_usage_daily (day, key_name, user_name, group_name, channel_name, served_model,
		requests, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_nano_usd)
		VALUES `)
	p := 1
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('(')
		for j := range 12 {
			if j > 0 {
				b.WriteByte(',')
			}
			b.WriteString(s.d.param(p))
			p++
		}
		b.WriteByte(')')
	}
	return b.String() + `
		ON CONFLICT (day, key_name, user_name, group_name, channel_name, served_model) DO UPDATE SET
		requests = relay_usage_daily.requests + excluded.requests,
		input_tokens = relay_usage_daily.input_tokens + excluded.input_tokens,
		output_tokens = relay_usage_daily.output_tokens + excluded.output_tokens,
		cache_read_tokens = relay_usage_daily.cache_read_tokens + excluded.cache_read_tokens,
		cache_write_tokens = relay_usage_daily.cache_write_tokens + excluded.cache_write_tokens,
		cost_nano_usd = relay_usage_daily.cost_nano_usd + excluded.cost_nano_usd`
}

// dailyMigration adds the daily rollup (the sums by day and every
// group_by column, which a usage answer over whole days reads instead of
// every row), filled from the rows already written; day is the dialect's
// expression of a row's day.
func dailyMigration(day string) string {
	return `CREATE TABLE relay_usage_daily (
			day TEXT NOT NULL,
			key_name TEXT NOT NULL,
			user_name TEXT NOT NULL,
			group_name TEXT NOT NULL,
			channel_name TEXT NOT NULL,
			served_model TEXT NOT NULL,
			requests BIGINT NOT NULL,
			input_tokens BIGINT NOT NULL,
			output_tokens BIGINT NOT NULL,
			cache_read_tokens BIGINT NOT NULL,
			cache_write_tokens BIGINT NOT NULL,
			cost_nano_usd BIGINT NOT NULL,
			PRIMARY KEY (day, key_name, user_name, group_name, channel_name, served_model)
		);
		INSERT INTO relay_usage_daily
			SELECT ` + day + `, key_name, user_name, group_name, channel_name, served_model, COUNT(*),
				SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), SUM(cache_write_tokens), SUM(cost_nano_usd)
			FROM relay_usage GROUP BY 1, 2, 3, 4, 5, 6;`
}

// Prune deletes the rows before before, and the days of the rollup that
// end before it.
func (s *sqlLedger) Prune(ctx context.Context, before time.Time) (int64, error) {
	res, err := s.db.ExecContext(ctx, `DELETE FROM relay_usage_rows WHERE time < `+s.d.param(1), s.d.timeArg(before))
	if err != nil {
		return 0, err
	}
	if _, err := s.db.ExecContext(ctx, `DELETE FROM relay_usage_daily WHERE day < `+s.d.param(1), before.UTC().Format(time.DateOnly)); err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (s *sqlLedger) Close() error {
	if s.raw != nil {
		s.raw.close()
	}
	for i := range s.insert {
		for _, st := range []*sql.Stmt{s.insert[i], s.insertReturning[i]} {
			if st != nil {
				_ = st.Close()
			}
		}
	}
	for _, st := range s.upsert {
		_ = st.Close()
	}
	return s.db.Close()
}
