package relay

import (
	"net/http"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/money"
)

// The answers of a session's limits. Claude Code shows an error's message
// to the person at the keyboard, so each says which limit, how much, when
// it renews and what to do; all are 429 rate_limit_error with
// x-should-retry: false, since the SDK's retries cannot help.

// sessionBudgetRefusal answers a request whose hold of worst does not fit
// in its session's budget (a, as ans judged it); tail, when it waited for
// holds in flight, says how long.
func (r *Relay) sessionBudgetRefusal(in *inbound, a *money.Account, worst money.NanoUSD, ans money.HoldAnswer, tail string) *relayError {
	metricSessionRefusals.WithLabelValues(in.who.key.group.name, sessionBudget).Inc()
	now := r.now()
	limit, spent, end := a.WindowNow(now)
	spent = max(spent, ans.Spent)
	rules := in.who.key.sessions
	wait := max(end.Sub(now), time.Second)
	budget := dollars(limit.USD()) + " per " + windowString(rules.window) + " (session_budget of " + in.who.key.describe() + ")"
	renews := "; it renews in " + wait.Round(time.Second).String() + ", at " + end.UTC().Format("15:04 MST")
	var msg string
	switch {
	case tail != "":
		msg = "this session's requests in flight hold " + dollars(ans.Held.USD()) + " of the " + dollars(max(0, limit-spent).USD()) +
			" left of its budget of " + budget + ", and this request may cost up to " + dollars(worst.USD()) + tail +
			". Try again when they finish"
	case spent >= limit:
		msg = "this session has spent " + dollars(spent.USD()) + " of its budget of " + budget + renews +
			". Start a new session to go on now, or ask the relay's operator to raise session_budget"
	default:
		msg = "this session cannot afford this request: it may cost up to " + dollars(worst.USD()) +
			" (its input estimate and max_tokens), and " + dollars(max(0, limit-spent).USD()) + " remains of its budget of " + budget + renews +
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
