package money

import "time"

// Room is one budget as a request sees it: what it is, what was
// spent in its period and what the requests in flight hold against it.
type Room struct {
	Account            *Account  // whose budget
	Period             Period    // the budget's period
	Limit, Spent, Held NanoUSD   // the budget, what was spent and what is held
	Start              time.Time // of its period
	Known              bool      // a budget applies
}

// Left is what remains of the budget once the holds in flight cost what
// they hold: never below zero.
func (b Room) Left() NanoUSD { return max(0, b.Limit-b.Spent-b.Held) }

// Percent is the share of the budget spent and held, in percent, from 0
// (exact for whole shares of whole amounts: $8 of $10 is 80).
func (b Room) Percent() float64 {
	if b.Limit <= 0 {
		return 0
	}
	return float64(b.Spent+b.Held) * 100 / float64(b.Limit)
}

// Tighter reports whether b leaves less than c (or as little, and is
// spent where c is not, or is more used): the tightest budget is the one
// with the least left, and a spent one when any is.
func (b Room) Tighter(c Room) bool {
	if !c.Known {
		return b.Known
	}
	if !b.Known {
		return false
	}
	if bl, cl := b.Left(), c.Left(); bl != cl {
		return bl < cl
	}
	if bs, cs := b.Spent >= b.Limit, c.Spent >= c.Limit; bs != cs {
		return bs
	}
	return b.Percent() > c.Percent()
}

// Rooms calls each with every budget of the account at now.
func (a *Account) Rooms(now time.Time, each func(Room)) {
	a.mu.Lock()
	a.roll(now)
	held := a.heldLocked()
	var rs [NumPeriods]Room
	n := 0
	for p := range NumPeriods {
		if limit := a.caps[p]; limit > 0 {
			rs[n] = Room{Account: a, Period: p, Limit: limit, Spent: a.periods[p].usd, Held: held, Start: a.periods[p].start, Known: true}
			n++
		}
	}
	a.mu.Unlock()
	for _, r := range rs[:n] {
		each(r)
	}
}

// Budgeted are those of the principal's, the group's and the session's
// accounts (each may be nil) that have a budget.
func Budgeted(principal, group, session *Account) (accts [3]*Account, n int) {
	for _, a := range [3]*Account{principal, group, session} {
		if a != nil && a.budgeted.Load() {
			accts[n] = a
			n++
		}
	}
	return accts, n
}
