package ledger

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/pgtest"
)

func TestLedgerSQLiteMigratesToTheNamesTable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	db, err := sql.Open("sqlite3", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	checkMigrationToTheNamesTable(t, sqliteDialect, db, func() *sqlStore {
		s, err := openSQLiteStore(path, testDigest)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}, `SELECT type FROM sqlite_master WHERE name = 'relay_usage'`)
}

func TestLedgerPostgresMigratesToTheNamesTable(t *testing.T) {
	pg := pgtest.Start(t)
	db, err := sql.Open("pgx", pg.DSN())
	if err != nil {
		t.Fatal(err)
	}
	checkMigrationToTheNamesTable(t, postgresDialect, db, func() *sqlStore {
		s, err := openPostgresStore(pg.DSN(), testDigest)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}, `SELECT CASE WHEN table_type = 'VIEW' THEN 'view' ELSE table_type END FROM information_schema.tables WHERE table_name = 'relay_usage'`)
}

// checkMigrationToTheNamesTable fills db, migrated to schema version 3
// (the rows in one table of twenty columns), with rows over three days;
// then opens it as the relay does (open), which moves them to
// relay_usage_rows and relay_usage_names: relay_usage, a view now (kind
// tells what it is), must return every row with the values it had, and
// the usage queries must answer what they did. New rows of names known
// and unknown are then written once each, with one names row a set of
// names.
func checkMigrationToTheNamesTable(t *testing.T, d dialect, db *sql.DB, open func() *sqlStore, kind string) {
	t.Helper()
	ctx := context.Background()
	old := &sqlStore{db: db, d: d, digests: map[string]any{}}
	old.d.migrations = d.migrations[:3]
	if err := old.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	rows := append(benchRows(600, usageEpoch, 0), testRows(usageEpoch.Add(time.Hour), usageEpoch.Add(30*time.Hour))...)
	for i := range 600 {
		rows[i].At = usageEpoch.Add(time.Duration(i) * 7 * time.Minute) // three days
		rows[i].ID = newRequestID()
		rows[i].User = fmt.Sprintf("user-%d", i%7)
		rows[i].Estimated, rows[i].Incomplete = i%5 == 0, i%11 == 0
		rows[i].Session = fmt.Sprintf("session-%d", i%13)
	}
	insertOldRows(t, old, rows)
	// the rollup as version 3's writer kept it: from the rows
	if _, err := db.Exec(`DELETE FROM relay_usage_daily`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`INSERT INTO relay_usage_daily SELECT ` + d.day + `, key_name, user_name, group_name, channel_name, served_model, COUNT(*),
		SUM(input_tokens), SUM(output_tokens), SUM(cache_read_tokens), SUM(cache_write_tokens), SUM(cost_nano_usd)
		FROM relay_usage GROUP BY 1, 2, 3, 4, 5, 6`); err != nil {
		t.Fatal(err)
	}
	queries := []Query{
		{From: usageEpoch, To: usageEpoch.AddDate(0, 0, 3), GroupBy: []string{"key", "user", "day"}},
		{From: usageEpoch.Add(5 * time.Hour), To: usageEpoch.Add(50 * time.Hour), GroupBy: []string{"group", "model", "channel"}},
		{From: usageEpoch.Add(90 * time.Minute), To: usageEpoch.Add(3 * time.Hour)},
	}
	answers := func(s *sqlStore) []string {
		var all []string
		for _, q := range queries {
			all = append(all, strings.Join(collectUsage(t, func(emit func(UsageRow) error) error { return s.Usage(ctx, q, emit) }), "\n"))
		}
		return all
	}
	all := `SELECT * FROM relay_usage ORDER BY request_id`
	tableBefore := dumpRows(t, db, all)
	dailyBefore := dumpRows(t, db, `SELECT * FROM relay_usage_daily ORDER BY day, key_name, user_name, group_name, channel_name, served_model`)
	answersBefore := answers(old)
	var tuples int
	if err := db.QueryRow(`SELECT COUNT(*) FROM (SELECT DISTINCT ` + strings.Join(ledgerNameColumns, ", ") + ` FROM relay_usage) AS t`).Scan(&tuples); err != nil {
		t.Fatal(err)
	}
	if len(tableBefore) != len(rows) || tuples < 100 {
		t.Fatalf("version 3 holds %d rows of %d sets of names, want %d rows, of a hundred sets or more", len(tableBefore), tuples, len(rows))
	}
	_ = db.Close()

	s := open()
	defer s.Close()
	var v int
	if err := s.db.QueryRow(`SELECT MAX(version) FROM schema_version`).Scan(&v); err != nil || v != len(d.migrations) {
		t.Fatalf("schema_version %d (%v), want %d", v, err, len(d.migrations))
	}
	var what string
	if err := s.db.QueryRow(kind).Scan(&what); err != nil || what != "view" {
		t.Errorf("relay_usage is a %q (%v), want a view", what, err)
	}
	// the view's columns of that version, with the values they had (the
	// columns added since follow them)
	got := dumpRows(t, s.db, `SELECT `+strings.Join(ledgerColumns, ", ")+` FROM relay_usage ORDER BY request_id`)
	if !slices.Equal(got, tableBefore) {
		t.Errorf("the view returns %d rows, want the %d of the table, with the same values", len(got), len(tableBefore))
		for i := range min(len(got), len(tableBefore), 3) {
			t.Logf("got  %s\nwant %s", got[i], tableBefore[i])
		}
	}
	if cols := dumpColumns(t, s.db, all); !slices.Equal(cols, ledgerViewColumns) {
		t.Errorf("the view's columns are %v, want %v", cols, ledgerViewColumns)
	}
	if got := dumpRows(t, s.db, `SELECT * FROM relay_usage_daily ORDER BY day, key_name, user_name, group_name, channel_name, served_model`); !slices.Equal(got, dailyBefore) {
		t.Errorf("the rollup changed in the migration")
	}
	if got := answers(s); !slices.Equal(got, answersBefore) {
		t.Errorf("the usage queries answer\n%s\nwant, as before the migration,\n%s", strings.Join(got, "\n--\n"), strings.Join(answersBefore, "\n--\n"))
	}
	if n := countOf(t, s.db, `relay_usage_names`); n != tuples {
		t.Errorf("%d names rows, want one a set of names: %d", n, tuples)
	}
	// rows of names the migration moved, and of new ones, are written
	// once, each set of names once
	again := slices.Clone(rows[100:110])
	for i := range again {
		again[i].ID += "-again"
	}
	again = append(again, Row{ID: "new", At: usageEpoch.Add(time.Hour), Key: "k9", Group: "g", Status: 200, CostNano: 5},
		Row{ID: "new-2", At: usageEpoch.Add(time.Hour), Key: "k9", Group: "g", Status: 200, CostNano: 5})
	if err := s.Write(ctx, again); err != nil {
		t.Fatal(err)
	}
	if n := countOf(t, s.db, `relay_usage_names`); n != tuples+1 {
		t.Errorf("%d names rows, want %d: those of the migration and k9's", n, tuples+1)
	}
	if n := countOf(t, s.db, `relay_usage`); n != len(rows)+len(again) {
		t.Errorf("%d rows, want %d", n, len(rows)+len(again))
	}
	if got := dumpRows(t, s.db, `SELECT key_name, user_name, group_name, channel_name, model, served_model, cause FROM relay_usage WHERE request_id LIKE '%-again' ORDER BY request_id`); len(got) != 10 {
		t.Errorf("the rows written again with known names: %d, want 10", len(got))
	}
}

// dumpColumns are the names of query's columns.
func dumpColumns(t *testing.T, db *sql.DB, query string) []string {
	t.Helper()
	rows, err := db.Query(query)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	cols, err := rows.Columns()
	if err != nil {
		t.Fatal(err)
	}
	return cols
}

// countOf is the number of rows of table.
func countOf(t *testing.T, db *sql.DB, table string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT COUNT(*) FROM ` + table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestLedgerPostgresWritersAddTheSameNamesAtOnce: two relays of a fleet
// (two writers on one database) write, at the same moment and in opposite
// orders, batches of rows with the same names, new to both, then known to
// both: neither fails (they wait for each other, never deadlock), every
// row is written once, each set of names has one names row, and the
// rollup counts every row once.
func TestLedgerPostgresWritersAddTheSameNamesAtOnce(t *testing.T) {
	pg := pgtest.Start(t)
	var writers [2]*sqlStore
	for i := range writers {
		s, err := openPostgresStore(pg.DSN(), testDigest)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		writers[i] = s
	}
	ctx := context.Background()
	// ten rounds of names new to both writers, then ten of names both
	// know, where each writer goes straight to the rows and the rollup
	const rounds, newRounds, perBatch = 20, 10, 300
	var all []Row
	for round := range rounds {
		var batches [2][]Row
		for w := range batches {
			batches[w] = benchRows(perBatch, usageEpoch, round*perBatch)
			for i := range batches[w] {
				r := &batches[w][i]
				r.ID = fmt.Sprintf("w%d-%s", w, r.ID)
				r.User = fmt.Sprintf("user-%d-%d", min(round, newRounds-1), i%40) // the same for both
			}
			if w == 1 {
				slices.Reverse(batches[w]) // in another order
			}
			all = append(all, batches[w]...)
		}
		start := make(chan struct{})
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for w := range writers {
			wg.Go(func() {
				<-start
				errs[w] = writers[w].Write(ctx, batches[w])
			})
		}
		close(start)
		wg.Wait()
		for w, err := range errs {
			if err != nil {
				t.Fatalf("round %d: writer %d: %v", round, w, err)
			}
		}
	}
	db := writers[0].db
	if n := countOf(t, db, `relay_usage`); n != len(all) {
		t.Errorf("%d rows, want %d", n, len(all))
	}
	if n := countOf(t, db, `relay_usage_rows`); n != len(all) {
		t.Errorf("%d rows in relay_usage_rows, want %d", n, len(all))
	}
	var tuples, names int
	if err := db.QueryRow(`SELECT COUNT(*) FROM (SELECT DISTINCT ` + strings.Join(ledgerNameColumns, ", ") + ` FROM relay_usage) AS t`).Scan(&tuples); err != nil {
		t.Fatal(err)
	}
	names = countOf(t, db, `relay_usage_names`)
	if names != tuples || tuples < newRounds*40 {
		t.Errorf("%d names rows for %d sets of names, want one each (%d or more)", names, tuples, newRounds*40)
	}
	// each row with its own names
	checkRowNames(t, db, all)
	day := Query{From: usageEpoch, To: usageEpoch.AddDate(0, 1, 0), GroupBy: []string{"key", "user", "group", "channel", "model"}}
	fromRollup := collectUsage(t, func(emit func(UsageRow) error) error { return writers[1].Usage(ctx, day, emit) })
	if want := sumRows(all, day.From, day.To, day.GroupBy); !sameSet(fromRollup, want) {
		t.Errorf("the rollup does not count each row once")
	}
}

// failingInsert makes the insert of a row whose request id is 'boom' fail,
// in the statement, after the batch's names were added.
var failingInsert = map[string][]string{
	"sqlite": {`CREATE TRIGGER boom BEFORE INSERT ON relay_usage_rows WHEN NEW.request_id = 'boom' BEGIN SELECT RAISE(ABORT, 'boom'); END`},
	"postgres": {
		`CREATE FUNCTION boom() RETURNS trigger AS $$ BEGIN IF NEW.request_id = 'boom' THEN RAISE EXCEPTION 'boom'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql`,
		`CREATE TRIGGER boom BEFORE INSERT ON relay_usage_rows FOR EACH ROW EXECUTE FUNCTION boom()`,
	},
}

func TestLedgerSQLiteNamesOfAFailedWriteAreForgotten(t *testing.T) {
	s, err := openSQLiteStore(filepath.Join(t.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	checkNamesOfAFailedWrite(t, s, failingInsert["sqlite"])
}

func TestLedgerPostgresNamesOfAFailedWriteAreForgotten(t *testing.T) {
	pg := pgtest.Start(t)
	s, err := openPostgresStore(pg.DSN(), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	checkNamesOfAFailedWrite(t, s, failingInsert["postgres"])
}

// checkNamesOfAFailedWrite: a write whose transaction added names, then
// failed (fail makes the insert of row 'boom' fail), added none: the
// writer forgets their ids, and the next writes, the failed batch's again
// and another after it, write every row once with its names.
func checkNamesOfAFailedWrite(t *testing.T, s *sqlStore, fail []string) {
	t.Helper()
	ctx := context.Background()
	if err := s.Write(ctx, benchRows(10, usageEpoch, 0)); err != nil {
		t.Fatal(err)
	}
	known := len(s.names)
	for _, q := range fail {
		if _, err := s.db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	rows := benchRows(200, usageEpoch, 1000)
	for i := range rows {
		rows[i].User = fmt.Sprintf("new-user-%d", i%20)
	}
	rows[150].ID = "boom"
	if err := s.Write(ctx, rows); err == nil || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("the write with a failing row: %v", err)
	}
	if len(s.names) != known || len(s.learned) != 0 {
		t.Errorf("after a failed write the writer knows %d names (%d learned), want the %d it knew", len(s.names), len(s.learned), known)
	}
	if n := countOf(t, s.db, `relay_usage_names`); n != known {
		t.Errorf("%d names rows after a failed write, want %d", n, known)
	}
	if _, err := s.db.Exec(`DROP TRIGGER boom` + map[bool]string{true: " ON relay_usage_rows"}[s.d.shared]); err != nil {
		t.Fatal(err)
	}
	// the batch again (the retry, through RETURNING), then a new one of
	// the same names (a first try)
	if err := s.Write(ctx, rows); err != nil {
		t.Fatal(err)
	}
	more := benchRows(200, usageEpoch, 2000)
	for i := range more {
		more[i].User = fmt.Sprintf("new-user-%d", i%20)
	}
	if err := s.Write(ctx, more); err != nil || s.retrying {
		t.Fatalf("the write after: %v, retrying %v", err, s.retrying)
	}
	all := append(append(benchRows(10, usageEpoch, 0), rows...), more...)
	if n := countOf(t, s.db, `relay_usage`); n != len(all) {
		t.Errorf("%d rows, want %d", n, len(all))
	}
	checkRowNames(t, s.db, all)
	var tuples int
	if err := s.db.QueryRow(`SELECT COUNT(*) FROM (SELECT DISTINCT ` + strings.Join(ledgerNameColumns, ", ") + ` FROM relay_usage) AS t`).Scan(&tuples); err != nil {
		t.Fatal(err)
	}
	if n := countOf(t, s.db, `relay_usage_names`); n != tuples || len(s.names) != tuples {
		t.Errorf("%d names rows, the writer knows %d, want one a set of names: %d", n, len(s.names), tuples)
	}
	day := Query{From: usageEpoch, To: usageEpoch.AddDate(0, 1, 0), GroupBy: []string{"key", "user", "group", "channel", "model"}}
	fromRollup := collectUsage(t, func(emit func(UsageRow) error) error { return s.Usage(ctx, day, emit) })
	if want := sumRows(all, day.From, day.To, day.GroupBy); !sameSet(fromRollup, want) {
		t.Errorf("the rollup does not count each row once")
	}
}

// TestLedgerNamesMapIsBounded: past ledgerNamesKept names, the writer's
// map is dropped and its ids read again from the database.
func TestLedgerNamesMapIsBounded(t *testing.T) {
	s, err := openSQLiteStore(filepath.Join(t.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	rows := benchRows(100, usageEpoch, 0)
	if err := s.Write(ctx, rows); err != nil {
		t.Fatal(err)
	}
	for i := range ledgerNamesKept + 1 {
		s.names[ledgerNames{key: fmt.Sprint("filler-", i)}] = int64(-i)
	}
	more := benchRows(100, usageEpoch, 100)
	if err := s.Write(ctx, more); err != nil {
		t.Fatal(err)
	}
	if len(s.names) > 100 {
		t.Errorf("the writer knows %d names, want the map dropped past %d and the batch's read again", len(s.names), ledgerNamesKept)
	}
	if n := countOf(t, s.db, `relay_usage`); n != 200 {
		t.Errorf("%d rows, want 200", n)
	}
}

// TestLedgerSQLitePruneKeepsTheNames: pruning deletes rows, never names,
// so the ids the writer knows stay good: rows of the same names written
// after a prune read back with their names.
func TestLedgerSQLitePruneKeepsTheNames(t *testing.T) {
	s, err := openSQLiteStore(filepath.Join(t.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	if err := s.Write(ctx, benchRows(100, usageEpoch, 0)); err != nil {
		t.Fatal(err)
	}
	names := countOf(t, s.db, "relay_usage_names")
	if n, err := s.Prune(ctx, usageEpoch.AddDate(1, 0, 0)); err != nil || n != 100 {
		t.Fatalf("pruned %d rows (%v), want 100", n, err)
	}
	if n := countOf(t, s.db, "relay_usage_names"); n != names || countOf(t, s.db, "relay_usage") != 0 {
		t.Fatalf("after pruning every row: %d names rows, want the %d there were", n, names)
	}
	later := benchRows(100, usageEpoch.AddDate(1, 0, 0), 0)
	for i := range later {
		later[i].ID += "-later"
	}
	if err := s.Write(ctx, later); err != nil {
		t.Fatal(err)
	}
	got := dumpRows(t, s.db, `SELECT request_id, key_name, user_name, group_name, channel_name, model, served_model, cause FROM relay_usage ORDER BY request_id`)
	var want []string
	for _, r := range later {
		want = append(want, fmt.Sprint(r.ID, r.Key, r.User, r.Group, r.Channel, r.Model, r.Served, r.Cause))
	}
	if !slices.Equal(got, want) {
		t.Errorf("the rows written after the prune: %d with their names, want %d", len(got), len(want))
	}
}

// checkRowNames fails unless the rows of db are those of all, each with its
// own names.
func checkRowNames(t *testing.T, db *sql.DB, all []Row) {
	t.Helper()
	got := dumpRows(t, db, `SELECT request_id, key_name, user_name, group_name, channel_name, model, served_model, cause FROM relay_usage ORDER BY request_id`)
	var want []string
	for _, r := range all {
		want = append(want, fmt.Sprint(r.ID, r.Key, r.User, r.Group, r.Channel, r.Model, r.Served, r.Cause))
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("the rows' names are not those written (%d rows, want %d)", len(got), len(want))
	}
}
