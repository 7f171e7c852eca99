package ledger

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/pgtest"
)

func TestUsageQueryParameters(t *testing.T) {
	now := time.Date(2026, 3, 17, 12, 0, 0, 0, time.UTC)
	q, err := ParseQuery(url.Values{}, now)
	if err != nil || !q.From.Equal(time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)) || !q.To.Equal(time.Date(2026, 4, 1, 0, 0, 0, 0, time.UTC)) || q.CSV || len(q.GroupBy) != 0 {
		t.Errorf("default query %+v %v, want the current UTC month", q, err)
	}
	q, err = ParseQuery(url.Values{"from": {"2026-01-01"}, "to": {"2026-01-31"}, "group_by": {"key,day"}, "format": {"csv"}}, now)
	if err != nil || !q.To.Equal(time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC)) || strings.Join(q.GroupBy, ",") != "key,day" || !q.CSV {
		t.Errorf("query %+v %v: a date as to covers its day", q, err)
	}
	for _, c := range []struct {
		v    url.Values
		want string
	}{
		{url.Values{"group_by": {"key,tenant"}}, `group_by: unknown column "tenant" (key, user, group, channel, model, day)`},
		{url.Values{"group_by": {"key,key"}}, `column "key" is given twice`},
		{url.Values{"format": {"xml"}}, `format must be json or csv, not "xml"`},
		{url.Values{"from": {"yesterday"}}, `from: "yesterday" is neither a date`},
		{url.Values{"from": {"2026-02-01"}, "to": {"2026-01-01"}}, `must be after from`},
		{url.Values{"group": {"key"}}, `unknown parameter "group"`},
	} {
		if _, err := ParseQuery(c.v, now); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: error %v, want %q", c.v, err, c.want)
		}
	}
}

func TestUsageSpans(t *testing.T) {
	at := func(s string) time.Time {
		v, err := time.Parse(time.RFC3339, s)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, c := range []struct{ from, to, want string }{
		// whole days: the rollup alone
		{"2026-03-01T00:00:00Z", "2026-04-01T00:00:00Z", "daily 2026-03-01..2026-04-01"},
		// whole days and a partial day at each edge
		{"2026-03-01T12:00:00Z", "2026-03-31T12:00:00Z", "rows 2026-03-01T12..2026-03-02T00, daily 2026-03-02..2026-03-31, rows 2026-03-31T00..2026-03-31T12"},
		{"2026-03-01T00:00:00Z", "2026-03-03T05:00:00Z", "daily 2026-03-01..2026-03-03, rows 2026-03-03T00..2026-03-03T05"},
		{"2026-03-01T23:59:59Z", "2026-03-03T00:00:00Z", "rows 2026-03-01T23..2026-03-02T00, daily 2026-03-02..2026-03-03"},
		// no whole day: the rows, of two partial days at most
		{"2026-03-01T10:00:00Z", "2026-03-01T11:00:00Z", "rows 2026-03-01T10..2026-03-01T11"},
		{"2026-03-01T10:00:00Z", "2026-03-02T09:00:00Z", "rows 2026-03-01T10..2026-03-02T09"},
		{"2026-03-01T00:00:00Z", "2026-03-01T23:00:00Z", "rows 2026-03-01T00..2026-03-01T23"},
		// another zone's times are read in UTC
		{"2026-03-01T02:00:00+02:00", "2026-03-03T01:00:00+01:00", "daily 2026-03-01..2026-03-03"},
		// open-ended: the rollup's days end at 9999-12-31, the rows go on
		{"2026-03-01T00:00:00Z", "9999-12-31T23:00:00-05:00", "daily 2026-03-01..9999-12-31, rows 9999-12-31T00..10000-01-01T04"},
		{"9999-12-31T12:00:00Z", "9999-12-31T23:00:00-05:00", "rows 9999-12-31T12..10000-01-01T04"},
		{"0000-01-01T00:00:00Z", "0000-01-03T00:00:00Z", "daily 0000-01-01..0000-01-03"},
	} {
		var got []string
		for _, sp := range usageSpans(at(c.from), at(c.to)) {
			if sp.daily {
				got = append(got, "daily "+sp.from.Format(time.DateOnly)+".."+sp.to.Format(time.DateOnly))
			} else {
				got = append(got, "rows "+sp.from.Format("2006-01-02T15")+".."+sp.to.Format("2006-01-02T15"))
			}
		}
		if strings.Join(got, ", ") != c.want {
			t.Errorf("%s..%s: %s, want %s", c.from, c.to, strings.Join(got, ", "), c.want)
		}
	}
}

func TestLedgerSQLiteUsageFromRollupAndRowsIsTheRowsSum(t *testing.T) {
	s, err := openSQLiteStore(filepath.Join(t.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	checkUsagePathsAgree(t, s)
	// the rows of an edge are found through the table's key, (time,
	// request_id), not by reading the table
	stmt, args := s.spanSQL([]string{"key", "day"}, usageSpan{from: usageEpoch.Add(3 * time.Hour), to: usageEpoch.Add(24 * time.Hour)}, nil)
	plan := explainSQLite(t, s, stmt, args)
	if !strings.Contains(plan, "SEARCH relay_usage USING PRIMARY KEY (time>? AND time<?)") {
		t.Errorf("the rows of an edge are not read through the key on time:\n%s", plan)
	}
}

func TestLedgerPostgresUsageFromRollupAndRowsIsTheRowsSum(t *testing.T) {
	pg := pgtest.Start(t)
	s, err := openPostgresStore(pg.DSN(), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	checkUsagePathsAgree(t, s)
	// the edge's condition can use the key, (time, request_id): with sequential
	// scans priced out, the planner reads the rows through it (on a table
	// this small it would otherwise rightly read it all)
	stmt, args := s.spanSQL([]string{"key", "day"}, usageSpan{from: usageEpoch.Add(3 * time.Hour), to: usageEpoch.Add(24 * time.Hour)}, nil)
	ctx := context.Background()
	conn, err := s.db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SET enable_seqscan = off`); err != nil {
		t.Fatal(err)
	}
	rows, err := conn.QueryContext(ctx, "EXPLAIN "+stmt, args...)
	if err != nil {
		t.Fatal(err)
	}
	var plan []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, line)
	}
	rows.Close()
	if p := strings.Join(plan, "\n"); !strings.Contains(p, "relay_usage_pkey") || strings.Contains(p, "Seq Scan") {
		t.Errorf("the rows of an edge are not read through the key on time:\n%s", p)
	}
}

// explainSQLite returns SQLite's query plan of stmt.
func explainSQLite(t *testing.T, s *sqlStore, stmt string, args []any) string {
	t.Helper()
	rows, err := s.db.Query("EXPLAIN QUERY PLAN "+stmt, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, unused int
		var detail string
		if err := rows.Scan(&id, &parent, &unused, &detail); err != nil {
			t.Fatal(err)
		}
		plan = append(plan, detail)
	}
	return strings.Join(plan, "\n")
}

// usageEpoch is the first day of checkUsagePathsAgree's rows.
var usageEpoch = time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC)

// checkUsagePathsAgree writes rows over five days to s and asks usage
// about random ranges (whole days, whole days with partial ones at their
// edges, ranges inside one day or across one midnight) grouped by random
// columns: every answer must be, row for row, what the rows alone sum to
// (the same query over the rows only), and that must be the sums of the
// rows written.
func checkUsagePathsAgree(t *testing.T, s *sqlStore) {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rnd := rand.New(rand.NewPCG(seed, 1))
	ctx := context.Background()
	const days = 5
	pick := func(vs ...string) string { return vs[rnd.IntN(len(vs))] }
	rows := make([]Row, 3000)
	for i := range rows {
		at := usageEpoch.Add(time.Duration(rnd.Int64N(days*24*3600*1000)) * time.Millisecond)
		switch i % 10 {
		case 0: // on a midnight, where a day's rollup and the rows meet
			at = usageEpoch.AddDate(0, 0, rnd.IntN(days))
		case 1: // on an hour, where ranges below begin and end
			at = at.Truncate(time.Hour)
		case 2: // a millisecond before midnight
			at = usageEpoch.AddDate(0, 0, 1+rnd.IntN(days-1)).Add(-time.Millisecond)
		}
		rows[i] = Row{
			ID: fmt.Sprintf("paths-%05d", i), At: at,
			Key: pick("k1", "k2", "k3", "k4"), User: pick("", "alice", "bob"),
			Group: pick("g1", "g2", "g3"), Channel: pick("", "c1", "c2", "c3"),
			Model: "claude-sonnet-4-5", Served: pick("claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5"),
			Status: 200, Cause: causeOK,
			Input: rnd.Int64N(1e6), Output: rnd.Int64N(1e5), CacheRead: rnd.Int64N(1e7), CacheWrite: rnd.Int64N(1e5),
			CostNano: rnd.Int64N(1e12), // up to 1,000 USD, to the nano-USD
		}
	}
	for i := 0; i < len(rows); i += ledgerBatch {
		if err := s.Write(ctx, rows[i:min(i+ledgerBatch, len(rows))]); err != nil {
			t.Fatal(err)
		}
	}
	// a time in the rows' days (and a day around them): on a midnight, an
	// hour, or any millisecond
	instant := func() time.Time {
		at := usageEpoch.AddDate(0, 0, -1).Add(time.Duration(rnd.Int64N((days+2)*24*3600*1000)) * time.Millisecond)
		switch rnd.IntN(3) {
		case 0:
			return at.Truncate(24 * time.Hour)
		case 1:
			return at.Truncate(time.Hour)
		}
		return at
	}
	kinds := map[string]int{}
	for range 200 {
		from := instant()
		var to time.Time
		switch rnd.IntN(4) {
		case 0: // inside one day
			to = from.Add(time.Duration(rnd.Int64N(int64(from.Truncate(24*time.Hour).Add(24*time.Hour).Sub(from))/int64(time.Millisecond))+1) * time.Millisecond)
		default:
			to = instant()
		}
		if !to.After(from) {
			from, to = to, from.Add(time.Millisecond)
		}
		groupBy := slices.Clone(usageColumns)
		rnd.Shuffle(len(groupBy), func(i, j int) { groupBy[i], groupBy[j] = groupBy[j], groupBy[i] })
		groupBy = groupBy[:rnd.IntN(len(groupBy)+1)]
		spans := usageSpans(from, to)
		kind := "rows only"
		if slices.ContainsFunc(spans, func(sp usageSpan) bool { return sp.daily }) {
			kind = fmt.Sprintf("rollup and %d partial days", len(spans)-1)
		}
		kinds[kind]++

		q := Query{From: from, To: to, GroupBy: groupBy}
		got := collectUsage(t, func(emit func(UsageRow) error) error { return s.Usage(ctx, q, emit) })
		fromRows := collectUsage(t, func(emit func(UsageRow) error) error {
			return s.usageOf(ctx, groupBy, []usageSpan{{from: from, to: to}}, emit)
		})
		what := fmt.Sprintf("%s..%s by %v (%s)", from.Format(time.RFC3339Nano), to.Format(time.RFC3339Nano), groupBy, kind)
		if !slices.Equal(got, fromRows) {
			t.Errorf("%s:\n%s\nwant, as the rows sum:\n%s", what, strings.Join(got, "\n"), strings.Join(fromRows, "\n"))
		}
		if want := sumRows(rows, from, to, groupBy); !sameSet(fromRows, want) {
			t.Errorf("%s: the rows sum to\n%s\nwant\n%s", what, strings.Join(fromRows, "\n"), strings.Join(want, "\n"))
		}
	}
	t.Logf("ranges asked: %v", kinds)
	for _, k := range []string{"rows only", "rollup and 0 partial days", "rollup and 1 partial days", "rollup and 2 partial days"} {
		if kinds[k] == 0 {
			t.Errorf("no range was answered from %s", k)
		}
	}
}

// collectUsage renders the rows a usage query emits, in order.
func collectUsage(t *testing.T, query func(emit func(UsageRow) error) error) []string {
	t.Helper()
	var got []string
	if err := query(func(u UsageRow) error {
		got = append(got, usageLine(u.Values, u))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return got
}

func usageLine(values []string, u UsageRow) string {
	return strings.Join(values, "|") + " " + strings.Join([]string{
		i64(u.Requests), i64(u.Input), i64(u.Output), i64(u.CacheRead), i64(u.CacheWrite), usdDecimal(u.CostNano)}, " ")
}

// sumRows is what a usage query over [from, to) by groupBy answers for
// rows, in no order: without groupBy, one total row, zeros included.
func sumRows(rows []Row, from, to time.Time, groupBy []string) []string {
	sums := map[string]*UsageRow{}
	values := map[string][]string{}
	if len(groupBy) == 0 {
		sums[""], values[""] = new(UsageRow), nil
	}
	for _, r := range rows {
		if r.At.Before(from) || !r.At.Before(to) {
			continue
		}
		var v []string
		for _, c := range groupBy {
			v = append(v, map[string]string{"key": r.Key, "user": r.User, "group": r.Group, "channel": r.Channel,
				"model": r.Served, "day": r.At.UTC().Format(time.DateOnly)}[c])
		}
		k := strings.Join(v, "|")
		u := sums[k]
		if u == nil {
			u = new(UsageRow)
			sums[k], values[k] = u, v
		}
		u.Requests++
		u.Input += r.Input
		u.Output += r.Output
		u.CacheRead += r.CacheRead
		u.CacheWrite += r.CacheWrite
		u.CostNano += r.CostNano
	}
	var out []string
	for k, u := range sums {
		out = append(out, usageLine(values[k], *u))
	}
	return out
}

// sameSet reports whether a and b hold the same lines, in any order.
func sameSet(a, b []string) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// checkOpenEndedRanges writes rows of March 2026 to s and asks usage over
// ranges open at an end, as a client writes them (to=9999-12-31, a year-1
// from, a far-future time in another zone): each answers every row in it.
func checkOpenEndedRanges(t *testing.T, s *sqlStore) {
	t.Helper()
	ctx := context.Background()
	rows := testRows(time.Date(2026, 3, 2, 10, 0, 0, 0, time.UTC), time.Date(2026, 3, 3, 23, 59, 0, 0, time.UTC))
	if err := s.Write(ctx, rows); err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 3, 17, 12, 0, 0, 0, time.UTC)
	for _, v := range []url.Values{
		{"to": {"9999-12-31"}},
		{"from": {"2026-03-01"}, "to": {"9999-12-31"}, "group_by": {"key,day"}},
		{"from": {"0001-01-01"}, "to": {"9999-12-31"}, "group_by": {"model"}},
		{"from": {"0000-01-01"}, "to": {"2026-04-01"}},
		{"from": {"0001-01-01T00:00:00Z"}, "to": {"9999-12-31T23:59:59Z"}, "group_by": {"day"}},
		{"from": {"2026-03-02T11:00:00+01:00"}, "to": {"9999-12-31T23:00:00-05:00"}, "group_by": {"key"}},
		{"from": {"0000-01-01T00:30:00+01:00"}, "to": {"2026-03-03"}, "group_by": {"user"}},
	} {
		q, err := ParseQuery(v, now)
		if err != nil {
			t.Errorf("%v: %v", v, err)
			continue
		}
		got := collectUsage(t, func(emit func(UsageRow) error) error { return s.Usage(ctx, q, emit) })
		want := sumRows(rows, q.From, q.To, q.GroupBy)
		if !sameSet(got, want) || len(got) == 0 || strings.HasPrefix(got[0], " 0 ") {
			t.Errorf("%v (%s..%s):\n%s\nwant\n%s", v, q.From.Format(time.RFC3339), q.To.Format(time.RFC3339), strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
}

func TestLedgerSQLiteOpenEndedRanges(t *testing.T) {
	s, err := openSQLiteStore(filepath.Join(t.TempDir(), "ledger.db"), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	checkOpenEndedRanges(t, s)
}

func TestLedgerPostgresOpenEndedRanges(t *testing.T) {
	s, err := openPostgresStore(pgtest.Start(t).DSN(), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	checkOpenEndedRanges(t, s)
}
