package money

import (
	"fmt"
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

// Period is a calendar period in UTC, or the whole of time.
type Period uint8

// The periods.
const (
	PeriodDay   Period = iota // a calendar day in UTC
	PeriodWeek                // a week from Monday, in UTC
	PeriodMonth               // a calendar month in UTC
	PeriodTotal               // one period that never ends: what a key spent in all
	NumPeriods                // the number of periods
)

var periodNames = [NumPeriods]string{"day", "week", "month", "total"}

// String names the period: day, week, month or total.
func (p Period) String() string { return periodNames[p] }

// Adjective names the period in messages: a "monthly" budget.
func (p Period) Adjective() string {
	return [NumPeriods]string{"daily", "weekly", "monthly", "lifetime"}[p]
}

// Renews reports whether a spent budget of the period comes back when the
// period ends: every period's but total's.
func (p Period) Renews() bool { return p != PeriodTotal }

// The total period starts at the Unix epoch (a fixed instant, and not the
// zero time, which an account's periods use for "not begun") and ends
// never: on the last day of year 9999, the latest time JSON can still
// write, and an expiry Redis takes (PEXPIREAT, fleet_spend.go), so that
// its totals there are kept too.
var (
	totalStart = time.Unix(0, 0).UTC()
	totalEnd   = time.Date(9999, time.December, 31, 0, 0, 0, 0, time.UTC)
)

// Start is when the period holding t began.
func (p Period) Start(t time.Time) time.Time {
	if p == PeriodTotal {
		return totalStart
	}
	t = t.UTC()
	y, m, d := t.Date()
	switch p {
	case PeriodDay:
		return time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
	case PeriodWeek:
		back := (int(t.Weekday()) + 6) % 7 // days since Monday
		return time.Date(y, m, d-back, 0, 0, 0, 0, time.UTC)
	default:
		return time.Date(y, m, 1, 0, 0, 0, 0, time.UTC)
	}
}

// End is when the period that began at start ends.
func (p Period) End(start time.Time) time.Time {
	switch p {
	case PeriodDay:
		return start.AddDate(0, 0, 1)
	case PeriodWeek:
		return start.AddDate(0, 0, 7)
	case PeriodTotal:
		return totalEnd
	default:
		return start.AddDate(0, 1, 0)
	}
}

// PeriodByName is the period of a name: day, week, month or total.
func PeriodByName(name string) (Period, bool) {
	for p, n := range periodNames {
		if name == n {
			return Period(p), true
		}
	}
	return 0, false
}

// budget is one cap: usd per period.
type budget struct {
	usd    float64
	period Period
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
	if p, ok := PeriodByName(period); ok {
		return budget{usd: n, period: p}, nil
	}
	return budget{}, fmt.Errorf("budget %q: the period must be day, week or month (calendar periods in UTC), or total (all the key ever spends: it never renews)", s)
}

// ParseBudgets reads a key's budgets; a period may appear once.
func ParseBudgets(specs []string) ([NumPeriods]float64, error) {
	var caps [NumPeriods]float64
	for _, s := range specs {
		b, err := parseBudget(s)
		if err != nil {
			return caps, err
		}
		if caps[b.period] > 0 {
			return caps, fmt.Errorf("two %s budgets: give each period at most one", b.period.Adjective())
		}
		caps[b.period] = b.usd
	}
	return caps, nil
}

// defaultBudgetWarn is the share of a budget at which the relay warns.
const defaultBudgetWarn = 0.8
