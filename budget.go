package relay

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Budgets. A key may cap what it spends in calendar periods (UTC): a day,
// a week (from Monday) and a month, and in total, a budget that never
// renews; each at most once. Spend is the relay's own accounting of what
// each answer cost; it is charged when a request ends. A request holds its
// worst case against the budgets while it runs (hold.go), so that requests
// in flight together cannot pass them.

// budgetPeriod is a calendar period in UTC, or the whole of time.
type budgetPeriod uint8

const (
	periodDay budgetPeriod = iota
	periodWeek
	periodMonth
	periodTotal // one period that never ends: what a key spent in all
	numPeriods
)

var periodNames = [numPeriods]string{"day", "week", "month", "total"}

func (p budgetPeriod) String() string { return periodNames[p] }

// adjective names the period in messages: a "monthly" budget.
func (p budgetPeriod) adjective() string {
	return [numPeriods]string{"daily", "weekly", "monthly", "lifetime"}[p]
}

// renews reports whether a spent budget of the period comes back when the
// period ends: every period's but total's.
func (p budgetPeriod) renews() bool { return p != periodTotal }

// The total period starts at the Unix epoch (a fixed instant, and not the
// zero time, which an account's periods use for "not begun") and ends
// never: on the last day of year 9999, the latest time JSON can still
// write, and an expiry Redis takes (PEXPIREAT, fleet_spend.go), so that
// its totals there are kept too.
var (
	totalStart = time.Unix(0, 0).UTC()
	totalEnd   = time.Date(9999, time.December, 31, 0, 0, 0, 0, time.UTC)
)

// start is when the period holding t began.
func (p budgetPeriod) start(t time.Time) time.Time {
	if p == periodTotal {
		return totalStart
	}
	t = t.UTC()
	y, m, d := t.Date()
	switch p {
	case periodDay:
		return time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
	case periodWeek:
		back := (int(t.Weekday()) + 6) % 7 // days since Monday
		return time.Date(y, m, d-back, 0, 0, 0, 0, time.UTC)
	default:
		return time.Date(y, m, 1, 0, 0, 0, 0, time.UTC)
	}
}

// end is when the period that began at start ends.
func (p budgetPeriod) end(start time.Time) time.Time {
	switch p {
	case periodDay:
		return start.AddDate(0, 0, 1)
	case periodWeek:
		return start.AddDate(0, 0, 7)
	case periodTotal:
		return totalEnd
	default:
		return start.AddDate(0, 1, 0)
	}
}

// periodByName is the period of a name: day, week, month or total.
func periodByName(name string) (budgetPeriod, bool) {
	for p, n := range periodNames {
		if name == n {
			return budgetPeriod(p), true
		}
	}
	return 0, false
}

// budget is one cap: usd per period.
type budget struct {
	usd    float64
	period budgetPeriod
}

// parseBudget reads `<amount>usd/<period>`, such as 200usd/month.
func parseBudget(s string) (budget, error) {
	amount, period, ok := strings.Cut(strings.ToLower(strings.TrimSpace(s)), "/")
	if !ok {
		return budget{}, fmt.Errorf("budget %q: want <amount>usd/<day|week|month|total>, such as 200usd/month", s)
	}
	n, err := strconv.ParseFloat(strings.TrimSuffix(amount, "usd"), 64)
	if err != nil || !strings.HasSuffix(amount, "usd") || !(n > 0 && n <= 1e12) {
		return budget{}, fmt.Errorf("budget %q: the amount must be a positive number of US dollars followed by usd, such as 200usd", s)
	}
	if p, ok := periodByName(period); ok {
		return budget{usd: n, period: p}, nil
	}
	return budget{}, fmt.Errorf("budget %q: the period must be day, week or month (calendar periods in UTC), or total (all the key ever spends: it never renews)", s)
}

// parseBudgets reads a key's budgets; a period may appear once.
func parseBudgets(specs []string) ([numPeriods]float64, error) {
	var caps [numPeriods]float64
	for _, s := range specs {
		b, err := parseBudget(s)
		if err != nil {
			return caps, err
		}
		if caps[b.period] > 0 {
			return caps, fmt.Errorf("two %s budgets: give each period at most one", b.period.adjective())
		}
		caps[b.period] = b.usd
	}
	return caps, nil
}

// defaultBudgetWarn is the share of a budget at which the relay warns.
const defaultBudgetWarn = 0.8

// errBudgetExceeded answers a request whose budget (of its key, user
// entry or group: who names it, as spendAccount.who does) is spent, or
// whose hold (estimate, its worst case) is more than what remains of it.
// Retrying before the period ends cannot help, so the SDKs are told not
// to. A total budget never renews: its answer says so, and gives no
// retry-after, since no wait would help.
func errBudgetExceeded(who string, p budgetPeriod, capUSD, spent float64, wait time.Duration, estimate float64) *relayError {
	renews, retryAfter := "it renews in "+wait.Round(time.Second).String(), max(wait, time.Second)
	if !p.renews() {
		renews, retryAfter = "it never renews", 0
	}
	msg := fmt.Sprintf("%s has spent %s of its %s %s budget; %s",
		who, dollars(spent), p.adjective(), dollars(capUSD), renews)
	if estimate > 0 {
		msg = fmt.Sprintf("%s cannot afford this request: it may cost up to %s (its input estimate and max_tokens), and %s remains of its %s %s budget",
			who, dollars(estimate), dollars(max(0, capUSD-spent)), p.adjective(), dollars(capUSD))
		if !p.renews() {
			msg += ", which never renews"
		}
	}
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "budget_exceeded",
		msg: msg, retryAfter: retryAfter, noRetry: true}
}

// dollars formats an amount in US dollars for a message: cents, and below
// a dollar at least two significant digits, so that a sub-cent amount
// reads $0.0042 and not $0.00.
func dollars(v float64) string {
	decimals := 2
	if v > 0 && v < 1 {
		decimals = min(max(2, 1-int(math.Floor(math.Log10(v)))), 10)
	}
	s := strconv.FormatFloat(v, 'f', decimals, 64)
	if decimals > 2 {
		s = strings.TrimRight(s, "0")
		if len(s)-strings.IndexByte(s, '.')-1 < 2 {
			s = strconv.FormatFloat(v, 'f', 2, 64)
		}
	}
	return "$" + s
}
