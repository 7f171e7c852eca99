package relay

import (
	"context"
	"net/http"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"go.uber.org/zap"
)

// An attempter is a route's part of the attempt loop: what one admitted
// attempt sends to a channel, and how its answer is judged and committed.
// Everything else is the loop's, the same for every route: selection by
// the group's policy, admission, the group's queue, model fallbacks,
// retries and their budget, avoiding a host after a 529, waiting for a
// channel's recovery.
type attempter interface {
	// accept narrows the candidates to the channels the route may use
	// (nil: those that serve the request's model), for candidates that a
	// model does not name.
	accept() func(ch *channel, now time.Time) bool
	// attempt sends the request to ch once, admitted with t, which it
	// ends on every path. A done result has answered the client.
	attempt(r *Relay, w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int, t *ticket) attemptResult
	// noChannel is the answer to a request that found no channel before
	// its first attempt, for p.
	noChannel(p pickResult, s *selection, g *group) *relayError
}

// messageRoute is the attempter of Messages, count_tokens and Chat
// Completions.
type messageRoute struct{}

func (messageRoute) accept() func(*channel, time.Time) bool { return nil }

func (messageRoute) attempt(r *Relay, w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int, t *ticket) attemptResult {
	return r.attempt(w, req, in, ch, n, t)
}

func (messageRoute) noChannel(p pickResult, s *selection, g *group) *relayError { return p.err(s, g) }

// relay runs a message's attempts: Messages, count_tokens and Chat
// Completions.
func (r *Relay) relay(w http.ResponseWriter, req *http.Request, in *inbound) *failure {
	return r.failover(w, req, in, messageRoute{})
}

// failover selects a channel and attempts the request on it, as route
// sends it, until one answer reaches the client, failing over to untried
// channels on retryable outcomes, within the group's retries and retry
// budget. It returns what to answer when no upstream answer was
// committed, nil when the client has its answer or is gone.
func (r *Relay) failover(w http.ResponseWriter, req *http.Request, in *inbound, route attempter) *failure {
	g := in.group()
	g.state.budget.Request(r.now())
	in.grant.sel = selection{model: in.grant.target, tried: in.triedBuf[:0], rand: r.rand, accept: route.accept(), cheaper: in.grant.degrade.cheaper}
	sel := &in.grant.sel
	sel.needs = in.ask.needs
	if g.policy == policySticky || len(g.splits) > 0 {
		sel.session = in.sessionID()
	}
	sel.prefix = r.lookupAffinity(in, g)
	in.signerFor(sel, g)
	var last attemptResult
	var notLive *relayError // why the requested model could not be served, when a fallback was tried
	var recoveryDeadline time.Time
	q := &queued{r: r, g: g, in: in}
	defer q.leave()
	defer sel.unwant(g.name)
	for n := 1; ; {
		sel.now = r.now()
		// a newcomer does not overtake the queued requests of its class or better
		if n == 1 && q.w == nil && g.maxQueue > 0 && g.state.queue.ahead(in.who.key.prio) {
			if rerr := q.wait(req.Context(), time.Time{}); rerr != nil {
				return refused(rerr)
			}
			continue
		}
		p := g.pick(sel)
		switch p.reason {
		case exhausted, cooling, modelRefused, upstreamReset:
			// no channel of this model is live: a similar model may serve
			if next := g.fallbacks[in.servedAs()]; in.grant.fallbacks < len(next) {
				if notLive == nil && p.reason != exhausted {
					notLive = p.err(sel, g)
				}
				metricFallbacks.WithLabelValues(g.name, r.modelLabel(sel.model), r.modelLabel(next[in.grant.fallbacks])).Inc()
				in.grant.target, sel.model = next[in.grant.fallbacks], next[in.grant.fallbacks]
				in.grant.fallbacks++
				continue
			}
		}
		switch {
		case p.reason == picked:
		case n > 1: // every channel it could use is tried, cooling or busy
			return &failure{last: last, attempts: n - 1}
		case p.reason == allBusy, p.reason == upstreamReset && q.fits(p.until):
			// busy channels free up, and an upstream's reset comes, soon
			// enough to wait for in the queue, best class first
			if rerr := q.wait(req.Context(), p.until); rerr != nil {
				return refused(rerr)
			}
			continue
		case p.reason == cooling && p.capped != nil && sel.capBusy:
			// the room of a channel's cap is held by requests in flight: wait
			// for them to settle, as for a busy channel, polling for those
			// other relays settle
			if rerr := q.waitForCap(req.Context(), p.capped, sel); rerr != nil {
				return refused(rerr)
			}
			sel.capped, sel.capBusy = sel.capped[:0], false
			continue
		case p.reason == cooling && g.waitMax > 0 && r.waitForRecovery(req.Context(), untilFrom(p.until, sel.now), g.waitMax, sel.now, &recoveryDeadline):
			continue
		case notLive != nil:
			return refused(notLive) // the fallbacks could not serve either: say why the model could not
		default:
			return refused(route.noChannel(p, sel, g))
		}
		ch := p.ch
		if n > 1 && !g.state.budget.AllowRetry(sel.now, g.budgetRatio, g.budgetFloor) {
			r.logBudgetExhausted(g, in)
			return &failure{last: last, attempts: n - 1}
		}
		t, scope, rerr := r.admitTo(req.Context(), in, ch, sel.now, q)
		if rerr != nil {
			return refused(rerr)
		}
		switch {
		case scope == limits.ScopeFleetDown: // the fleet's store is down, and on_error says deny
			if n > 1 {
				return &failure{last: last, attempts: n - 1}
			}
			return refused(errStorageUnavailable())
		case scope == scopeCapped: // its spend cap cannot take the request's worst case
			sel.capped = append(sel.capped, ch)
			continue
		case scope == scopeCapBusy: // nor can it beside the holds in flight, for now
			sel.capped, sel.capBusy = append(sel.capped, ch), true
			sel.want(ch.spend, g.name)
			continue
		case t == nil && scope == limits.ScopeNone: // its half-open breaker is busy with other probes
			sel.skipped = append(sel.skipped, ch)
			continue
		case t == nil:
			continue // busy: another request took its last slot; pick again
		}
		q.leave()
		sel.tried = append(sel.tried, ch)
		in.end.tries(n)
		if n > 1 {
			metricFailovers.WithLabelValues(g.name).Inc()
			in.tr.failover(&last, n)
			in.waste(last, wasteFailover)
		}
		in.tr.startAttempt(in, ch, n)
		res := route.attempt(r, w, req, in, ch, n, t)
		in.tr.endAttempt(in, &res)
		switch {
		case res.done:
			return nil
		case res.verdict.outcome == outcomeCanceled:
			// the client is gone: nobody is left to fail over for, and a
			// departure spends no retry budget
			in.waste(res, wasteCanceled)
			in.leftBefore(res)
			return nil
		case !res.verdict.outcome.Retryable() || res.final || n > g.retries:
			return &failure{last: res, attempts: n}
		}
		last = res
		if res.verdict.outcome == outcomeOverloaded {
			sel.avoidHost = ch.host
		}
		n++
	}
}

// logBudgetExhausted logs that the retry budget stopped a failover. Apart
// from failover, so that the log fields take no room in failover's frame,
// which a stream keeps on its goroutine's stack while it lasts.
func (r *Relay) logBudgetExhausted(g *group, in *inbound) {
	r.logger.Debug("retry budget exhausted", zap.String("group", g.name), zap.String("request_id", in.id))
}

// recoveryPoll bounds one wait for a recovering channel, so that a channel
// brought back early (by a probe or the admin API) is noticed soon.
const recoveryPoll = 100 * time.Millisecond

// waitForRecovery waits until the first channel should have recovered (at
// most until waitMax has passed since the first call, whose deadline it
// keeps, and at most recoveryPoll at a time) and reports whether the
// request should look again.
func (r *Relay) waitForRecovery(ctx context.Context, recovery, waitMax time.Duration, now time.Time, deadline *time.Time) bool {
	if deadline.IsZero() {
		*deadline = now.Add(waitMax)
	}
	left := deadline.Sub(r.now())
	if left <= 0 {
		return false
	}
	d := min(left, recoveryPoll)
	if recovery > 0 {
		d = min(d, recovery)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
