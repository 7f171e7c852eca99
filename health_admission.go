package relay

import (
	"time"
)

// ticket is one admitted attempt on a channel. It must be finished, or
// released when the attempt ends without a verdict (a panic).
type ticket struct {
	h        *channelHealth
	done     func(error)
	grant    grant // what the channel's limits admitted
	finished bool
}

// admit takes a slot of the channel's limits and asks the breaker for an
// attempt. A half-open breaker admits only as many attempts as it has
// probes; the others skip the channel. A nil ticket comes with the limit
// that refused it (another request took the last slot first), or none when
// the breaker did.
func (h *channelHealth) admit(now time.Time, estimate int64) (*ticket, limitScope) {
	g, scope, _ := h.limits.take(now, estimate)
	if scope != scopeNone {
		return nil, scope
	}
	done, err := h.breaker.Load().Allow()
	if err != nil {
		h.limits.done(now, g, 0)
		return nil, scopeNone
	}
	return &ticket{h: h, done: done, grant: g}, scopeNone
}

// admitAlong admits an attempt as admit does, and with it the request's
// end user's limits (user, charged userEstimate tokens), both or neither,
// in one round trip when the fleet keeps both. byUser says that the end
// user's limits refused; else a refusal is the channel's, as admit's.
func (h *channelHealth) admitAlong(now time.Time, estimate int64, user *limiter, userEstimate int64) (t *ticket, userGrant grant, scope limitScope, wait time.Duration, byUser bool) {
	ug, g, scope, wait, byUser := takeBoth(now, user, userEstimate, &h.limits, estimate)
	if scope != scopeNone {
		return nil, grant{}, scope, wait, byUser
	}
	done, err := h.breaker.Load().Allow()
	if err != nil { // its half-open breaker is busy with other probes
		h.limits.done(now, g, 0)
		user.done(now, ug, 0)
		return nil, grant{}, scopeNone, 0, false
	}
	return &ticket{h: h, done: done, grant: g}, ug, scopeNone, 0, false
}

// admitHeld admits an attempt as admitAlong does (user nil: no end user's
// limits), and with it the request's holds of its budgets (hs), all or
// nothing: in the same round trip when the fleet keeps them. ans says why
// the holds were not taken, when they were not.
func (h *channelHealth) admitHeld(now time.Time, estimate int64, user *limiter, userEstimate int64, hs *holds) (t *ticket, userGrant grant, scope limitScope, wait time.Duration, byUser bool, ans holdAnswer) {
	ug, g, scope, wait, byUser, ans := takeHeld(now, user, userEstimate, &h.limits, estimate, hs)
	if scope != scopeNone || ans.verdict != holdTaken {
		return nil, grant{}, scope, wait, byUser, ans
	}
	done, err := h.breaker.Load().Allow()
	if err != nil { // its half-open breaker is busy with other probes
		h.limits.done(now, g, 0)
		if user != nil {
			user.done(now, ug, 0)
		}
		hs.unreserve()
		return nil, grant{}, scopeNone, 0, false, holdAnswer{}
	}
	return &ticket{h: h, done: done, grant: g}, ug, scopeNone, 0, false, holdAnswer{}
}

// finish records the verdict of the attempt: limits, counters, breaker,
// cooldown and latency; tokens is what the attempt used against the
// channel's token limit. It returns the cooldown it started (zero when
// none).
func (t *ticket) finish(v verdict, p cooldownPolicy, now time.Time, firstByte time.Duration, tokens int64) time.Duration {
	if t.finished {
		return 0
	}
	t.finished = true
	h := t.h
	h.limits.done(now, t.grant, tokens)
	h.wakeQueues()
	switch {
	case v.outcome == outcomeCanceled:
		t.done(errBreakerExcluded)
	case v.outcome == outcomeTransient:
		t.done(errBreakerFailure)
	case v.outcome.retryable(): // 429, 529, auth, a refused model: the breaker is about failures
		t.done(errBreakerExcluded)
	default:
		t.done(nil)
	}
	if v.outcome != outcomeCanceled {
		h.requests.Add(1)
	}
	if v.outcome.retryable() && v.outcome != outcomeModelRefused && v.outcome != outcomeLacksFeature {
		h.failures.Add(1)
	}
	return h.record(v, p, now, firstByte)
}

// release ends an attempt that never got a verdict, so the in-flight count
// and the breaker's half-open slot are not lost.
func (t *ticket) release(now func() time.Time) {
	if !t.finished {
		t.finished = true
		t.h.limits.done(now(), t.grant, 0)
		t.done(errBreakerExcluded)
		t.h.wakeQueues()
	}
}

// wakeQueues tells the queues of the channel's groups that a slot freed.
func (h *channelHealth) wakeQueues() {
	if qs := h.queues.Load(); qs != nil {
		for _, q := range *qs {
			q.wakeBest()
		}
	}
}
