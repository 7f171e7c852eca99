package relay

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
)

// rawWriter writes a SQLite ledger's batches through the driver's own
// connection and statements, kept for it, past database/sql, which
// converts every value of a batch into a slice of its own (20,000 values,
// 800 KB, for a full batch) and checks each: a fifth of the writer's CPU.
// Only first tries go this way (no RETURNING); a write that must read
// back what it wrote, or whose first try failed here, goes through
// database/sql's pool.
type rawWriter struct {
	conn   *sql.Conn
	insert [len(insertSizes)]driver.StmtExecContext
	upsert [len(upsertSizes)]driver.StmtExecContext
	stmts  []driver.Stmt
	nv     []driver.NamedValue
}

func newRawWriter(ctx context.Context, s *sqlLedger) (*rawWriter, error) {
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return nil, err
	}
	w := &rawWriter{conn: conn}
	err = conn.Raw(func(dc any) error {
		c, ok := dc.(driver.ConnPrepareContext)
		if _, begins := dc.(driver.ConnBeginTx); !ok || !begins {
			return errors.New("the driver does not prepare or begin with a context")
		}
		prep := func(q string) (driver.StmtExecContext, error) {
			st, err := c.PrepareContext(ctx, q)
			if err != nil {
				return nil, err
			}
			w.stmts = append(w.stmts, st)
			e, ok := st.(driver.StmtExecContext)
			if !ok {
				return nil, errors.New("the driver's statement does not execute with a context")
			}
			return e, nil
		}
		for i, n := range insertSizes {
			if w.insert[i], err = prep(s.insertSQL(n) + ledgerKeepOnce); err != nil {
				return err
			}
		}
		for i, n := range upsertSizes {
			if w.upsert[i], err = prep(s.upsertDaily(n)); err != nil {
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

func (w *rawWriter) close() {
	_ = w.conn.Raw(func(any) error {
		for _, st := range w.stmts {
			_ = st.Close()
		}
		return nil
	})
	_ = w.conn.Close()
}

// exec runs st with args, through nv.
func (w *rawWriter) exec(ctx context.Context, st driver.StmtExecContext, args []any) (driver.Result, error) {
	w.nv = w.nv[:0]
	for i, v := range args {
		w.nv = append(w.nv, driver.NamedValue{Ordinal: i + 1, Value: v})
	}
	defer clear(w.nv)
	return st.ExecContext(ctx, w.nv)
}

// rawTx is a write's transaction on the driver's connection (dc): first
// tries only, which need no RETURNING.
type rawTx struct {
	w  *rawWriter
	dc any
}

func (t rawTx) insert(ctx context.Context, i int, args []any) (int64, error) {
	res, err := t.w.exec(ctx, t.w.insert[i], args)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (t rawTx) insertReturning(context.Context, int, []any, map[string]bool) error {
	return errors.New("ledger: a first try does not read back what it wrote")
}

func (t rawTx) upsert(ctx context.Context, i int, args []any) error {
	_, err := t.w.exec(ctx, t.w.upsert[i], args)
	return err
}

func (t rawTx) exec(ctx context.Context, query string, args []any) error {
	e, ok := t.dc.(driver.ExecerContext)
	if !ok {
		return errors.New("ledger: the driver does not execute without a statement")
	}
	_, err := e.ExecContext(ctx, query, namedValues(args))
	return err
}

func (t rawTx) queryNames(ctx context.Context, query string, args []any, found func(int64, ledgerNames)) error {
	q, ok := t.dc.(driver.QueryerContext)
	if !ok {
		return errors.New("ledger: the driver does not query without a statement")
	}
	rows, err := q.QueryContext(ctx, query, namedValues(args))
	if err != nil {
		return err
	}
	defer rows.Close()
	vals := make([]driver.Value, 1+len(ledgerNameColumns))
	for {
		if err := rows.Next(vals); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
		if err := scanNames(vals, found); err != nil {
			return err
		}
	}
}

// namedValues are args as a driver takes them.
func namedValues(args []any) []driver.NamedValue {
	nv := make([]driver.NamedValue, len(args))
	for i, v := range args {
		nv[i] = driver.NamedValue{Ordinal: i + 1, Value: v}
	}
	return nv
}
