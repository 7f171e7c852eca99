package ledger

import (
	"bufio"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// WriteUsage streams q's answer from l to w: {"rows": [...]}, or CSV with
// one header row, written as the database gives the rows (a name that a
// spreadsheet would take for a formula behind a ': csvCell). A database
// that fails before the answer began is a caddy.APIError, 503; one that
// fails after cuts the connection, so that no client takes a part for the
// whole.
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
