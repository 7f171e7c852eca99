package relay

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
)

// Budget scopes. Besides a key's (or user entry's) budgets, a group may
// have budgets, on what its keys and users spend together, and a channel
// spend caps, on what is spent on it. Each is a spend account as a key's
// is (spend.go): kept by its id across reloads and restarts, shared by a
// fleet, and held against by the requests in flight (hold.go).
//
//   - A group's account exists from the group's first config, budget or
//     none, and every request of the group is charged to it, so that a
//     budget added later finds what the group spent in the period. A
//     request holds its worst case against the group's budgets as against
//     its key's, and waits or is refused as it would be for its key's.
//   - A channel's account exists while the channel has a spend_cap: a
//     channel without one costs nothing. A request's cost is charged to the
//     channel that served it. A channel whose cap is spent leaves selection
//     (state capped) until the period ends. A request holds its worst case
//     against the cap of the channel of each attempt, in place of the hold
//     of the channel it tried before; a channel whose cap cannot take that
//     hold is passed over for that request, which goes on to the next.

// spendScope is whose spend an account is.
type spendScope uint8

const (
	spendOfKey     spendScope = iota // a key's or a user entry's (or one identity's)
	spendOfGroup                     // a group's: its keys' and users' together
	spendOfChannel                   // a channel's: what requests served on it cost
	spendOfSession                   // an agent session's (sessions.go): never stored, never a metric
)

var spendScopeNames = [...]string{"key", "group", "channel", "session"}

func (s spendScope) String() string { return spendScopeNames[s] }

// who names the account's owner in an answer: key "ci", group "team-a".
func (a *spendAccount) who() string {
	return a.scope.String() + " " + strconv.Quote(a.label)
}

// scopeIs reports whether the account is of scope s.
func (a *spendAccount) scopeIs(s spendScope) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.scope == s
}

// principal names the key's or identity's account as the ledger does: the
// key's (or user entry's) name, and the identity ("" for a relay key).
func (a *spendAccount) principal() (key, user string) {
	a.mu.Lock()
	key = a.label
	a.mu.Unlock()
	if id, ok := strings.CutPrefix(a.id, userStatePrefix); ok {
		user = id
	}
	return key, user
}

// The ids of groups' and channels' accounts; a key's name may not start
// with either (nor with user:), so that no key's account is one of them.
const (
	groupSpendPrefix   = "group:"
	channelSpendPrefix = "channel:"
)

// takeSpend takes the account id from the pool for this config, with
// the budgets spec says.
func (r *Relay) takeSpend(id string, spec budgetSpec) (*spendAccount, error) {
	a, err := spend.account(id)
	if err != nil {
		return nil, err
	}
	r.held.addSpend(id)
	spec.logger, spec.now = r.logger, func() time.Time { return r.now() }
	spec.apply(a, r.fleet)
	return a, nil
}

// groupSpend takes the account of group cfg.
func (r *Relay) groupSpend(cfg *Group) (*spendAccount, error) {
	caps, _ := parseBudgets(cfg.Budgets) // validated already
	return r.takeSpend(groupSpendPrefix+cfg.Name, budgetSpec{scope: spendOfGroup, caps: caps, warn: cfg.BudgetWarn, label: cfg.Name})
}

// channelSpend takes the account of channel cfg when it has a spend cap;
// nil when it has none.
func (r *Relay) channelSpend(cfg *Channel) (*spendAccount, error) {
	if len(cfg.SpendCaps) == 0 {
		return nil, nil
	}
	caps, _ := parseBudgets(cfg.SpendCaps) // validated already
	return r.takeSpend(channelSpendPrefix+cfg.Name, budgetSpec{scope: spendOfChannel, caps: caps, label: cfg.Name})
}

// stateCapped is the state GET /relay/channels gives a channel whose
// spend cap is spent, and that is not out for another reason.
const stateCapped = "capped"

// capped reports whether one of the account's budgets is spent at now
// (its relay's clock when zero), and when the last of the spent ones ends.
func (a *spendAccount) capped(now time.Time) (spent bool, until time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if now.IsZero() {
		now = a.clock()
	}
	a.roll(now)
	for p := range numPeriods {
		ps := &a.periods[p]
		if limit := a.caps[p]; limit > 0 && ps.usd >= limit {
			spent = true
			if end := p.end(ps.start); end.After(until) {
				until = end
			}
		}
	}
	return spent, until
}

// firstSpent is the period of the first of the account's spent budgets
// at now.
func (a *spendAccount) firstSpent(now time.Time) (budgetPeriod, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	for p := range numPeriods {
		if limit := a.caps[p]; limit > 0 && a.periods[p].usd >= limit {
			return p, true
		}
	}
	return 0, false
}

// holdChannel plans the request's hold against the spend cap of ch, the
// channel of its next attempt, in place of its hold against the channel it
// tried before: the holds it took are given back, to be taken again with
// the attempt's admission. A request whose every model has no price holds
// nothing.
func (r *Relay) holdChannel(in *inbound, ch *channel) {
	hs := in.grant.holds
	var prev *spendAccount
	if hs != nil {
		prev = hs.channel
	}
	if prev == ch.spend || in.grant.worst == 0 {
		return
	}
	if hs == nil {
		hs = &holds{}
		in.grant.holds = hs
	}
	if hs.taken {
		hs.unreserve()
		hs.taken = false
	}
	if prev != nil {
		hs.n--
		hs.list[hs.n] = hold{}
		hs.channel, hs.capOf = nil, nil
	}
	if ch.spend != nil {
		hs.add(ch.spend, in.grant.worst)
		hs.list[hs.n-1].group = in.group().name
		hs.channel, hs.capOf = ch.spend, ch
	}
}

// maxCappedWait is the longest retry-after a capped channel's answer
// gives: a month's cap renews within it; a total cap never does.
const maxCappedWait = 31 * 24 * time.Hour

// scopeCapped is an attempt whose channel's spend cap could not take the
// request's hold: the request passes the channel over.
const scopeCapped limits.Scope = "spend_cap"

// scopeCapBusy is an attempt whose channel's spend cap could take the
// request's hold once holds in flight on it settle: the request passes
// the channel over, and waits for it when no other channel can serve.
const scopeCapBusy limits.Scope = "spend_cap_busy"

// errChannelsCapped answers a request whose every channel that serves
// its model is out, one of them (ch) because its spend cap is spent (or
// cannot take the request's worst case), until wait from now (0: never,
// by itself). It names the cap's period, never the channel or what was
// spent on it: a channel serves other groups too, and what it spent is
// theirs as much as this tenant's (the operator has GET /relay/channels).
func errChannelsCapped(model string, ch *channel, now time.Time, wait time.Duration) *relayError {
	msg := "every channel serving " + strconv.Quote(model) + " is out; one of them"
	if p, ok := ch.spend.firstSpent(now); ok {
		msg += " has spent its " + p.adjective() + " spend_cap"
	} else {
		msg += " cannot take this request's worst case within what is left of its spend_cap"
	}
	e := &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "no_healthy_channel",
		msg: msg, retryAfter: wait, cause: causeRelay}
	if wait <= 0 || wait > maxCappedWait { // a total cap, or out for other reasons with no end
		e.retryAfter, e.noRetry = 0, true
	}
	return e
}
