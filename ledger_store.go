package relay

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// sqlLedger is a ledger in a SQL database through database/sql: SQLite
// and PostgreSQL differ only in their dialect.
type sqlLedger struct {
	db *sql.DB
	d  dialect
	// insertFull is the statement of a full batch, built once
	insertFull string
}

// dialect is what differs between the databases: the schema's
// migrations, how a time is stored, how a day is told, placeholders.
type dialect struct {
	// migrations are the schema's steps, in order: step i brings the
	// schema to version i+1, recorded in schema_version
	migrations []string
	// lock, when set, runs in the migration's transaction first, so two
	// relays that start together migrate one after the other
	lock string
	// timeArg is a time as the time column stores it
	timeArg func(time.Time) any
	// day is the expression of a row's UTC day, YYYY-MM-DD
	day string
	// sum wraps a SUM so it scans as an int64
	sum func(string) string
	// param is the n-th placeholder (from 1)
	param func(n int) string
}

// ledgerColumns are the ledger table's columns, in the order of a row's
// values (ledgerValues).
var ledgerColumns = []string{
	"request_id", "time", "key_name", "user_name", "group_name", "channel_name",
	"model", "served_model", "status", "cause",
	"input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
	"cost_nano_usd", "estimated", "incomplete", "session_digest", "duration_ms", "first_byte_ms",
}

func newSQLLedger(ctx context.Context, db *sql.DB, d dialect) (*sqlLedger, error) {
	s := &sqlLedger{db: db, d: d}
	if err := s.migrate(ctx); err != nil {
		_ = db.Close()
		return nil, err
	}
	s.insertFull = s.insertSQL(ledgerBatch)
	return s, nil
}

// migrate brings the schema to the version this relay writes: the steps
// it has not taken yet, each in a transaction with its version. A database
// of a newer version (a newer relay wrote it) is refused.
func (s *sqlLedger) migrate(ctx context.Context) error {
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

// insertSQL is the statement that writes n rows at once. A row already
// written (a write whose success was lost and was tried again) is kept
// once: the request id is the table's key.
func (s *sqlLedger) insertSQL(n int) string {
	var b strings.Builder
	b.WriteString("INSERT INTO relay_usage (")
	b.WriteString(strings.Join(ledgerColumns, ", "))
	b.WriteString(") VALUES ")
	p := 1
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('(')
		for j := range ledgerColumns {
			if j > 0 {
				b.WriteByte(',')
			}
			b.WriteString(s.d.param(p))
			p++
		}
		b.WriteByte(')')
	}
	b.WriteString(" ON CONFLICT (request_id) DO NOTHING")
	return b.String()
}

func (s *sqlLedger) write(ctx context.Context, rows []ledgerRow) error {
	q := s.insertFull
	if len(rows) != ledgerBatch {
		q = s.insertSQL(len(rows))
	}
	args := make([]any, 0, len(rows)*len(ledgerColumns))
	for i := range rows {
		r := &rows[i]
		args = append(args, r.id, s.d.timeArg(r.at), r.key, r.user, r.group, r.channel,
			r.model, r.served, r.status, r.cause,
			r.input, r.output, r.cacheRead, r.cacheWrite,
			r.costNano, r.estimated, r.incomplete, sessionDigest(r.session),
			r.duration.Milliseconds(), r.firstByte.Milliseconds())
	}
	_, err := s.db.ExecContext(ctx, q, args...)
	return err
}

func (s *sqlLedger) prune(ctx context.Context, before time.Time) (int64, error) {
	res, err := s.db.ExecContext(ctx, `DELETE FROM relay_usage WHERE time < `+s.d.param(1), s.d.timeArg(before))
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (s *sqlLedger) close() error { return s.db.Close() }

// usage runs q, giving emit each row as it is read, so a large answer is
// streamed rather than held.
func (s *sqlLedger) usage(ctx context.Context, q usageQuery, emit func(usageRow) error) error {
	cols := make([]string, len(q.groupBy))
	for i, c := range q.groupBy {
		cols[i] = s.column(c)
	}
	sel := append(append([]string(nil), cols...),
		"COUNT(*)", s.d.sum("input_tokens"), s.d.sum("output_tokens"),
		s.d.sum("cache_read_tokens"), s.d.sum("cache_write_tokens"), s.d.sum("cost_nano_usd"))
	stmt := "SELECT " + strings.Join(sel, ", ") + " FROM relay_usage WHERE time >= " + s.d.param(1) + " AND time < " + s.d.param(2)
	if len(cols) > 0 {
		stmt += " GROUP BY " + strings.Join(cols, ", ") + " ORDER BY " + strings.Join(cols, ", ")
	}
	rows, err := s.db.QueryContext(ctx, stmt, s.d.timeArg(q.from), s.d.timeArg(q.to))
	if err != nil {
		return err
	}
	defer rows.Close()
	var r usageRow
	r.values = make([]string, len(cols))
	dest := make([]any, 0, len(cols)+6)
	for i := range r.values {
		dest = append(dest, &r.values[i])
	}
	dest = append(dest, &r.requests, &r.input, &r.output, &r.cacheRead, &r.cacheWrite, &r.costNano)
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return err
		}
		if err := emit(r); err != nil {
			return err
		}
	}
	return rows.Err()
}

// column is the expression of a group_by column.
func (s *sqlLedger) column(c string) string {
	switch c {
	case "key":
		return "key_name"
	case "user":
		return "user_name"
	case "group":
		return "group_name"
	case "channel":
		return "channel_name"
	case "model":
		return "served_model"
	}
	return s.d.day
}
