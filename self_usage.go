package relay

import (
	"net/http"
	"time"
)

// Self-service usage. GET /v1/relay/usage answers the principal that asks
// (the relay key it sends, or the identity an authentication handler
// established) its own limits, spend, holds, budgets, degrade state and
// live sessions, so that a developer or an agent can see where it stands
// without the operator's admin API. It answers only the principal's own
// state and names no other key, user or channel; it never holds a secret
// (neither the key nor an upstream's credential). It is answered by the
// relay itself: no upstream is asked, and, as GET /v1/models, it is not
// held to nor counted against the key's rate, token and concurrency
// limits (asking how much is left must not spend it).

// PathRelayUsage is the self-service usage route.
const PathRelayUsage = "/v1/relay/usage"

// usageAnswer is the answer of GET /v1/relay/usage.
type usageAnswer struct {
	// Kind is key or user; Name the key's or user entry's name, as the
	// operator's logs and metrics call it; Identity, for a user entry,
	// the identity it serves (the caller's own).
	Kind     string `json:"kind"`
	Name     string `json:"name"`
	Identity string `json:"identity,omitempty"`
	Group    string `json:"group"`
	Priority string `json:"priority"`
	// Expires is when the key stops working; null: never.
	Expires *time.Time   `json:"expires"`
	Limits  limitsStatus `json:"limits"`
	// SpendUSD is what the principal spent in the current day, week and
	// month (calendar periods in UTC), and in total when it has a total
	// budget.
	SpendUSD map[string]float64 `json:"spend_usd"`
	Holds    usageHolds         `json:"holds"`
	// Budgets are the budgets that apply to its messages: its own and its
	// group's (which it shares with the group's other keys and users).
	Budgets []usageBudget `json:"budgets"`
	// BudgetRemainingUSD is what is left of the tightest of them, as the
	// x-relay-budget-remaining-usd header says; null: no budget applies.
	BudgetRemainingUSD *float64     `json:"budget_remaining_usd"`
	Degrade            usageDegrade `json:"degrade"`
	// Sessions are the principal's live sessions on this relay, the
	// costliest first (session_list.go).
	Sessions []sessionView `json:"sessions"`
}

// usageHolds is what the principal's requests in flight hold against its
// budgets: how many hold on this relay, and what they hold (in a fleet,
// every relay's, as of the last sync).
type usageHolds struct {
	Requests int     `json:"requests"`
	USD      float64 `json:"usd"`
}

// usageBudget is one budget that applies to the principal.
type usageBudget struct {
	// Scope is whose budget it is: key, user or group.
	Scope    string  `json:"scope"`
	Period   string  `json:"period"`
	LimitUSD float64 `json:"limit_usd"`
	SpentUSD float64 `json:"spent_usd"`
	HeldUSD  float64 `json:"held_usd"`
	// RemainingUSD is what is left once the requests in flight cost what
	// they hold.
	RemainingUSD float64 `json:"remaining_usd"`
	// PeriodEnd is when the period ends and the budget renews; a total
	// budget's never does (year 9999).
	PeriodEnd time.Time `json:"period_end"`
}

// usageDegrade is the principal's budget_degrade: its steps (its entry's,
// else its group's), how much of the tightest budget is used, and what a
// message would get now.
type usageDegrade struct {
	Steps []BudgetDegrade `json:"steps"`
	// UsedPercent is the share of the tightest budget spent and held, in
	// percent; null when no budget applies.
	UsedPercent *float64 `json:"used_percent"`
	// Cheaper says a message now goes to the cheapest channels of the
	// live tier; Model, the model it is now served as when that costs
	// less than the one it asks for.
	Cheaper bool   `json:"cheaper"`
	Model   string `json:"model,omitempty"`
}

// serveUsage answers GET /v1/relay/usage for the principal of in.
func (r *Relay) serveUsage(w http.ResponseWriter, req *http.Request, in *inbound) *relayError {
	now := r.now()
	k, st := in.who.key, in.who.state
	a := usageAnswer{Kind: k.kind(), Name: k.name, Group: k.group.name, Priority: k.prio.String(),
		Limits: limitsStatus{Rate: k.opts.Rate, Tokens: k.opts.Tokens}, Budgets: []usageBudget{}, Sessions: r.liveSessions(in)}
	if k.kind() == kindUser {
		a.Identity = r.identityOf(req)
	}
	if !k.expires.IsZero() {
		at := k.expires.UTC()
		a.Expires = &at
	}
	if a.Sessions == nil {
		a.Sessions = []sessionView{}
	}
	a.Limits.Concurrency, a.Limits.Inflight = st.limits.maxConc.Load(), st.limits.inflight.Load()
	a.Limits.RateRemaining, a.Limits.TokensRemaining = st.limits.remaining(now)

	if acct := st.spend; acct != nil {
		spent, caps := acct.spent(now)
		a.SpendUSD = map[string]float64{}
		for p := range numPeriods {
			if p != periodTotal || caps[p] > 0 { // the total counts only with a budget
				a.SpendUSD[p.String()] = spent[p]
			}
		}
		a.Holds.Requests, a.Holds.USD = acct.holdsNow()
	}
	accts, n := in.budgetAccounts()
	for _, acct := range accts[:n] {
		scope := acct.scope.String()
		if acct == st.spend {
			scope = k.kind()
		}
		acct.rooms(now, func(b budgetRoom) {
			a.Budgets = append(a.Budgets, usageBudget{Scope: scope, Period: b.period.String(), LimitUSD: b.limit.usd(),
				SpentUSD: b.spent.usd(), HeldUSD: b.held.usd(), RemainingUSD: b.left().usd(), PeriodEnd: b.period.end(b.start)})
		})
	}
	t := in.tightestBudget(now)
	a.Degrade = r.degradeState(in, t)
	if t.known {
		left, used := t.left().usd(), t.percent()
		a.BudgetRemainingUSD, a.Degrade.UsedPercent = &left, &used
	}
	w.Header().Set("Cache-Control", "private, no-store") // one principal's: no shared cache may keep it
	writeJSON(w, a)
	return nil
}

// degradeState is the principal's budget_degrade as its usage answer says
// it: its steps and what a message would get with the tightest budget t.
func (r *Relay) degradeState(in *inbound, t budgetRoom) usageDegrade {
	d := usageDegrade{Steps: in.who.key.opts.BudgetDegrade}
	if len(d.Steps) == 0 {
		d.Steps = in.group().degradeCfg
	}
	if d.Steps == nil {
		d.Steps = []BudgetDegrade{}
	}
	d.Cheaper, d.Model = in.degradeAt(in.degradeSteps(), t)
	return d
}

// holdsNow is how many of this relay's requests hold against the account,
// and what its holds hold (heldUSD).
func (a *spendAccount) holdsNow() (int, float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.holding, max(a.heldLocked(), 0).usd()
}

// liveSessions lists the live sessions of the principal of in, for its
// usage answer: its own only.
func (r *Relay) liveSessions(in *inbound) []sessionView { return r.sessionsOf(in.who.stateID) }
