package ledger

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

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

// migrate brings the schema to the version this relay writes: the steps
// it has not taken yet, each in a transaction with its version. A database
// of a newer version (a newer relay wrote it) is refused. ctx bounds
// reaching the database; the steps, which may rewrite every row of a large
// ledger (seconds a million rows), are bounded by ledgerMigrateTimeout.
func (s *sqlStore) migrate(ctx context.Context) error {
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

// namesRowColumns are relay_usage_rows' columns as the names table's step
// made them (schema version 4), which it fills from the table before.
var namesRowColumns = []string{
	"request_id", "time", "names_id", "status",
	"input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
	"cost_nano_usd", "estimated", "incomplete", "session_digest", "duration_ms", "first_byte_ms",
}

// ledgerRowColumns are relay_usage_rows' columns, in the order of a row's
// values (rowArgs): those of version 4, then the server tools' part of
// the cost (version 5), then whether the cost is at an unpriced model's
// estimate (version 6).
var ledgerRowColumns = append(slices.Clip(namesRowColumns), "server_tool_nano_usd", "estimated_price")

// namesMigration is the schema's step to the names table: relay_usage
// becomes relay_usage_rows (created by rowsTable, keyed by (time,
// request_id): Postgres adds its key in keyAfter, once the rows are in)
// and relay_usage_names (whose id is namesID), and the view relay_usage,
// which joins them into the row it was.
func namesMigration(namesID, rowsTable, keyAfter string) string {
	names := strings.Join(ledgerNameColumns, ", ")
	var create, on []string
	for _, c := range ledgerNameColumns {
		create = append(create, c+" TEXT NOT NULL")
		on = append(on, "n."+c+" = u."+c)
	}
	var fill []string
	for _, c := range namesRowColumns {
		if c == "names_id" {
			fill = append(fill, "n.id")
		} else {
			fill = append(fill, "u."+c)
		}
	}
	return `CREATE TABLE relay_usage_names (
			id ` + namesID + `,
			` + strings.Join(create, ",\n\t\t\t") + `,
			UNIQUE (` + names + `)
		);
		INSERT INTO relay_usage_names (` + names + `) SELECT DISTINCT ` + names + ` FROM relay_usage ORDER BY ` + names + `;
		` + rowsTable + `;
		INSERT INTO relay_usage_rows (` + strings.Join(namesRowColumns, ", ") + `)
			SELECT ` + strings.Join(fill, ", ") + `
			FROM relay_usage AS u JOIN relay_usage_names AS n ON ` + strings.Join(on, " AND ") + `
			ORDER BY u.time, u.request_id;
		DROP TABLE relay_usage;
		` + keyAfter + `
		` + ledgerViewSQL("CREATE VIEW") + `;`
}

// ledgerViewSQL makes the view relay_usage (create is CREATE VIEW or
// CREATE OR REPLACE VIEW): every row with its names, the columns of
// ledgerColumns, then the columns of more (each "<expression> AS <name>",
// of the rows, named relay_usage). The rows are named relay_usage in it,
// so that a query plan names the table it reads as the query does.
func ledgerViewSQL(create string, more ...string) string {
	sel := make([]string, len(ledgerColumns), len(ledgerColumns)+len(more))
	for i, c := range ledgerColumns {
		if slices.Contains(ledgerNameColumns, c) {
			sel[i] = "n." + c
		} else {
			sel[i] = "relay_usage." + c
		}
	}
	return create + ` relay_usage AS SELECT ` + strings.Join(append(sel, more...), ", ") + `
			FROM relay_usage_rows AS relay_usage JOIN relay_usage_names AS n ON n.id = relay_usage.names_id`
}

// ledgerViewColumns are the view's columns now: ledgerColumns, then what
// later steps added.
var ledgerViewColumns = append(slices.Clip(ledgerColumns), "server_tool_usd", "estimated_price")

// serverToolMigration is the schema's step to version 5: the rows keep
// the part of their cost that server tools made, in nano-USD (0 for the
// rows before it), which the view shows in US dollars as server_tool_usd
// (usd, the dialect's expression of it from server_tool_nano_usd).
// column is the rows' new column, as the dialect declares it; view makes
// the view again with it (a Postgres view is replaced, so that what was
// granted on it stays).
func serverToolMigration(column, view, usd string) string {
	return `ALTER TABLE relay_usage_rows ADD COLUMN server_tool_nano_usd ` + column + `;
		` + ledgerViewSQL(view, usd+" AS server_tool_usd") + `;`
}

// estimatedPriceMigration is the schema's step to version 6: a row says
// whether its cost is at the estimate of a model the price table did not
// know (false for the rows before it), which the view shows as
// estimated_price. column is the rows' new column, as the dialect declares
// it; view and usd make the view again as serverToolMigration does.
func estimatedPriceMigration(column, view, usd string) string {
	return `ALTER TABLE relay_usage_rows ADD COLUMN estimated_price ` + column + `;
		` + ledgerViewSQL(view, usd+" AS server_tool_usd", "relay_usage.estimated_price") + `;`
}
