package ledger

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"

	"github.com/ncruces/go-sqlite3"
)

// rawWriter writes a SQLite ledger's batches through the driver's own
// connection and statements (the SQLite C API as the driver gives it),
// kept for it, past database/sql, which converts every value of a batch
// into a slice of its own (15,000 values, 600 KB, for a full statement) and
// checks each, and past the driver's database/sql statements, which bind
// from a slice of their own again: the writer binds each of its values
// with one call. Only first tries go this way (no RETURNING); a write that
// must read back what it wrote, or whose first try failed here, goes
// through database/sql's pool.
//
// The connection is taken from database/sql's pool for good (conn) and
// used by the ledger's writer alone, one write at a time (sqlStore.mu).
type rawWriter struct {
	conn   *sql.Conn
	c      *sqlite3.Conn // conn's, as the driver gives it
	insert [len(insertSizes)]*sqlite3.Stmt
	upsert [len(upsertSizes)]*sqlite3.Stmt
}

func newRawWriter(ctx context.Context, s *sqlStore) (*rawWriter, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	w := &rawWriter{conn: conn}
	err = conn.Raw(func(dc any) error {
		r, ok := dc.(interface{ Raw() *sqlite3.Conn })
		if !ok {
			return fmt.Errorf("the driver's connection (%T) is not SQLite's own", dc)
		}
		w.c = r.Raw()
		old := w.c.SetInterrupt(ctx)
		defer w.c.SetInterrupt(old)
		for i, n := range insertSizes {
			if w.insert[i], err = w.prepare(s.insertSQL(n) + ledgerKeepOnce); err != nil {
				return err
			}
		}
		for i, n := range upsertSizes {
			if w.upsert[i], err = w.prepare(s.upsertDaily(n)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		w.close()
		return nil, fmt.Errorf("ledger: prepare the writer's statements: %w", err)
	}
	return w, nil
}

// prepare is query's statement on the writer's connection: one
// statement, whole.
func (w *rawWriter) prepare(query string) (*sqlite3.Stmt, error) {
	st, tail, err := w.c.Prepare(query)
	if err == nil && strings.TrimSpace(tail) != "" {
		_ = st.Close()
		return nil, fmt.Errorf("ledger: a statement of two: %q", tail)
	}
	return st, err
}

func (w *rawWriter) close() {
	for _, st := range append(w.insert[:], w.upsert[:]...) {
		if st != nil {
			_ = st.Close()
		}
	}
	_ = w.conn.Close()
}

// write runs fn in a transaction of the writer's connection, which ctx
// bounds (SQLite is interrupted when it ends). The transaction is
// IMMEDIATE: it takes the database's write lock at once, so it never
// waits for a reader to upgrade.
func (w *rawWriter) write(ctx context.Context, fn func(batchTx) error) error {
	// in Raw, database/sql leaves the connection alone
	return w.conn.Raw(func(any) error { return w.tx(ctx, fn) })
}

func (w *rawWriter) tx(ctx context.Context, fn func(batchTx) error) error {
	old := w.c.SetInterrupt(ctx)
	defer w.c.SetInterrupt(old)
	if err := w.c.Exec("BEGIN IMMEDIATE"); err != nil {
		return err
	}
	err := fn(rawTx{w})
	if err == nil {
		if err = w.c.Exec("COMMIT"); err == nil {
			return nil
		}
	}
	if !w.c.GetAutocommit() {
		// the rollback runs even when ctx is what ended the write
		w.c.SetInterrupt(context.Background())
		_ = w.c.Exec("ROLLBACK")
	}
	return err
}

// rows counts the rows of the file the writer's connection has open,
// whichever file its path names now: a file deleted under it is still
// read through the connection.
func (w *rawWriter) rows(ctx context.Context) (int64, error) {
	var n int64
	err := w.conn.Raw(func(any) error {
		old := w.c.SetInterrupt(ctx)
		defer w.c.SetInterrupt(old)
		st, err := w.prepare(`SELECT COUNT(*) FROM relay_usage_rows`)
		if err != nil {
			return err
		}
		defer st.Close()
		if !st.Step() {
			if err := st.Err(); err != nil {
				return err
			}
			return errors.New("ledger: a count without a row")
		}
		n = st.ColumnInt64(0)
		return nil
	})
	return n, err
}

// checkpoint writes the WAL into the file the writer's connection has
// open, and empties it.
func (w *rawWriter) checkpoint(ctx context.Context) error {
	return w.conn.Raw(func(any) error {
		old := w.c.SetInterrupt(ctx)
		defer w.c.SetInterrupt(old)
		return w.c.Exec(`PRAGMA wal_checkpoint(TRUNCATE)`)
	})
}

// bindArgs binds args to st's parameters, in order.
func bindArgs(st *sqlite3.Stmt, args []any) error {
	if n := st.BindCount(); n != len(args) {
		return fmt.Errorf("ledger: %d values for %d parameters", len(args), n)
	}
	for i, v := range args {
		var err error
		switch v := v.(type) {
		case int64:
			err = st.BindInt64(i+1, v)
		case *int64Box: // a value of the writer's boxes
			err = st.BindInt64(i+1, v.v)
		case string:
			err = st.BindText(i+1, v)
		case bool:
			err = st.BindBool(i+1, v)
		case nil:
			err = st.BindNull(i + 1)
		default:
			err = fmt.Errorf("ledger: a value of type %T", v)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// execStmt runs st with args. (Each run binds every parameter, so none
// keeps a value of the run before; SQLite's copies of the texts are let
// go when they are bound again.)
func execStmt(st *sqlite3.Stmt, args []any) error {
	if err := bindArgs(st, args); err != nil {
		return err
	}
	return st.Exec()
}

// rawTx is a write's transaction on the writer's connection: first tries
// only, which need no RETURNING.
type rawTx struct{ w *rawWriter }

func (t rawTx) insert(_ context.Context, i int, args []any) (int64, error) {
	if err := execStmt(t.w.insert[i], args); err != nil {
		return 0, err
	}
	return t.w.c.Changes(), nil
}

func (t rawTx) insertReturning(context.Context, int, []any, map[string]bool) error {
	return errors.New("ledger: a first try does not read back what it wrote")
}

func (t rawTx) upsert(_ context.Context, i int, args []any) error {
	return execStmt(t.w.upsert[i], args)
}

// exec and queryNames run statements that are not kept (rare: the names
// a writer has not met).
func (t rawTx) exec(_ context.Context, query string, args []any) error {
	st, err := t.w.prepare(query)
	if err != nil {
		return err
	}
	defer st.Close()
	return execStmt(st, args)
}

func (t rawTx) queryNames(_ context.Context, query string, args []any, found func(int64, ledgerNames)) error {
	st, err := t.w.prepare(query)
	if err != nil {
		return err
	}
	defer st.Close()
	if err := bindArgs(st, args); err != nil {
		return err
	}
	if n := st.ColumnCount(); n != 1+len(ledgerNameColumns) {
		return fmt.Errorf("ledger: a names row of %d columns", n)
	}
	for st.Step() {
		var n [7]string
		for i := range n {
			n[i] = st.ColumnText(1 + i)
		}
		found(st.ColumnInt64(0), ledgerNames{n[0], n[1], n[2], n[3], n[4], n[5], n[6]})
	}
	return st.Err()
}
