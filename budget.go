package relay

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Budgets. A key may cap what it spends in calendar periods (UTC): a day,
// a week (from Monday) and a month, each at most once. Spend is the relay's
// own accounting of what each answer cost; it is charged when a request
// ends. A request holds its worst case against the budgets while it runs
// (hold.go), so that requests in flight together cannot pass them.

// budgetPeriod is a calendar period in UTC.
type budgetPeriod uint8

const (
	periodDay budgetPeriod = iota
	periodWeek
	periodMonth
	numPeriods
)

var periodNames = [numPeriods]string{"day", "week", "month"}

func (p budgetPeriod) String() string { return periodNames[p] }

// adjective names the period in messages: a "monthly" budget.
func (p budgetPeriod) adjective() string {
	return [numPeriods]string{"daily", "weekly", "monthly"}[p]
}

// start is when the period holding t began.
func (p budgetPeriod) start(t time.Time) time.Time {
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
	default:
		return start.AddDate(0, 1, 0)
	}
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
		return budget{}, fmt.Errorf("budget %q: want <amount>usd/<day|week|month>, such as 200usd/month", s)
	}
	n, err := strconv.ParseFloat(strings.TrimSuffix(amount, "usd"), 64)
	if err != nil || !strings.HasSuffix(amount, "usd") || !(n > 0 && n <= 1e12) {
		return budget{}, fmt.Errorf("budget %q: the amount must be a positive number of US dollars followed by usd, such as 200usd", s)
	}
	for p, name := range periodNames {
		if period == name {
			return budget{usd: n, period: budgetPeriod(p)}, nil
		}
	}
	return budget{}, fmt.Errorf("budget %q: the period must be day, week or month (calendar periods in UTC)", s)
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
// to.
func errBudgetExceeded(who string, p budgetPeriod, capUSD, spent float64, wait time.Duration, estimate float64) *relayError {
	msg := fmt.Sprintf("%s has spent %s of its %s %s budget; it renews in %s",
		who, dollars(spent), p.adjective(), dollars(capUSD), wait.Round(time.Second))
	if estimate > 0 {
		msg = fmt.Sprintf("%s cannot afford this request: it may cost up to %s (its input estimate and max_tokens), and %s remains of its %s %s budget",
			who, dollars(estimate), dollars(max(0, capUSD-spent)), p.adjective(), dollars(capUSD))
	}
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "budget_exceeded",
		msg: msg, retryAfter: max(wait, time.Second), noRetry: true}
}

// dollars formats an amount in US dollars for a message.
func dollars(v float64) string { return "$" + strconv.FormatFloat(v, 'f', 2, 64) }
