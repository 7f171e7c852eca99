package ledger

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"time"
)

// Store is a ledger's database, which one Writer writes.
type Store interface {
	// Write adds rows, each request once (a row written already, by a
	// write whose success was lost, is kept once), with their sums to the
	// daily rollup.
	Write(ctx context.Context, rows []Row) error
	// Prune deletes the rows before before, and says how many.
	Prune(ctx context.Context, before time.Time) (int64, error)
	// Usage answers q, giving emit each row as it is read.
	Usage(ctx context.Context, q Query, emit func(UsageRow) error) error
	// Close lets go of the database.
	Close() error
}

// sqlStore is a ledger in a SQL database through database/sql: SQLite
// and PostgreSQL differ only in their dialect.
type sqlStore struct {
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

func newSQLStore(ctx context.Context, db *sql.DB, d dialect, digest func(string) string) (*sqlStore, error) {
	s := &sqlStore{db: db, d: d, digest: digest, digests: map[string]any{},
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

// Prune deletes the rows before before, and the days of the rollup that
// end before it.
func (s *sqlStore) Prune(ctx context.Context, before time.Time) (int64, error) {
	res, err := s.db.ExecContext(ctx, `DELETE FROM relay_usage_rows WHERE time < `+s.d.param(1), s.d.timeArg(before))
	if err != nil {
		return 0, err
	}
	if _, err := s.db.ExecContext(ctx, `DELETE FROM relay_usage_daily WHERE day < `+s.d.param(1), before.UTC().Format(time.DateOnly)); err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (s *sqlStore) Close() error {
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
