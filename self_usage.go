package relay

import (
	"cmp"
	"encoding/base64"
	"encoding/binary"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/money"
)

// Self-service usage. GET /v1/relay/usage answers the principal that asks
// (the relay key it sends, or the identity an authentication handler
// established) its own limits, spend, holds, budgets, degrade state and
// live sessions, so that a developer or an agent can see where it stands
// without the operator's admin API. It answers only the principal's own
// state and names no other key, user or channel; it never holds a secret
// (neither the key nor an upstream's credential). It is answered by the
// relay itself: no upstream is asked. Each call counts against the key's
// `rate` as a request does, and against nothing else (no concurrency slot,
// no tokens): a client that polls it in a loop is held to its own rate,
// and gets the relay's 429 past it. Its cost is bounded: it lists at most
// maxUsageSessions sessions, newest first, a page at a time.

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
	// Sessions are a page of the principal's live sessions on this relay,
	// the newest first (by when this relay first saw each): at most limit
	// (maxUsageSessions by default and at most), after after_id or before
	// before_id.
	Sessions []sessionView `json:"sessions"`
	// HasMore says more sessions follow the page (asked with before_id:
	// come before it). FirstID and LastID are the cursors of its first
	// and last session: before_id=FirstID asks for the page before it,
	// after_id=LastID for the page after; null for an empty page.
	HasMore bool    `json:"has_more"`
	FirstID *string `json:"first_id"`
	LastID  *string `json:"last_id"`
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

// serveUsage answers GET /v1/relay/usage for the principal of in, once
// its rate admitted the call.
func (r *Relay) serveUsage(w http.ResponseWriter, req *http.Request, in *inbound) *relayError {
	if rerr := r.admitUsage(in); rerr != nil {
		return rerr
	}
	page, rerr := parseSessionPage(req.URL.Query())
	if rerr != nil {
		return rerr
	}
	now := r.now()
	k, st := in.who.key, in.who.state
	a := usageAnswer{Kind: k.kind(), Name: k.name, Group: k.group.name, Priority: k.prio.String(),
		Limits: limitsStatus{Rate: k.opts.Rate, Tokens: k.opts.Tokens}, Budgets: []usageBudget{}}
	a.Sessions, a.HasMore = r.pageSessions(in.who.stateID, page, now)
	if n := len(a.Sessions); n > 0 {
		first, last := sessionCursor(a.Sessions[0]), sessionCursor(a.Sessions[n-1])
		a.FirstID, a.LastID = &first, &last
	}
	if k.kind() == kindUser {
		a.Identity = r.identityOf(req)
	}
	if !k.expires.IsZero() {
		at := k.expires.UTC()
		a.Expires = &at
	}
	a.Limits.Concurrency, a.Limits.Inflight = st.limits.MaxConcurrency(), st.limits.Inflight()
	a.Limits.RateRemaining, a.Limits.TokensRemaining = st.limits.Remaining(now)

	if acct := st.spend; acct != nil {
		spent, caps := acct.Spent(now)
		a.SpendUSD = map[string]float64{}
		for p := range money.NumPeriods {
			if p != money.PeriodTotal || caps[p] > 0 { // the total counts only with a budget
				a.SpendUSD[p.String()] = spent[p]
			}
		}
		a.Holds.Requests, a.Holds.USD = acct.HoldsNow()
	}
	accts, n := in.budgetAccounts()
	for _, acct := range accts[:n] {
		scope := acct.Scope().String()
		if acct == st.spend {
			scope = k.kind()
		}
		acct.Rooms(now, func(b money.Room) {
			a.Budgets = append(a.Budgets, usageBudget{Scope: scope, Period: b.Period.String(), LimitUSD: b.Limit.USD(),
				SpentUSD: b.Spent.USD(), HeldUSD: b.Held.USD(), RemainingUSD: b.Left().USD(), PeriodEnd: b.Period.End(b.Start)})
		})
	}
	t := in.tightestBudget(now)
	a.Degrade = r.degradeState(in, t)
	if t.Known {
		left, used := t.Left().USD(), t.Percent()
		a.BudgetRemainingUSD, a.Degrade.UsedPercent = &left, &used
	}
	w.Header().Set("Cache-Control", "private, no-store") // one principal's: no shared cache may keep it
	r.ratelimitHeaders(w.Header(), in)
	writeJSON(w, a)
	return nil
}

// admitUsage counts a usage call against its principal's request rate
// (takeRate), and refuses it past the rate as a request's admission does.
func (r *Relay) admitUsage(in *inbound) *relayError {
	g, scope, wait := in.who.state.limits.TakeRate(r.now())
	return r.keyAdmitted(in, g, scope, wait)
}

// maxUsageSessions is how many sessions one usage answer lists, by
// default and at most: a principal may keep a thousand in a group.
const maxUsageSessions = 100

// sessionPage is the page of sessions a usage call asks for: at most
// limit, after the cursor after or before the cursor before (at most one
// of them; neither: the newest).
type sessionPage struct {
	limit         int
	after, before *sessionPos
}

// sessionPos is where a session stands in a principal's list, newest
// first: when this relay first saw it (Unix nanoseconds: the wall clock,
// as a cursor carries it), then its digest.
type sessionPos struct {
	started int64
	id      string
}

// comparePos orders positions as the list does: the newest first, sessions
// seen first at the same instant by their digests.
func comparePos(a, b sessionPos) int {
	return cmp.Or(cmp.Compare(b.started, a.started), strings.Compare(a.id, b.id))
}

// cursorPrefix starts a cursor of a usage answer's sessions.
const cursorPrefix = "sesscur_"

// sessionCursor is the cursor of the session v: its position, opaque to
// the client. It says nothing the answer does not (v's started and
// session), and names nothing of another principal's.
func sessionCursor(v sessionView) string {
	b := binary.BigEndian.AppendUint64(make([]byte, 0, 8+len(v.Session)), uint64(v.Started.UnixNano()))
	return cursorPrefix + base64.RawURLEncoding.EncodeToString(append(b, v.Session...))
}

// parseCursor reads a cursor of sessionCursor's.
func parseCursor(s string) (*sessionPos, bool) {
	rest, ok := strings.CutPrefix(s, cursorPrefix)
	if !ok {
		return nil, false
	}
	b, err := base64.RawURLEncoding.DecodeString(rest)
	if err != nil || len(b) <= 8 || len(b) > 8+maxIDLen {
		return nil, false
	}
	return &sessionPos{started: int64(binary.BigEndian.Uint64(b)), id: string(b[8:])}, true
}

// parseSessionPage reads a usage call's limit, after_id and before_id, as
// Anthropic's lists take them.
func parseSessionPage(q url.Values) (sessionPage, *relayError) {
	p := sessionPage{limit: maxUsageSessions}
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxUsageSessions {
			return p, errInvalid("limit: must be a number from 1 to " + strconv.Itoa(maxUsageSessions))
		}
		p.limit = n
	}
	var rerr *relayError
	if p.after, rerr = cursorParam(q, "after_id"); rerr != nil {
		return p, rerr
	}
	if p.before, rerr = cursorParam(q, "before_id"); rerr != nil {
		return p, rerr
	}
	if p.after != nil && p.before != nil {
		return p, errInvalid("after_id and before_id: give one of them, not both")
	}
	return p, nil
}

// cursorParam is the cursor the query parameter name gives; nil without
// one.
func cursorParam(q url.Values, name string) (*sessionPos, *relayError) {
	v := q.Get(name)
	if v == "" {
		return nil, nil
	}
	pos, ok := parseCursor(v)
	if !ok {
		return nil, errInvalid(name + ": not a cursor of this list; give the first_id or last_id of a page")
	}
	return pos, nil
}

// pageSessions is the page p of the live sessions of the principal
// stateID on this relay (never another principal's), and whether more
// follow it (before it, for a page before a cursor). Only the page's
// sessions are shown (view); the others are only put in order.
func (r *Relay) pageSessions(stateID string, p sessionPage, now time.Time) ([]sessionView, bool) {
	var all []*session
	for _, g := range r.groups {
		c := g.state.sessions.Load()
		if c == nil {
			continue
		}
		if ps, ok := c.Peek(stateID); ok {
			eachLive(now, stateID, ps, func(_ string, s *session) { all = append(all, s) })
		}
	}
	pos := func(s *session) sessionPos { return sessionPos{started: s.started.UnixNano(), id: s.id} }
	slices.SortFunc(all, func(a, b *session) int { return comparePos(pos(a), pos(b)) })
	lo, hi := 0, len(all)
	if p.after != nil { // the first one after it
		lo, _ = slices.BinarySearchFunc(all, *p.after, func(s *session, at sessionPos) int {
			if comparePos(pos(s), at) <= 0 {
				return -1
			}
			return 1
		})
	}
	if p.before != nil { // those before it
		hi, _ = slices.BinarySearchFunc(all, *p.before, func(s *session, at sessionPos) int { return comparePos(pos(s), at) })
	}
	from, to, more := lo, min(hi, lo+p.limit), lo+p.limit < hi
	if p.before != nil {
		from, to, more = max(lo, hi-p.limit), hi, hi-p.limit > lo
	}
	out := make([]sessionView, 0, to-from)
	for _, s := range all[from:to] {
		out = append(out, s.view(now))
	}
	return out, more
}

// degradeState is the principal's budget_degrade as its usage answer says
// it: its steps and what a message would get with the tightest budget t.
func (r *Relay) degradeState(in *inbound, t money.Room) usageDegrade {
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
