package ledger

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/pgtest"
)

func TestLedgerSQLiteMigratesToTheTimeKey(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	db, err := sql.Open("sqlite3", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	checkMigrationToTheTimeKey(t, sqliteDialect, db, func() *sqlStore {
		s, err := openSQLiteStore(path, testDigest)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}, `SELECT COUNT(*) FROM sqlite_master WHERE name = 'relay_usage_time'`)
}

func TestLedgerPostgresMigratesToTheTimeKey(t *testing.T) {
	pg := pgtest.Start(t)
	db, err := sql.Open("pgx", pg.DSN())
	if err != nil {
		t.Fatal(err)
	}
	checkMigrationToTheTimeKey(t, postgresDialect, db, func() *sqlStore {
		s, err := openPostgresStore(pg.DSN(), testDigest)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}, `SELECT COUNT(*) FROM pg_indexes WHERE indexname = 'relay_usage_time'`)
}

// checkMigrationToTheTimeKey fills db, migrated to schema version 2 (rows
// keyed by request id, an index on time), with rows over three days; then
// opens it as the relay does (open), which migrates it to the key (time,
// request_id): its rows and its rollup must be what they were, the usage
// queries must answer what they did, the index on time must be gone, and
// a batch of rows written before, written again, must be kept once.
func checkMigrationToTheTimeKey(t *testing.T, d dialect, db *sql.DB, open func() *sqlStore, timeIndexCount string) {
	t.Helper()
	ctx := context.Background()
	old := &sqlStore{db: db, d: d, digests: map[string]any{}}
	old.d.migrations = d.migrations[:1]
	if err := old.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	// version 1's rows, written with its insert (keyed by request id)
	rows := append(benchRows(600, usageEpoch, 0), testRows(usageEpoch.Add(time.Hour), usageEpoch.Add(30*time.Hour))...)
	for i := range 600 {
		rows[i].At = usageEpoch.Add(time.Duration(i) * 7 * time.Minute) // three days
		rows[i].ID = newRequestID()
	}
	insertOldRows(t, old, rows)
	// version 2 adds the rollup, filled from those rows
	old.d.migrations = d.migrations[:2]
	if err := old.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	queries := []Query{
		{From: usageEpoch, To: usageEpoch.AddDate(0, 0, 3), GroupBy: []string{"key", "day"}},
		{From: usageEpoch.Add(5 * time.Hour), To: usageEpoch.Add(50 * time.Hour), GroupBy: []string{"group", "model", "user"}},
		{From: usageEpoch.Add(90 * time.Minute), To: usageEpoch.Add(3 * time.Hour)},
	}
	answers := func(s *sqlStore) []string {
		var all []string
		for _, q := range queries {
			all = append(all, strings.Join(collectUsage(t, func(emit func(UsageRow) error) error { return s.Usage(ctx, q, emit) }), "\n"))
		}
		return all
	}
	cols := strings.Join(ledgerColumns, ", ")
	tableBefore := dumpRows(t, db, `SELECT `+cols+` FROM relay_usage ORDER BY request_id`)
	dailyBefore := dumpRows(t, db, `SELECT * FROM relay_usage_daily ORDER BY day, key_name, user_name, group_name, channel_name, served_model`)
	answersBefore := answers(old)
	if len(tableBefore) != len(rows) || len(dailyBefore) < 100 {
		t.Fatalf("version 2 holds %d rows and %d rollup rows, want %d and a hundred or more", len(tableBefore), len(dailyBefore), len(rows))
	}
	_ = db.Close()

	s := open()
	defer s.Close()
	var v int
	if err := s.db.QueryRow(`SELECT MAX(version) FROM schema_version`).Scan(&v); err != nil || v != len(d.migrations) {
		t.Fatalf("schema_version %d (%v), want %d", v, err, len(d.migrations))
	}
	if got := dumpRows(t, s.db, `SELECT `+cols+` FROM relay_usage ORDER BY request_id`); !slices.Equal(got, tableBefore) {
		t.Errorf("the rows changed in the migration: %d rows, want %d", len(got), len(tableBefore))
	}
	if got := dumpRows(t, s.db, `SELECT * FROM relay_usage_daily ORDER BY day, key_name, user_name, group_name, channel_name, served_model`); !slices.Equal(got, dailyBefore) {
		t.Errorf("the rollup changed in the migration")
	}
	if got := answers(s); !slices.Equal(got, answersBefore) {
		t.Errorf("the usage queries answer\n%s\nwant, as before the migration,\n%s", strings.Join(got, "\n--\n"), strings.Join(answersBefore, "\n--\n"))
	}
	var n int
	if err := s.db.QueryRow(timeIndexCount).Scan(&n); err != nil || n != 0 {
		t.Errorf("the index on time is still there (%d, %v)", n, err)
	}
	// rows written before, written again (a lost commit retried), are
	// kept once, in the rows and in the rollup; new rows are added
	again := append(slices.Clone(rows[100:110]), Row{ID: "new", At: usageEpoch.Add(time.Hour), Key: "k9", Group: "g", Status: 200, CostNano: 5})
	if err := s.Write(ctx, again); err != nil {
		t.Fatal(err)
	}
	if got := dumpRows(t, s.db, `SELECT `+cols+` FROM relay_usage WHERE request_id <> 'new' ORDER BY request_id`); !slices.Equal(got, tableBefore) {
		t.Errorf("rows written again changed the table")
	}
	if got := answers(s); slices.Equal(got, answersBefore) || !strings.Contains(got[0], "k9|2026-03-01 1 0 0 0 0 0.000000005") {
		t.Errorf("the new row is not counted:\n%s", strings.Join(got, "\n--\n"))
	}
	if err := s.db.QueryRow(`SELECT COUNT(*) FROM relay_usage`).Scan(&n); err != nil || n != len(rows)+1 {
		t.Errorf("%d rows (%v), want %d", n, err, len(rows)+1)
	}
}

// insertOldRows writes rows to the table relay_usage of a schema before
// the names table (versions 1 to 3), whose columns were ledgerColumns.
func insertOldRows(t *testing.T, old *sqlStore, rows []Row) {
	t.Helper()
	for i := 0; i < len(rows); i += 100 {
		chunk := rows[i:min(i+100, len(rows))]
		var args []any
		for _, r := range chunk {
			session := r.Session
			if !r.SessionDigested {
				session = testDigest(session)
			}
			args = append(args, r.ID, old.d.timeArg(r.At), r.Key, r.User, r.Group, r.Channel,
				r.Model, r.Served, int64(r.Status), r.Cause,
				r.Input, r.Output, r.CacheRead, r.CacheWrite,
				r.CostNano, r.Estimated, r.Incomplete, session,
				r.Duration.Milliseconds(), r.FirstByte.Milliseconds())
		}
		q := "INSERT INTO relay_usage (" + strings.Join(ledgerColumns, ", ") + ") VALUES " + old.valuesSQL(len(chunk), len(ledgerColumns))
		if _, err := old.db.Exec(q, args...); err != nil {
			t.Fatal(err)
		}
	}
}

// dumpRows is every row of query, each as one line.
func dumpRows(t *testing.T, db *sql.DB, query string) []string {
	t.Helper()
	rows, err := db.Query(query)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	cols, _ := rows.Columns()
	vals := make([]any, len(cols))
	ptrs := make([]any, len(cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	var out []string
	for rows.Next() {
		if err := rows.Scan(ptrs...); err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprint(vals...))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestLedgerSQLiteRowsWrittenAgainCountOnce: a write after a failed one,
// a first try that meets rows written already (a batch whose commit was
// lost, written again with new rows), and one whose connection is gone,
// keep each request once in the rows and in the rollup, which agree.
func TestLedgerSQLiteRowsWrittenAgainCountOnce(t *testing.T) {
	s, err := openSQLiteStore(filepath.Join(t.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rows := benchRows(400, usageEpoch, 0)
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Write(canceled, rows[:100]); err == nil || !s.retrying {
		t.Fatalf("a write with a canceled context: %v, retrying %v", err, s.retrying)
	}
	ctx := context.Background()
	for _, w := range [][]Row{
		rows[:100],   // after a failed write: RETURNING
		rows[50:150], // a first try, half of it written already
		rows[:300],   // the same, a third of it new
		rows[:300],   // all of it written already
	} {
		if err := s.Write(ctx, w); err != nil {
			t.Fatal(err)
		}
		if s.retrying {
			t.Errorf("still retrying after a write that succeeded")
		}
	}
	// the driver's own connection, which first tries go through, lost:
	// the write goes through database/sql's pool at once
	if s.raw == nil {
		t.Fatal("a SQLite ledger without its own connection")
	}
	_ = s.raw.conn.Close()
	if err := s.Write(ctx, rows[250:400]); err != nil || s.retrying {
		t.Fatalf("a write after the writer's connection closed: %v, retrying %v", err, s.retrying)
	}
	day := Query{From: usageEpoch, To: usageEpoch.AddDate(0, 0, 1), GroupBy: []string{"key", "group", "channel", "model"}}
	fromRollup := collectUsage(t, func(emit func(UsageRow) error) error { return s.Usage(ctx, day, emit) })
	fromRows := collectUsage(t, func(emit func(UsageRow) error) error {
		return s.usageOf(ctx, day.GroupBy, []usageSpan{{from: day.From, to: day.To}}, emit)
	})
	if want := sumRows(rows, day.From, day.To, day.GroupBy); !sameSet(fromRows, want) || !slices.Equal(fromRollup, fromRows) {
		t.Errorf("the rollup sums\n%s\nthe rows\n%s\nwant each row once\n%s", strings.Join(fromRollup, "\n"), strings.Join(fromRows, "\n"), strings.Join(want, "\n"))
	}
}

func TestLedgerSQLiteMigratesToServerToolCost(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	db, err := sql.Open("sqlite3", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	checkMigrationToServerToolCost(t, sqliteDialect, db, func() *sqlStore {
		s, err := openSQLiteStore(path, testDigest)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}, "")
}

func TestLedgerPostgresMigratesToServerToolCost(t *testing.T) {
	pg := pgtest.Start(t)
	db, err := sql.Open("pgx", pg.DSN())
	if err != nil {
		t.Fatal(err)
	}
	checkMigrationToServerToolCost(t, postgresDialect, db, func() *sqlStore {
		s, err := openPostgresStore(pg.DSN(), testDigest)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}, "relay_finance")
}

// checkMigrationToServerToolCost fills db, migrated to schema version 4
// (the names table: rows moved there by its step), with rows over three
// days, and grants reader (when set, a Postgres role made for it) SELECT
// on the view; then opens it as the relay does (open), which adds the
// server tools' cost: the view's columns of version 4 must return what
// they did, server_tool_usd follow them, 0 on every row written before,
// the usage queries answer what they did, the reader may still read the
// view, and a new row keep its server tools' cost.
func checkMigrationToServerToolCost(t *testing.T, d dialect, db *sql.DB, open func() *sqlStore, reader string) {
	t.Helper()
	ctx := context.Background()
	old := &sqlStore{db: db, d: d, digests: map[string]any{}}
	old.d.migrations = d.migrations[:3]
	if err := old.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	rows := append(benchRows(300, usageEpoch, 0), testRows(usageEpoch.Add(time.Hour), usageEpoch.Add(30*time.Hour))...)
	for i := range 300 {
		rows[i].At = usageEpoch.Add(time.Duration(i) * 13 * time.Minute) // three days
		rows[i].ID = newRequestID()
	}
	insertOldRows(t, old, rows)
	if _, err := db.Exec(`INSERT INTO relay_usage_daily SELECT ` + d.day + `, key_name, user_name, group_name, channel_name, served_model, COUNT(*),
		SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), SUM(cache_write_tokens), SUM(cost_nano_usd)
		FROM relay_usage GROUP BY 1, 2, 3, 4, 5, 6`); err != nil {
		t.Fatal(err)
	}
	old.d.migrations = d.migrations[:4]
	if err := old.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if reader != "" {
		for _, q := range []string{`CREATE ROLE ` + reader, `GRANT SELECT ON relay_usage TO ` + reader} {
			if _, err := db.Exec(q); err != nil {
				t.Fatal(err)
			}
		}
	}
	queries := []Query{
		{From: usageEpoch, To: usageEpoch.AddDate(0, 0, 3), GroupBy: []string{"key", "day"}},
		{From: usageEpoch.Add(90 * time.Minute), To: usageEpoch.Add(50 * time.Hour), GroupBy: []string{"group", "model"}},
	}
	answers := func(s *sqlStore) []string {
		var all []string
		for _, q := range queries {
			all = append(all, strings.Join(collectUsage(t, func(emit func(UsageRow) error) error { return s.Usage(ctx, q, emit) }), "\n"))
		}
		return all
	}
	version4 := `SELECT ` + strings.Join(ledgerColumns, ", ") + ` FROM relay_usage ORDER BY request_id`
	before, answersBefore := dumpRows(t, db, version4), answers(old)
	if len(before) != len(rows) {
		t.Fatalf("version 4 holds %d rows, want %d", len(before), len(rows))
	}
	_ = db.Close()

	s := open()
	defer s.Close()
	var v int
	if err := s.db.QueryRow(`SELECT MAX(version) FROM schema_version`).Scan(&v); err != nil || v != 6 || v != len(d.migrations) {
		t.Fatalf("schema_version %d (%v), want 6 (the server tools' cost, then the estimated price)", v, err)
	}
	if got := dumpRows(t, s.db, version4); !slices.Equal(got, before) {
		t.Errorf("the view's columns of version 4 changed in the migration")
	}
	if cols := dumpColumns(t, s.db, `SELECT * FROM relay_usage`); !slices.Equal(cols, ledgerViewColumns) {
		t.Errorf("the view's columns are %v, want %v", cols, ledgerViewColumns)
	}
	var n int
	if err := s.db.QueryRow(`SELECT COUNT(*) FROM relay_usage WHERE server_tool_usd = 0 AND NOT estimated_price`).Scan(&n); err != nil || n != len(rows) {
		t.Errorf("%d rows (%v) have server_tool_usd 0 and no estimated_price, want every one written before: %d", n, err, len(rows))
	}
	if got := answers(s); !slices.Equal(got, answersBefore) {
		t.Errorf("the usage queries answer\n%s\nwant, as before the migration,\n%s", strings.Join(got, "\n--\n"), strings.Join(answersBefore, "\n--\n"))
	}
	if reader != "" {
		var may bool
		if err := s.db.QueryRow(`SELECT has_table_privilege('` + reader + `', 'relay_usage', 'SELECT')`).Scan(&may); err != nil || !may {
			t.Errorf("%s may no longer read relay_usage (%v): the migration dropped its grant", reader, err)
		}
	}
	row := Row{ID: "searched", At: usageEpoch.Add(time.Hour), Key: "k9", Group: "g", Status: 200, CostNano: 502_000_000, ToolNano: 500_000_000, EstimatedPrice: true}
	if err := s.Write(ctx, []Row{row}); err != nil {
		t.Fatal(err)
	}
	var nano int64
	var usd float64
	var est bool
	if err := s.db.QueryRow(`SELECT cost_nano_usd, server_tool_usd, estimated_price FROM relay_usage WHERE request_id = 'searched'`).Scan(&nano, &usd, &est); err != nil || nano != 502_000_000 || usd != 0.5 || !est {
		t.Errorf("a new row reads cost_nano_usd %d, server_tool_usd %v, estimated_price %v (%v), want 502000000, 0.5 and true", nano, usd, est, err)
	}
}
