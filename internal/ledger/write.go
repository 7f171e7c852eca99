package ledger

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"slices"
	"strings"
	"time"
)

// ledgerKeepOnce ends an insert: a row already written (a write whose
// success was lost and was tried again: the same request id at the same
// time) is kept once, (time, request_id) being the table's key.
const ledgerKeepOnce = " ON CONFLICT (time, request_id) DO NOTHING"

// insertSQL is the statement that writes n rows at once.
func (s *sqlStore) insertSQL(n int) string {
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
func (s *sqlStore) Write(ctx context.Context, rows []Row) error {
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
func (s *sqlStore) writeTx(ctx context.Context, rows []Row, returning bool) (err error) {
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
	s  *sqlStore
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
func (s *sqlStore) writeIn(ctx context.Context, tx batchTx, rows []Row, returning bool) error {
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
func (s *sqlStore) rowArgs(args []any, r, prev *Row, ids []int64) []any {
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
func (s *sqlStore) upsertDaily(n int) string {
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

// valuesSQL is the VALUES list of n rows of cols placeholders each.
func (s *sqlStore) valuesSQL(n, cols int) string {
	return s.valuesOf(n, cols, nil)
}

// valuesOf is valuesSQL with column j's parameter p written as
// around(j, p), when around is not nil.
func (s *sqlStore) valuesOf(n, cols int, around func(j int, p string) string) string {
	var b strings.Builder
	p := 1
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('(')
		for j := range cols {
			if j > 0 {
				b.WriteByte(',')
			}
			if around != nil {
				b.WriteString(around(j, s.d.param(p)))
			} else {
				b.WriteString(s.d.param(p))
			}
			p++
		}
		b.WriteByte(')')
	}
	return b.String()
}
