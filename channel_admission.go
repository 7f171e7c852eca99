package relay

import (
	"time"

	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
)

// ticket is one admitted attempt on a channel: what its limits granted and
// what its breaker let through. It must be finished, or released when the
// attempt ends without a verdict (a panic).
type ticket struct {
	h        *channelHealth
	attempt  health.Attempt
	grant    limits.Grant // what the channel's limits admitted
	finished bool
}

// admit takes a slot of the channel's limits and asks the breaker for an
// attempt. A half-open breaker admits only as many attempts as it has
// probes; the others skip the channel. A nil ticket comes with the limit
// that refused it (another request took the last slot first), or none when
// the breaker did.
func (h *channelHealth) admit(now time.Time, estimate int64) (*ticket, limits.Scope) {
	g, scope, _ := h.limits.Take(now, estimate)
	if scope != limits.ScopeNone {
		return nil, scope
	}
	a, ok := h.Allow()
	if !ok {
		h.limits.Done(now, g, 0)
		return nil, limits.ScopeNone
	}
	return &ticket{h: h, attempt: a, grant: g}, limits.ScopeNone
}

// admitWith admits an attempt as admit does, and with it what goes along
// with a request's first attempt: the limits of riders (its key's and its
// end user's, when a fleet keeps them) and its holds of its budgets (hs;
// nil: none), all or nothing, in one round trip when the fleet keeps them.
// refused is the rider whose limits refused (-1: none; else a refusal is
// the channel's, as admit's); ans says why the holds were not taken. An
// admitted rider's g is what its limits admitted.
func (h *channelHealth) admitWith(now time.Time, estimate int64, riders []limits.Ask, hs *money.Holds) (t *ticket, refused int, scope limits.Scope, wait time.Duration, ans money.HoldAnswer) {
	var buf [4]limits.Ask
	asks := append(buf[:0], riders...)
	asks = append(asks, limits.Ask{Limiter: &h.limits, Estimate: estimate})
	refused, scope, wait, ans = takeAll(now, asks, hs)
	copy(riders, asks)
	if scope == limits.ScopeFleetDown {
		return nil, -1, scope, 0, ans
	}
	if refused >= 0 || ans.Verdict != money.HoldTaken {
		if refused == len(riders) { // the channel's own
			refused = -1
		}
		return nil, refused, scope, wait, ans
	}
	a, ok := h.Allow()
	if !ok { // its half-open breaker is busy with other probes
		limits.GiveBack(now, asks)
		copy(riders, asks)
		if hs != nil {
			hs.Unreserve()
		}
		return nil, -1, limits.ScopeNone, 0, money.HoldAnswer{}
	}
	return &ticket{h: h, attempt: a, grant: asks[len(riders)].Grant}, -1, limits.ScopeNone, 0, money.HoldAnswer{}
}

// finish records the verdict of the attempt: limits, then the channel's
// health (breaker, counters, cooldown and latency); tokens is what the
// attempt used against the channel's token limit. It returns the cooldown
// it started (zero when none).
func (t *ticket) finish(v verdict, p health.CooldownPolicy, now time.Time, firstByte time.Duration, tokens int64) time.Duration {
	if t.finished {
		return 0
	}
	t.finished = true
	h := t.h
	h.limits.Done(now, t.grant, tokens)
	h.wakeQueues()
	return h.Finish(t.attempt, v.forHealth(), p, now, firstByte)
}

// release ends an attempt that never got a verdict, so the in-flight count
// and the breaker's half-open slot are not lost.
func (t *ticket) release(now func() time.Time) {
	if !t.finished {
		t.finished = true
		t.h.limits.Done(now(), t.grant, 0)
		t.h.Abort(t.attempt)
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
