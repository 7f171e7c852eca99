package ledger

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	_ "github.com/ncruces/go-sqlite3/driver" // SQLite in pure Go: the xcaddy build needs no C toolchain
)

// sqliteDialect keeps time as Unix milliseconds (UTC).
var sqliteDialect = dialect{
	migrations: []string{
		`CREATE TABLE relay_usage (
			request_id TEXT PRIMARY KEY,
			time INTEGER NOT NULL,
			key_name TEXT NOT NULL,
			user_name TEXT NOT NULL,
			group_name TEXT NOT NULL,
			channel_name TEXT NOT NULL,
			model TEXT NOT NULL,
			served_model TEXT NOT NULL,
			status INTEGER NOT NULL,
			cause TEXT NOT NULL,
			input_tokens INTEGER NOT NULL,
			output_tokens INTEGER NOT NULL,
			cache_read_tokens INTEGER NOT NULL,
			cache_write_tokens INTEGER NOT NULL,
			cost_nano_usd INTEGER NOT NULL,
			estimated INTEGER NOT NULL,
			incomplete INTEGER NOT NULL,
			session_digest TEXT NOT NULL,
			duration_ms INTEGER NOT NULL,
			first_byte_ms INTEGER NOT NULL
		);
		CREATE INDEX relay_usage_time ON relay_usage (time);`,
		dailyMigration(`strftime('%Y-%m-%d', time / 1000, 'unixepoch')`),
		// the rows keyed by (time, request_id), without a rowid: one
		// B-tree, written at its end as rows come in time order, where the
		// key of random request ids and the index on time were three, one
		// of them written at a random leaf for every row; ranges of time
		// are read through the key, so the index on time goes
		`CREATE TABLE relay_usage_by_time (
			request_id TEXT NOT NULL,
			time INTEGER NOT NULL,
			key_name TEXT NOT NULL,
			user_name TEXT NOT NULL,
			group_name TEXT NOT NULL,
			channel_name TEXT NOT NULL,
			model TEXT NOT NULL,
			served_model TEXT NOT NULL,
			status INTEGER NOT NULL,
			cause TEXT NOT NULL,
			input_tokens INTEGER NOT NULL,
			output_tokens INTEGER NOT NULL,
			cache_read_tokens INTEGER NOT NULL,
			cache_write_tokens INTEGER NOT NULL,
			cost_nano_usd INTEGER NOT NULL,
			estimated INTEGER NOT NULL,
			incomplete INTEGER NOT NULL,
			session_digest TEXT NOT NULL,
			duration_ms INTEGER NOT NULL,
			first_byte_ms INTEGER NOT NULL,
			PRIMARY KEY (time, request_id)
		) WITHOUT ROWID;
		INSERT INTO relay_usage_by_time SELECT ` + strings.Join(ledgerColumns, ", ") + ` FROM relay_usage ORDER BY time, request_id;
		DROP TABLE relay_usage;
		ALTER TABLE relay_usage_by_time RENAME TO relay_usage;`,
		// each set of names once (see names.go), the rows keyed as
		// before, and the view of both
		namesMigration(`INTEGER PRIMARY KEY`, `CREATE TABLE relay_usage_rows (
			request_id TEXT NOT NULL,
			time INTEGER NOT NULL,
			names_id INTEGER NOT NULL,
			status INTEGER NOT NULL,
			input_tokens INTEGER NOT NULL,
			output_tokens INTEGER NOT NULL,
			cache_read_tokens INTEGER NOT NULL,
			cache_write_tokens INTEGER NOT NULL,
			cost_nano_usd INTEGER NOT NULL,
			estimated INTEGER NOT NULL,
			incomplete INTEGER NOT NULL,
			session_digest TEXT NOT NULL,
			duration_ms INTEGER NOT NULL,
			first_byte_ms INTEGER NOT NULL,
			PRIMARY KEY (time, request_id)
		) WITHOUT ROWID`, ``),
		// what server tools cost, a part of cost_nano_usd
		`DROP VIEW relay_usage;
		` + serverToolMigration(`INTEGER NOT NULL DEFAULT 0`, `CREATE VIEW`, `relay_usage.server_tool_nano_usd / 1e9`),
		// whether the cost is at an unpriced model's estimate
		`DROP VIEW relay_usage;
		` + estimatedPriceMigration(`BOOLEAN NOT NULL DEFAULT 0`, `CREATE VIEW`, `relay_usage.server_tool_nano_usd / 1e9`),
	},
	timeMilli: true,
	day:       `strftime('%Y-%m-%d', time / 1000, 'unixepoch')`,
	sum:       func(c string) string { return "COALESCE(SUM(" + c + "), 0)" },
	param:     func(int) string { return "?" },

	rawFirstTries: true,
}

// OpenSQLite opens (and makes) the SQLite ledger at path outside the
// pool, its schema brought up to date, for a writer of its own (Start) or
// a caller that reads and writes it itself, and closes it; digest is a
// session id as the rows keep it.
func OpenSQLite(path string, digest func(string) string) (Store, error) {
	s, err := openSQLiteStore(path, digest)
	if err != nil {
		return nil, err
	}
	return s, nil
}

// openSQLiteStore opens (and makes) the SQLite ledger at path, in WAL
// mode: a write is durable once its transaction commits, so a relay killed
// at any moment loses at most the rows it had not written yet (at most a
// second's), and readers (GET /relay/usage) never wait on the writer.
func openSQLiteStore(path string, digest func(string) string) (*sqlStore, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("ledger sqlite: %w", err)
	}
	q := url.Values{}
	for _, p := range []string{"journal_mode(WAL)", "synchronous(NORMAL)", "busy_timeout(" + strconv.Itoa(int(ledgerWriteTimeout/time.Millisecond)) + ")"} {
		q.Add("_pragma", p)
	}
	db, err := sql.Open("sqlite3", "file:"+path+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("ledger sqlite: %w", err)
	}
	db.SetMaxOpenConns(4) // one writer (the ledger's), readers beside it
	ctx, cancel := context.WithTimeout(context.Background(), ledgerWriteTimeout)
	defer cancel()
	s, err := newSQLStore(ctx, db, sqliteDialect, digest)
	if err != nil {
		return nil, fmt.Errorf("ledger sqlite %s: %w", path, err)
	}
	// as long again for the writer's statements, after a migration
	ctx, cancel = context.WithTimeout(context.Background(), ledgerWriteTimeout)
	defer cancel()
	if s.raw, err = newRawWriter(ctx, s); err != nil {
		_ = s.Close()
		return nil, fmt.Errorf("ledger sqlite %s: %w", path, err)
	}
	return s, nil
}
