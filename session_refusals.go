package relay

import (
	"net/http"
	"strconv"
	"time"
)

// The answers of a session's limits. Claude Code shows an error's message
// to the person at the keyboard, so each says which limit, how much, when
// it renews and what to do; all are 429 rate_limit_error with
// x-should-retry: false, since the SDK's retries cannot help.

// session reports whether the account is a session's budget.
func (a *spendAccount) session() bool { return a.scopeIs(spendOfSession) }

// keepFor is how long the fleet keeps a period's total after it ended: a
// session's window is for its session only.
func (a *spendAccount) keepFor() time.Duration {
	if a.session() {
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
func (a *spendAccount) holdKeysFor(now time.Time, ttl time.Duration) time.Duration {
	if a.scope != spendOfSession {
		return holdKeysTTL
	}
	end := a.periodEnd(periodDay, a.periods[periodDay].start).Add(sessionKeysAfter)
	return max(end.Sub(now), 2*ttl)
}

// windowNow is the session budget's window as of now: its budget, what
// was spent in it and when it ends.
func (a *spendAccount) windowNow(now time.Time) (limit, spent nanoUSD, end time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	ps := a.periods[periodDay]
	return a.caps[periodDay], ps.usd, a.periodEnd(periodDay, ps.start)
}

// sessionBudgetRefusal answers a request whose hold of worst does not fit
// in its session's budget (a, as ans judged it); tail, when it waited for
// holds in flight, says how long.
func (r *Relay) sessionBudgetRefusal(in *inbound, a *spendAccount, worst nanoUSD, ans holdAnswer, tail string) *relayError {
	metricSessionRefusals.WithLabelValues(in.who.key.group.name, sessionBudget).Inc()
	now := r.now()
	limit, spent, end := a.windowNow(now)
	spent = max(spent, ans.spent)
	rules := in.who.key.sessions
	wait := max(end.Sub(now), time.Second)
	budget := dollars(limit.usd()) + " per " + windowString(rules.window) + " (session_budget of " + in.who.key.describe() + ")"
	renews := "; it renews in " + wait.Round(time.Second).String() + ", at " + end.UTC().Format("15:04 MST")
	var msg string
	switch {
	case tail != "":
		msg = "this session's requests in flight hold " + dollars(ans.held.usd()) + " of the " + dollars(max(0, limit-spent).usd()) +
			" left of its budget of " + budget + ", and this request may cost up to " + dollars(worst.usd()) + tail +
			". Try again when they finish"
	case spent >= limit:
		msg = "this session has spent " + dollars(spent.usd()) + " of its budget of " + budget + renews +
			". Start a new session to go on now, or ask the relay's operator to raise session_budget"
	default:
		msg = "this session cannot afford this request: it may cost up to " + dollars(worst.usd()) +
			" (its input estimate and max_tokens), and " + dollars(max(0, limit-spent).usd()) + " remains of its budget of " + budget + renews +
			". Lower max_tokens, start a new session, or ask the relay's operator to raise session_budget"
	}
	e := &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "session_budget_exceeded",
		msg: msg, retryAfter: wait, noRetry: true}
	if tail != "" {
		e.retryAfter = holdRetryAfter
	}
	return e
}

// errSessionLoop answers the request that ends a session's conversation
// with the same tool call and result for the n-th time in a row.
func errSessionLoop(who string, n int) *relayError {
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "session_loop",
		msg: "this session sent the same tool call with the same result " + strconv.Itoa(n) + " times in a row (loop_guard " +
			strconv.Itoa(n) + " of " + who + "): the agent looks stuck in a loop, so the relay stopped it. " +
			"Give it new instructions or change what the tool returns: a request that ends with another result, or a new prompt, is served",
		noRetry: true}
}

// errSessionRate answers a request over its session's session_rate.
func errSessionRate(who, spec string, wait time.Duration) *relayError {
	wait = max(wait, time.Second)
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "session_rate_limited",
		msg: "this session is over its rate of " + spec + " requests (session_rate of " + who + "); it may send again in " +
			wait.Round(time.Second).String() + ". An agent this fast may be looping: look at what it is doing",
		retryAfter: wait, noRetry: true}
}
