package ledger

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// fileRows counts the rows of the SQLite ledger at path, read through a
// connection of its own (none when there is no file, or no table).
func fileRows(t *testing.T, path string) int {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		return -1
	}
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var n int
	if err := db.QueryRow(`SELECT COUNT(*) FROM relay_usage`).Scan(&n); err != nil {
		return -1
	}
	return n
}

// rowsNamed are n rows of a minute ago, their ids prefix-0, prefix-1, ...
func rowsNamed(prefix string, n int) []Row {
	rows := make([]Row, n)
	for i := range rows {
		rows[i] = Row{At: time.Now().Add(-time.Minute), ID: fmt.Sprintf("%s-%d", prefix, i), Key: "k", Group: "g",
			Channel: "c", Model: "claude-sonnet-4-5", Served: "claude-sonnet-4-5", Cause: causeOK, Status: 200, CostNano: 1000}
	}
	return rows
}

// runningFileLedger starts a ledger's writer on a SQLite file at path, as
// the relay does; the logs it writes are returned.
func runningFileLedger(t *testing.T, path string) (*Writer, *observer.ObservedLogs) {
	t.Helper()
	store, err := openSQLiteFile(path, testDigest)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	l := newWriter(store, "sqlite "+path, zap.New(core), Queue)
	go l.run()
	t.Cleanup(func() { _ = l.Destruct() })
	return l, logs
}

// TestLedgerNoticesItsFileDeleted runs a ledger's writer on a SQLite file,
// writes three rows, and deletes the file (with its WAL and shared memory,
// as rm ledger.db* does) under it: the rows written next are in a new file
// at the path, made with the schema, which the usage queries read; the three
// rows that went with the old file are counted lost, once, and logged at
// error level.
func TestLedgerNoticesItsFileDeleted(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	l, logs := runningFileLedger(t, path)
	lost := testutil.ToFloat64(metricLost)
	for _, r := range rowsNamed("before", 3) {
		l.Add(r)
	}
	waitFor(t, "the first rows in the file", 10*time.Second, func() bool { return fileRows(t, path) == 3 })
	for _, suffix := range []string{"", "-wal", "-shm"} {
		if err := os.Remove(path + suffix); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range rowsNamed("after", 2) {
		l.Add(r)
	}
	waitFor(t, "the later rows in a new file", 10*time.Second, func() bool { return fileRows(t, path) == 2 })
	if got := testutil.ToFloat64(metricLost) - lost; got != 3 {
		t.Errorf("relay_ledger_rows_lost_total grew by %v, want the deleted file's 3 rows", got)
	}
	gone := logs.FilterMessageSnippet("deleted or replaced").All()
	if len(gone) != 1 || gone[0].Level != zapcore.ErrorLevel || gone[0].ContextMap()["rows_lost"] != int64(3) || gone[0].ContextMap()["ledger"] != "sqlite "+path {
		t.Errorf("the log of the deleted file: %+v", gone)
	}
	var got []string
	err := l.store.Usage(context.Background(), Query{From: time.Now().Add(-time.Hour), To: time.Now().Add(time.Hour), GroupBy: []string{"key"}},
		func(u UsageRow) error { got = append(got, usageLine(u.Values, u)); return nil })
	if err != nil || strings.Join(got, ",") != "k 2 0 0 0 0 0.000002" {
		t.Errorf("usage after the file was made again: %v %v, want the 2 later rows", got, err)
	}
	// and it goes on writing to the new file, which nothing more is lost with
	for _, r := range rowsNamed("later", 4) {
		l.Add(r)
	}
	waitFor(t, "more rows in the new file", 10*time.Second, func() bool { return fileRows(t, path) == 6 })
	if got := testutil.ToFloat64(metricLost) - lost; got != 3 {
		t.Errorf("relay_ledger_rows_lost_total grew by %v after more rows, want still 3", got)
	}
}

// TestLedgerRowsWrittenToADeletedFileAreCountedLost deletes the file
// before a batch is written, past the writer's look at it (the window a
// batch written at the moment of the delete has): SQLite writes that batch
// to the file no path names, without an error, so it is gone with the
// file and counted with its rows when the next batch finds the file gone;
// the next batch is kept in a new file.
func TestLedgerRowsWrittenToADeletedFileAreCountedLost(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	store, err := openSQLiteFile(path, testDigest)
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	l := newWriter(store, "sqlite "+path, zap.New(core), Queue)
	defer l.store.Close()
	ctx := context.Background()
	lost := testutil.ToFloat64(metricLost)
	own := rowsNamed("kept-then-deleted", 5)
	if !l.flush(ctx, &own) || fileRows(t, path) != 5 {
		t.Fatalf("the first batch: %d rows in the file", fileRows(t, path))
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := store.Write(ctx, rowsNamed("into-the-void", 7)); err != nil {
		t.Fatalf("SQLite refused a write to a deleted file (%v): then no row went to it, and none is lost", err)
	}
	own = rowsNamed("next", 2)
	if !l.flush(ctx, &own) {
		t.Fatal("the batch after the delete was not written")
	}
	if n := fileRows(t, path); n != 2 {
		t.Errorf("the new file holds %d rows, want the next batch's 2", n)
	}
	if got := testutil.ToFloat64(metricLost) - lost; got != 12 {
		t.Errorf("relay_ledger_rows_lost_total grew by %v, want 12: the 5 the file held, and the 7 written to it once deleted", got)
	}
	if n := logs.FilterMessageSnippet("deleted or replaced").Len(); n != 1 {
		t.Errorf("%d log lines of the deleted file, want 1", n)
	}
}

// TestLedgerFileMovedAwayKeepsItsRows renames the ledger's file under the
// running writer, as an operator archiving a year would: the rows after
// it go to a new file at the path, the moved file keeps every row it had
// (its WAL written into it as the writer lets go of it), and nothing is
// counted lost.
func TestLedgerFileMovedAwayKeepsItsRows(t *testing.T) {
	dir := t.TempDir()
	path, archive := filepath.Join(dir, "ledger.db"), filepath.Join(dir, "ledger-2026.db")
	l, logs := runningFileLedger(t, path)
	lost := testutil.ToFloat64(metricLost)
	for _, r := range rowsNamed("archived", 3) {
		l.Add(r)
	}
	waitFor(t, "the first rows in the file", 10*time.Second, func() bool { return fileRows(t, path) == 3 })
	if err := os.Rename(path, archive); err != nil {
		t.Fatal(err)
	}
	for _, r := range rowsNamed("new", 2) {
		l.Add(r)
	}
	waitFor(t, "the later rows in a new file", 10*time.Second, func() bool { return fileRows(t, path) == 2 })
	if n := fileRows(t, archive); n != 3 {
		t.Errorf("the moved file holds %d rows, want its 3", n)
	}
	if got := testutil.ToFloat64(metricLost) - lost; got != 0 {
		t.Errorf("relay_ledger_rows_lost_total grew by %v for a file moved, not lost", got)
	}
	moved := logs.FilterMessageSnippet("moved").All()
	if len(moved) != 1 || moved[0].Level != zapcore.WarnLevel {
		t.Errorf("the log of the moved file: %+v", moved)
	}
}

// TestLedgerFileReplacedByACopyIsWrittenOnWhole puts another ledger file
// (a backup of four rows) in place of the running ledger's, as a restore
// does: the three rows of the replaced file are counted lost, and the
// rows after go to the copy, which keeps its own rows and stays whole
// (the replaced file's WAL, still named after the path, is never read
// with it).
func TestLedgerFileReplacedByACopyIsWrittenOnWhole(t *testing.T) {
	dir := t.TempDir()
	path, backup := filepath.Join(dir, "ledger.db"), filepath.Join(dir, "backup.db")
	b, err := openSQLiteStore(backup, testDigest)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Write(context.Background(), rowsNamed("backup", 4)); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	l, logs := runningFileLedger(t, path)
	lost := testutil.ToFloat64(metricLost)
	for _, r := range rowsNamed("replaced", 3) {
		l.Add(r)
	}
	waitFor(t, "the first rows in the file", 10*time.Second, func() bool { return fileRows(t, path) == 3 })
	if err := os.Rename(backup, path); err != nil {
		t.Fatal(err)
	}
	for _, r := range rowsNamed("restored", 2) {
		l.Add(r)
	}
	waitFor(t, "the later rows in the copy", 10*time.Second, func() bool { return fileRows(t, path) == 6 })
	if got := testutil.ToFloat64(metricLost) - lost; got != 3 {
		t.Errorf("relay_ledger_rows_lost_total grew by %v, want the replaced file's 3", got)
	}
	if n := logs.FilterMessageSnippet("deleted or replaced").Len(); n != 1 {
		t.Errorf("%d log lines of the replaced file, want 1", n)
	}
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var check string
	var replaced int
	if err := db.QueryRow(`PRAGMA integrity_check`).Scan(&check); err != nil || check != "ok" {
		t.Errorf("the copy after the writer took it: %q %v", check, err)
	}
	if err := db.QueryRow(`SELECT COUNT(*) FROM relay_usage WHERE request_id LIKE 'replaced-%'`).Scan(&replaced); err != nil || replaced != 0 {
		t.Errorf("the copy holds %d rows of the file it replaced (%v)", replaced, err)
	}
}
