package money

import (
	"strconv"
	"time"
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

// Scope is whose spend an account is.
type Scope uint8

const (
	OfKey     Scope = iota // a key's or a user entry's (or one identity's)
	OfGroup                // a group's: its keys' and users' together
	OfChannel              // a channel's: what requests served on it cost
	OfSession              // an agent session's: never stored, never a metric
)

var spendScopeNames = [...]string{"key", "group", "channel", "session"}

// String names the scope: key, group, channel or session.
func (s Scope) String() string { return spendScopeNames[s] }

// Who names the account's owner in an answer: key "ci", group "team-a".
func (a *Account) Who() string {
	return a.scope.String() + " " + strconv.Quote(a.label)
}

// scopeIs reports whether the account is of scope s.
func (a *Account) scopeIs(s Scope) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.scope == s
}

// The ids of groups' and channels' accounts; a key's name may not start
// with either (nor with user:), so that no key's account is one of them.
const (
	GroupPrefix   = "group:"
	ChannelPrefix = "channel:"
)

// Capped reports whether one of the account's budgets is spent at now
// (its relay's clock when zero), and when the last of the spent ones ends.
func (a *Account) Capped(now time.Time) (spent bool, until time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if now.IsZero() {
		now = a.clock()
	}
	a.roll(now)
	for p := range NumPeriods {
		ps := &a.periods[p]
		if limit := a.caps[p]; limit > 0 && ps.usd >= limit {
			spent = true
			if end := p.End(ps.start); end.After(until) {
				until = end
			}
		}
	}
	return spent, until
}

// FirstSpent is the period of the first of the account's spent budgets
// at now.
func (a *Account) FirstSpent(now time.Time) (Period, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	for p := range NumPeriods {
		if limit := a.caps[p]; limit > 0 && a.periods[p].usd >= limit {
			return p, true
		}
	}
	return 0, false
}
