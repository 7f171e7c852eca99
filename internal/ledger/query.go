package ledger

import (
	"bufio"
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Query is what GET /relay/usage asks of the ledger: the rows of
// [from, to), summed by the groupBy columns.
type Query struct {
	From, To time.Time
	GroupBy  []string // of usageColumns, each once
	CSV      bool
}

// usageColumns are the columns a usage answer may be grouped by; model is
// the model that served the request.
var usageColumns = []string{"key", "user", "group", "channel", "model", "day"}

// UsageRow is one row of a usage answer: the groupBy columns' values, then
// the sums.
type UsageRow struct {
	Values                               []string
	Requests                             int64
	Input, Output, CacheRead, CacheWrite int64
	CostNano                             int64
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

// WriteUsage streams q's answer from l to w.
func WriteUsage(w http.ResponseWriter, r *http.Request, l *Writer, q Query) error {
	header := append(append([]string(nil), q.GroupBy...),
		"requests", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "cost_usd")
	if q.CSV {
		w.Header().Set("Content-Type", "text/csv; charset=utf-8")
		w.Header().Set("Content-Disposition", `attachment; filename="usage-`+q.From.Format(time.DateOnly)+`.csv"`)
	} else {
		w.Header().Set("Content-Type", "application/json")
	}
	bw := bufio.NewWriterSize(w, 32<<10)
	cw := csv.NewWriter(bw)
	started := false
	start := func() {
		started = true
		if q.CSV {
			_ = cw.Write(header)
		} else {
			_, _ = bw.WriteString(`{"rows":[`)
		}
	}
	n := 0
	rec := make([]string, len(header))
	err := l.store.Usage(r.Context(), q, func(u UsageRow) error {
		if !started {
			start()
		}
		copy(rec, u.Values)
		k := len(u.Values)
		rec[k] = strconv.FormatInt(u.Requests, 10)
		rec[k+1] = strconv.FormatInt(u.Input, 10)
		rec[k+2] = strconv.FormatInt(u.Output, 10)
		rec[k+3] = strconv.FormatInt(u.CacheRead, 10)
		rec[k+4] = strconv.FormatInt(u.CacheWrite, 10)
		rec[k+5] = usdDecimal(u.CostNano)
		if q.CSV {
			for i := range k { // the names; the sums after them are numbers
				rec[i] = csvCell(rec[i])
			}
			cw.Write(rec) //nolint:errcheck // its error is cw.Error's, checked at the end
		} else {
			if n > 0 {
				_ = bw.WriteByte(',')
			}
			_ = bw.WriteByte('{')
			for i, name := range header {
				if i > 0 {
					_ = bw.WriteByte(',')
				}
				_, _ = bw.WriteString(`"` + name + `":`)
				if i < k {
					s, _ := json.Marshal(rec[i])
					_, _ = bw.Write(s)
				} else {
					_, _ = bw.WriteString(rec[i])
				}
			}
			_ = bw.WriteByte('}')
		}
		n++
		return nil
	})
	if err != nil && !started {
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: fmt.Errorf("the ledger did not answer: %v", err)}
	}
	if !started {
		start()
	}
	if q.CSV {
		cw.Flush()
	} else if err == nil {
		_, _ = bw.WriteString("]}\n")
	}
	ferr := bw.Flush()
	if err != nil {
		// the answer began and cannot say it failed: the connection is
		// cut, so that no client takes a CSV without its last rows, which
		// would look whole, for a finished answer
		_ = http.NewResponseController(w).Flush()
		panic(http.ErrAbortHandler)
	}
	return ferr
}

// usdDecimal formats an amount in nano-USD as a decimal number of
// dollars, exactly.
func usdDecimal(n int64) string {
	sign := ""
	if n < 0 {
		sign, n = "-", -n
	}
	whole, frac := n/1e9, n%1e9
	if frac == 0 {
		return sign + strconv.FormatInt(whole, 10)
	}
	f := strings.TrimRight(fmt.Sprintf("%09d", frac), "0")
	return sign + strconv.FormatInt(whole, 10) + "." + f
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
func (s *sqlLedger) Usage(ctx context.Context, q Query, emit func(UsageRow) error) error {
	return s.usageOf(ctx, q.GroupBy, usageSpans(q.From, q.To), emit)
}

// usageOf sums spans, grouped by groupBy, in one statement: a span's own
// SELECT when there is one, else their sums added up (UNION ALL, then
// summed again by the same columns). Every sum is of integers, so the
// answer is exact whichever way it was summed.
func (s *sqlLedger) usageOf(ctx context.Context, groupBy []string, spans []usageSpan, emit func(UsageRow) error) error {
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
func (s *sqlLedger) spanSQL(groupBy []string, sp usageSpan, args []any) (string, []any) {
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
func (s *sqlLedger) column(c string, daily bool) string {
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

// csvCell is a name as a CSV cell: one that begins with =, +, -, @, a tab
// or a carriage return is read by a spreadsheet as a formula (which may
// fetch a URL or run a command on the reader's machine), so it is written
// behind a ', which the spreadsheet shows as text. Names are the clients'
// to choose (an identity, a model asked for) or an operator's; numbers are
// the relay's, and are written as they are, a negative one too.
func csvCell(s string) string {
	if s != "" && strings.IndexByte("=+-@\t\r", s[0]) >= 0 {
		return "'" + s
	}
	return s
}
