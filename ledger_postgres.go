package relay

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // pgx's database/sql driver, "pgx"
)

// postgresDialect keeps time as timestamptz, so SQL users read it as a
// time.
var postgresDialect = dialect{
	migrations: []string{
		`CREATE TABLE relay_usage (
			request_id TEXT PRIMARY KEY,
			time TIMESTAMPTZ NOT NULL,
			key_name TEXT NOT NULL,
			user_name TEXT NOT NULL,
			group_name TEXT NOT NULL,
			channel_name TEXT NOT NULL,
			model TEXT NOT NULL,
			served_model TEXT NOT NULL,
			status INTEGER NOT NULL,
			cause TEXT NOT NULL,
			input_tokens BIGINT NOT NULL,
			output_tokens BIGINT NOT NULL,
			cache_read_tokens BIGINT NOT NULL,
			cache_write_tokens BIGINT NOT NULL,
			cost_nano_usd BIGINT NOT NULL,
			estimated BOOLEAN NOT NULL,
			incomplete BOOLEAN NOT NULL,
			session_digest TEXT NOT NULL,
			duration_ms BIGINT NOT NULL,
			first_byte_ms BIGINT NOT NULL
		);
		CREATE INDEX relay_usage_time ON relay_usage (time);`,
		dailyMigration(`to_char(time AT TIME ZONE 'UTC', 'YYYY-MM-DD')`),
		// the rows keyed by (time, request_id): the key's index is written
		// at its end as rows come in time order, where the key of random
		// request ids was written at a random leaf for every row; ranges of
		// time are read through the key, so the index on time goes
		`ALTER TABLE relay_usage DROP CONSTRAINT relay_usage_pkey;
		ALTER TABLE relay_usage ADD PRIMARY KEY (time, request_id);
		DROP INDEX relay_usage_time;`,
	},
	// relays of a fleet that start together migrate one after the other
	lock:    `SELECT pg_advisory_xact_lock(7251460934)`,
	timeArg: func(t time.Time) any { return t.UTC() },
	day:     `to_char(time AT TIME ZONE 'UTC', 'YYYY-MM-DD')`,
	sum:     func(c string) string { return "COALESCE(SUM(" + c + "), 0)::bigint" },
	param:   func(n int) string { return "$" + strconv.Itoa(n) },
}

// openPostgresLedger connects to the ledger's database and brings its
// schema up to date. The database must be up when the config loads (a
// config whose ledger cannot be reached fails to load, so the running one
// stays); once running, an outage only delays the rows.
func openPostgresLedger(dsn string) (*sqlLedger, error) {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("ledger postgres: the dsn does not parse") // the error may quote the dsn
	}
	db.SetMaxOpenConns(4)
	db.SetConnMaxIdleTime(time.Minute)
	ctx, cancel := context.WithTimeout(context.Background(), ledgerWriteTimeout)
	defer cancel()
	s, err := newSQLLedger(ctx, db, postgresDialect)
	if err != nil {
		return nil, fmt.Errorf("ledger postgres: %w", err)
	}
	return s, nil
}
