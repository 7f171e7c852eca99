package relay

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddyserver/caddy/v2"
)

// The status page's Spend view: what the ledger holds of the last
// spendDays UTC days, by day and group, and the keys and models that cost
// most, read by the page from `spend` beside it (never from the admin
// API, which is privileged and on another origin), and the same rows as
// CSV from `spend.csv`. Built with the ledger's usage queries; rows are
// made of names and sums, as the rest of the page.

// spendDays is how many UTC days the Spend view covers, today the last.
const spendDays = 30

// spendTop is how many keys and models the view lists.
const spendTop = 10

// spendTTL is how long a view is kept for every viewer of the page: a
// ledger query at most this often, however many pages are open.
const spendTTL = 5 * time.Second

// spendView is the page's Spend view. Without a ledger, Ledger is false
// and Notice says why; Notice also says why a ledger did not answer.
type spendView struct {
	Ledger bool   `json:"ledger"`
	Notice string `json:"notice,omitempty"`
	// Days are the view's UTC days, the oldest first, today last.
	Days []string `json:"days"`
	// Groups are the groups that spent in those days, by name, each with
	// its cost on each of Days.
	Groups []spendGroup `json:"groups"`
	// TopKeys and TopModels are the keys and the models (as served) that
	// cost most in those days, the costliest first.
	TopKeys   []spendTotal `json:"top_keys"`
	TopModels []spendTotal `json:"top_models"`
	TotalUSD  float64      `json:"total_usd"`
}

// spendGroup is a group's cost by day.
type spendGroup struct {
	Name    string    `json:"name"`
	CostUSD []float64 `json:"cost_usd"`
}

// spendTotal is a key's or model's cost and requests over the view.
type spendTotal struct {
	Name     string  `json:"name"`
	Requests int64   `json:"requests"`
	CostUSD  float64 `json:"cost_usd"`
}

// spendCache is the last view built, for spendTTL.
type spendCache struct {
	mu   sync.Mutex
	at   time.Time
	view spendView
}

// spendRange is the view's query window at now: spendDays whole UTC days,
// which the ledger answers from its daily rollup.
func spendRange(now time.Time) (from, to time.Time) {
	now = now.UTC()
	to = time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC).AddDate(0, 0, 1)
	return to.AddDate(0, 0, -spendDays), to
}

// buildSpend reads the view at now from l.
func buildSpend(ctx context.Context, l *ledger.Writer, now time.Time) spendView {
	from, to := spendRange(now)
	v := spendView{Ledger: true, Days: make([]string, 0, spendDays), Groups: []spendGroup{}, TopKeys: []spendTotal{}, TopModels: []spendTotal{}}
	day := map[string]int{}
	for d := from; d.Before(to); d = d.AddDate(0, 0, 1) {
		day[d.Format(time.DateOnly)] = len(v.Days)
		v.Days = append(v.Days, d.Format(time.DateOnly))
	}
	group := map[string]int{}
	err := l.Usage(ctx, ledger.Query{From: from, To: to, GroupBy: []string{"day", "group"}}, func(u ledger.UsageRow) error {
		i, ok := day[u.Values[0]]
		if !ok {
			return nil
		}
		g, ok := group[u.Values[1]]
		if !ok {
			g = len(v.Groups)
			group[u.Values[1]] = g
			v.Groups = append(v.Groups, spendGroup{Name: u.Values[1], CostUSD: make([]float64, spendDays)})
		}
		usd := float64(u.CostNano) / 1e9
		v.Groups[g].CostUSD[i] += usd
		v.TotalUSD += usd
		return nil
	})
	if err == nil {
		v.TopKeys, err = spendTops(ctx, l, from, to, "key")
	}
	if err == nil {
		v.TopModels, err = spendTops(ctx, l, from, to, "model")
	}
	if err != nil {
		return spendView{Ledger: true, Notice: "the ledger did not answer: " + err.Error()}
	}
	slices.SortFunc(v.Groups, func(a, b spendGroup) int { return cmp.Compare(a.Name, b.Name) })
	return v
}

// spendTops is the spendTop costliest values of column in [from, to).
func spendTops(ctx context.Context, l *ledger.Writer, from, to time.Time, column string) ([]spendTotal, error) {
	var all []spendTotal
	err := l.Usage(ctx, ledger.Query{From: from, To: to, GroupBy: []string{column}}, func(u ledger.UsageRow) error {
		all = append(all, spendTotal{Name: u.Values[0], Requests: u.Requests, CostUSD: float64(u.CostNano) / 1e9})
		return nil
	})
	slices.SortStableFunc(all, func(a, b spendTotal) int {
		return cmp.Or(cmp.Compare(b.CostUSD, a.CostUSD), cmp.Compare(a.Name, b.Name))
	})
	return append([]spendTotal{}, all[:min(len(all), spendTop)]...), err
}

// spend serves the view as JSON.
func (s *StatusPage) spend(w http.ResponseWriter, r *http.Request) error {
	v := s.spendView(r.Context(), time.Now())
	w.Header().Set("Content-Type", "application/json")
	if r.Method == http.MethodHead {
		return nil
	}
	return json.NewEncoder(w).Encode(v)
}

// spendView is the view at now, built at most every spendTTL.
func (s *StatusPage) spendView(ctx context.Context, now time.Time) spendView {
	l, err := ledger.Current()
	if err != nil {
		return spendView{Notice: err.Error()}
	}
	c := s.spends
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.at.IsZero() || now.Sub(c.at) >= spendTTL || now.Before(c.at) {
		v := buildSpend(ctx, l, now)
		if v.Notice != "" && ctx.Err() != nil { // its viewer left: not every viewer's answer
			return v
		}
		c.view, c.at = v, now
	}
	return c.view
}

// spendCSV serves the view's rows, by day, group, key and model, as the
// admin API's GET /relay/usage does in CSV.
func (s *StatusPage) spendCSV(w http.ResponseWriter, r *http.Request) error {
	l, err := ledger.Current()
	if err != nil {
		return statusError(w, http.StatusNotFound, err.Error())
	}
	from, to := spendRange(time.Now())
	if r.Method == http.MethodHead {
		w.Header().Set("Content-Type", "text/csv; charset=utf-8")
		return nil
	}
	err = ledger.WriteUsage(w, r, l, ledger.Query{From: from, To: to, GroupBy: []string{"day", "group", "key", "model"}, CSV: true})
	var api caddy.APIError
	if errors.As(err, &api) { // the ledger did not answer: nothing is written yet
		w.Header().Del("Content-Disposition")
		return statusError(w, api.HTTPStatus, api.Err.Error())
	}
	return err
}
