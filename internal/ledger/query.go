package ledger

import (
	"context"
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Query is what a usage answer asks of the ledger (GET /relay/usage, the
// status page's Spend view): the rows of [From, To), summed by the GroupBy
// columns.
type Query struct {
	// From and To bound the rows' times: From included, To not.
	From, To time.Time
	// GroupBy are the columns the sums are by, of key, user, group,
	// channel, model (the model that served) and day (UTC), each once, in
	// the answer's order; none: one total.
	GroupBy []string
	// CSV asks WriteUsage for CSV rather than JSON.
	CSV bool
}

// usageColumns are the columns a usage answer may be grouped by; model is
// the model that served the request.
var usageColumns = []string{"key", "user", "group", "channel", "model", "day"}

// UsageRow is one row of a usage answer: the GroupBy columns' values, then
// the sums.
type UsageRow struct {
	// Values are the row's values of the query's GroupBy columns, in
	// their order.
	Values []string
	// Requests is how many requests the row sums.
	Requests int64
	// Input, Output, CacheRead and CacheWrite are their tokens.
	Input, Output, CacheRead, CacheWrite int64
	// CostNano is their cost in nano-USD.
	CostNano int64
}

// ParseQuery reads a usage query's parameters; without from and to
// it covers the current UTC month. from and to are RFC 3339 times or UTC
// dates (YYYY-MM-DD); to is exclusive, but a date covers its whole day.
func ParseQuery(v url.Values, now time.Time) (Query, error) {
	var q Query
	for name := range v {
		switch name {
		case "from", "to", "group_by", "format":
		default:
			return q, fmt.Errorf("unknown parameter %q (from, to, group_by, format)", name)
		}
	}
	now = now.UTC()
	q.From = time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
	q.To = q.From.AddDate(0, 1, 0)
	var err error
	if s := v.Get("from"); s != "" {
		if q.From, err = usageTime(s, false); err != nil {
			return q, fmt.Errorf("from: %w", err)
		}
	}
	if s := v.Get("to"); s != "" {
		if q.To, err = usageTime(s, true); err != nil {
			return q, fmt.Errorf("to: %w", err)
		}
	}
	if !q.To.After(q.From) {
		return q, fmt.Errorf("to (%s) must be after from (%s)", q.To.Format(time.RFC3339), q.From.Format(time.RFC3339))
	}
	if s := v.Get("group_by"); s != "" {
		for c := range strings.SplitSeq(s, ",") {
			c = strings.TrimSpace(c)
			if !slices.Contains(usageColumns, c) {
				return q, fmt.Errorf("group_by: unknown column %q (key, user, group, channel, model, day)", c)
			}
			if slices.Contains(q.GroupBy, c) {
				return q, fmt.Errorf("group_by: column %q is given twice", c)
			}
			q.GroupBy = append(q.GroupBy, c)
		}
	}
	switch v.Get("format") {
	case "", "json":
	case "csv":
		q.CSV = true
	default:
		return q, fmt.Errorf("format must be json or csv, not %q", v.Get("format"))
	}
	return q, nil
}

// usageTime reads an RFC 3339 time or a date; a date that ends a range
// covers its whole day.
func usageTime(s string, end bool) (time.Time, error) {
	if t, err := time.Parse(time.DateOnly, s); err == nil {
		if end {
			t = t.AddDate(0, 0, 1)
		}
		return t, nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return t, fmt.Errorf("%q is neither a date (2026-01-31) nor an RFC 3339 time (2026-01-31T00:00:00Z)", s)
	}
	return t, nil
}

// usageSpan is a part of a usage query's range, [from, to), and where its
// sums come from: the daily rollup for whole UTC days, else the rows.
type usageSpan struct {
	from, to time.Time
	daily    bool
}

// lastRollupDay is the last day the daily rollup can be asked for: its
// days are YYYY-MM-DD text, compared as text, and a later day (year 10000,
// the end of a range to 9999-12-31) would sort before every other.
var lastRollupDay = time.Date(9999, 12, 31, 0, 0, 0, 0, time.UTC)

// usageSpans splits [from, to) into the whole UTC days inside it, which
// the daily rollup answers, and the parts of a day at its edges, at most
// two, whose rows are read (through the table's key, on time). A range with no
// whole day in it is read from its rows, two partial days at most. A range
// open at its end (to 9999-12-31, which ends in year 10000) reads its last
// day, lastRollupDay, from the rows.
func usageSpans(from, to time.Time) []usageSpan {
	from, to = from.UTC(), to.UTC()
	first, last := from.Truncate(24*time.Hour), to.Truncate(24*time.Hour)
	if first.Before(from) {
		first = first.Add(24 * time.Hour)
	}
	if last.After(lastRollupDay) {
		last = lastRollupDay
	}
	if !first.Before(last) {
		return []usageSpan{{from: from, to: to}}
	}
	var spans []usageSpan
	if from.Before(first) {
		spans = append(spans, usageSpan{from: from, to: first})
	}
	spans = append(spans, usageSpan{from: first, to: last, daily: true})
	if last.Before(to) {
		spans = append(spans, usageSpan{from: last, to: to})
	}
	return spans
}

// Usage runs q, giving emit each row as it is read, so a large answer is
// streamed rather than held: the whole days of its range summed from the
// daily rollup, the partial days at its edges from the rows.
func (s *sqlStore) Usage(ctx context.Context, q Query, emit func(UsageRow) error) error {
	return s.usageOf(ctx, q.GroupBy, usageSpans(q.From, q.To), emit)
}

// usageOf sums spans, grouped by groupBy, in one statement: a span's own
// SELECT when there is one, else their sums added up (UNION ALL, then
// summed again by the same columns). Every sum is of integers, so the
// answer is exact whichever way it was summed.
func (s *sqlStore) usageOf(ctx context.Context, groupBy []string, spans []usageSpan, emit func(UsageRow) error) error {
	var args []any
	branches := make([]string, len(spans))
	for i, sp := range spans {
		branches[i], args = s.spanSQL(groupBy, sp, args)
	}
	aliases := make([]string, len(groupBy))
	for i := range groupBy {
		aliases[i] = "g" + strconv.Itoa(i)
	}
	stmt := branches[0]
	if len(branches) > 1 {
		sel := append(append([]string(nil), aliases...),
			s.d.sum("requests"), s.d.sum("input_tokens"), s.d.sum("output_tokens"),
			s.d.sum("cache_read_tokens"), s.d.sum("cache_write_tokens"), s.d.sum("cost_nano_usd"))
		stmt = "SELECT " + strings.Join(sel, ", ") + " FROM (" + strings.Join(branches, " UNION ALL ") + ") AS spans"
		if len(aliases) > 0 {
			stmt += " GROUP BY " + strings.Join(aliases, ", ")
		}
	}
	if len(aliases) > 0 {
		stmt += " ORDER BY " + strings.Join(aliases, ", ")
	}
	rows, err := s.db.QueryContext(ctx, stmt, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	var r UsageRow
	r.Values = make([]string, len(groupBy))
	dest := make([]any, 0, len(groupBy)+6)
	for i := range r.Values {
		dest = append(dest, &r.Values[i])
	}
	dest = append(dest, &r.Requests, &r.Input, &r.Output, &r.CacheRead, &r.CacheWrite, &r.CostNano)
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

// spanSQL is the SELECT of one span's sums grouped by groupBy (columns
// named g0, g1, ...; sums named as the rollup's columns), with its
// arguments appended to args.
func (s *sqlStore) spanSQL(groupBy []string, sp usageSpan, args []any) (string, []any) {
	cols := make([]string, len(groupBy))
	sel := make([]string, 0, len(groupBy)+6)
	for i, c := range groupBy {
		cols[i] = s.column(c, sp.daily)
		sel = append(sel, cols[i]+" AS g"+strconv.Itoa(i))
	}
	count, table, where := "COUNT(*)", "relay_usage", "time"
	from, to := s.d.timeArg(sp.from), s.d.timeArg(sp.to)
	if sp.daily {
		count, table, where = s.d.sum("requests"), "relay_usage_daily", "day"
		from, to = sp.from.Format(time.DateOnly), sp.to.Format(time.DateOnly)
	}
	sel = append(sel, count+" AS requests",
		s.d.sum("input_tokens")+" AS input_tokens", s.d.sum("output_tokens")+" AS output_tokens",
		s.d.sum("cache_read_tokens")+" AS cache_read_tokens", s.d.sum("cache_write_tokens")+" AS cache_write_tokens",
		s.d.sum("cost_nano_usd")+" AS cost_nano_usd")
	args = append(args, from, to)
	stmt := "SELECT " + strings.Join(sel, ", ") + " FROM " + table +
		" WHERE " + where + " >= " + s.d.param(len(args)-1) + " AND " + where + " < " + s.d.param(len(args))
	if len(cols) > 0 {
		stmt += " GROUP BY " + strings.Join(cols, ", ")
	}
	return stmt, args
}

// column is the expression of a group_by column, in the rows or in the
// daily rollup.
func (s *sqlStore) column(c string, daily bool) string {
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
	if daily {
		return "day"
	}
	return s.d.day
}
