package money

import "time"

// Session reports whether the account is a session's budget.
func (a *Account) Session() bool { return a.scopeIs(OfSession) }

// keepFor is how long the fleet keeps a period's total after it ended: a
// session's window is for its session only.
func (a *Account) keepFor() time.Duration {
	if a.Session() {
		return sessionKeysAfter
	}
	return spendKeyTTL
}

// sessionKeysAfter is how long the fleet keeps a session's keys after its
// budget's window ended.
const sessionKeysAfter = time.Hour

// holdKeysFor is how long the fleet keeps the account's holds after a
// hold of a lease of ttl is taken at now, under a.mu: a session's, as long
// as its window's spend, and at least as long as the hold may be renewed
// for; the others', longer than a batch's hold.
func (a *Account) holdKeysFor(now time.Time, ttl time.Duration) time.Duration {
	if a.scope != OfSession {
		return holdKeysTTL
	}
	end := a.periodEnd(PeriodDay, a.periods[PeriodDay].start).Add(sessionKeysAfter)
	return max(end.Sub(now), 2*ttl)
}

// WindowNow is the session budget's window as of now: its budget, what
// was spent in it and when it ends.
func (a *Account) WindowNow(now time.Time) (limit, spent NanoUSD, end time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	ps := a.periods[PeriodDay]
	return a.caps[PeriodDay], ps.usd, a.periodEnd(PeriodDay, ps.start)
}
