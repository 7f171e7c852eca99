package health

import (
	"time"
)

// Attempt is one attempt on a channel that its breaker let through. The
// channel must finish it (Finish), or abort it when it ends without a
// verdict (a panic).
type Attempt struct {
	done func(error)
}

// Allow asks the breaker for an attempt. A half-open breaker admits only
// as many attempts as it has probes; ok is false for the others, which
// skip the channel.
func (h *Channel) Allow() (a Attempt, ok bool) {
	done, err := h.breaker.Load().Allow()
	if err != nil {
		return Attempt{}, false
	}
	return Attempt{done: done}, true
}

// Finish records the verdict of an attempt Allow let through: breaker,
// counters, cooldown and latency. It returns the cooldown it started
// (zero when none).
func (h *Channel) Finish(a Attempt, v Verdict, p CooldownPolicy, now time.Time, firstByte time.Duration) time.Duration {
	switch {
	case v.Outcome == Canceled:
		a.done(errBreakerExcluded)
	case v.Outcome == Transient:
		a.done(errBreakerFailure)
	case v.Outcome.Retryable(): // 429, 529, auth, a refused model: the breaker is about failures
		a.done(errBreakerExcluded)
	default:
		a.done(nil)
	}
	if v.Outcome != Canceled {
		h.requests.Add(1)
	}
	if v.Outcome.Retryable() && v.Outcome != ModelRefused && v.Outcome != LacksFeature {
		h.failures.Add(1)
	}
	return h.Record(v, p, now, firstByte)
}

// Abort ends an attempt Allow let through that never got a verdict, so
// that the breaker's half-open slot is not lost.
func (h *Channel) Abort(a Attempt) { a.done(errBreakerExcluded) }
