package relay

import (
	"context"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
)

// A request's admission: the one path that gathers what a request asks of
// the limits (internal/limits: its key's, its end user's, its channel's)
// and of the budgets (internal/money: its holds), and has them taken
// together, all or none.
//
// What goes with a request's first attempt. In a fleet, a request's key's
// limits (its user entry's, its identity's) and its end user's are not
// asked of Redis when the request arrives: the key's gate (Enter) lets it
// in on what this relay knows, and both are admitted with the request's
// first channel, its holds too, in the one round trip the request makes to
// Redis before its first attempt (none when this node's blocks serve them
// all, internal/limits). A request answered without an attempt (a cached
// answer, another request's) is admitted against them on its own first.

// takeAll admits one request against the limiters of asks and its holds
// (hs; nil: none), all or nothing (limits.TakeAll); ans says why the holds
// were not taken.
func takeAll(now time.Time, asks []limits.Ask, hs *money.Holds) (refused int, scope limits.Scope, wait time.Duration, ans money.HoldAnswer) {
	if hs == nil {
		return limits.TakeAll[money.HoldAnswer](now, asks, nil)
	}
	return limits.TakeAll[money.HoldAnswer](now, asks, hs)
}

// admitTo is the failover loop's one admission of an attempt on ch: the
// attempt takes the channel's limits and breaker, and with them, all or
// nothing, what the request still owes its first admission: its hold of
// the channel's spend cap, its holds of its budgets (admitHeld), its key's
// and end user's limits pending in a fleet (admitFirst, one round trip).
// rerr answers the request; else a nil ticket is the channel's refusal
// (scope), and the loop picks again.
func (r *Relay) admitTo(ctx context.Context, in *inbound, ch *channel, now time.Time, q *queued) (t *ticket, scope limits.Scope, rerr *relayError) {
	if ch.spend != nil || in.grant.holds != nil && in.grant.holds.Channel() != nil {
		r.holdChannel(in, ch) // its hold of a channel's spend cap goes with the attempt
	}
	switch {
	case in.grant.holds.Pending(): // its holds of its budgets go with its first attempt's admission
		return r.admitHeld(ctx, in, ch, now, q)
	case in.grant.keyGrant.Pending || in.grant.endUserPending != nil: // one round trip for the key, the end user and the channel
		t, scope, _, rerr = r.admitFirst(in, ch, now, nil)
		return t, scope, rerr
	}
	t, scope = ch.health.admit(now, in.ask.estimate)
	return t, scope, nil
}

// admitFirst admits the request's attempt on ch, and with it its key's
// and end user's limits when they are pending and its holds (hs; nil:
// none), all or nothing. rerr answers a request its key's or its end
// user's limits refused; ans says why the holds were not taken; else a nil
// ticket is the channel's refusal (scope), as admit's.
func (r *Relay) admitFirst(in *inbound, ch *channel, now time.Time, hs *money.Holds) (*ticket, limits.Scope, money.HoldAnswer, *relayError) {
	var buf [2]limits.Ask
	riders, key, user := in.riders(buf[:0])
	t, refused, scope, wait, ans := ch.health.admitWith(now, in.ask.estimate, riders, hs)
	if t != nil {
		in.admitted(riders, key, user)
	}
	return t, scope, ans, in.ridersRefused(riders, key, user, refused, scope, wait)
}

// admitPending admits a request that is answered without an attempt
// against its key's and end user's limits, when they are pending.
func (r *Relay) admitPending(in *inbound) *relayError {
	if !in.grant.keyGrant.Pending && in.grant.endUserPending == nil {
		return nil
	}
	var buf [2]limits.Ask
	riders, key, user := in.riders(buf[:0])
	refused, scope, wait, _ := takeAll(r.now(), riders, nil)
	if scope == limits.ScopeFleetDown {
		return errStorageUnavailable()
	}
	if refused < 0 {
		in.admitted(riders, key, user)
		return nil
	}
	return in.ridersRefused(riders, key, user, refused, scope, wait)
}

// riders are the request's limits that go with its first attempt: its
// key's (index key, -1: none) and its end user's (user), when pending.
func (in *inbound) riders(buf []limits.Ask) (riders []limits.Ask, key, user int) {
	key, user = -1, -1
	if in.grant.keyGrant.Pending {
		est := int64(-1)
		if in.grant.keyGrant.Tokens {
			est = in.grant.keyGrant.Charged
		}
		key = len(buf)
		buf = append(buf, limits.Ask{Limiter: in.who.state.limits, Estimate: est})
	}
	if in.grant.endUserPending != nil {
		user = len(buf)
		buf = append(buf, limits.Ask{Limiter: in.grant.endUserPending, Estimate: in.grant.endUserEstimate})
	}
	return buf, key, user
}

// admitted takes in what the riders' limits admitted.
func (in *inbound) admitted(riders []limits.Ask, key, user int) {
	if key >= 0 {
		in.who.state.limits.Resolve(&in.grant.keyGrant, riders[key].Grant)
		in.grant.keyAsked = true
	}
	if user >= 0 {
		in.grant.endUser, in.grant.endUserGrant, in.grant.endUserPending = in.grant.endUserPending, riders[user].Grant, nil
	}
}

// ridersRefused is the answer to a request whose key's or end user's
// limits refused it (refused, an index of riders); nil for another
// refusal. The key's pending grant stays, to be given back, and tells the
// rate limit headers what is left.
func (in *inbound) ridersRefused(riders []limits.Ask, key, user, refused int, scope limits.Scope, wait time.Duration) *relayError {
	switch {
	case refused < 0 || scope == limits.ScopeFleetDown:
		return nil
	case refused == key:
		in.grant.keyGrant.Left, in.grant.keyAsked = riders[key].Grant.Left, true
		metricRateLimited.WithLabelValues(in.who.key.name, string(scope)).Inc()
		return errKeyLimited(in.who.key.describe(), scope, wait)
	case refused == user:
		return endUserRefused(in, scope, wait)
	}
	return nil
}

// admitHeld admits an attempt on ch together with the request's holds
// (and its key's and end user's limits, when they are pending), all or nothing, in
// one round trip to the fleet when the fleet keeps them. A hold that
// cannot fit answers the request (rerr); a hold that must wait for holds in
// flight waits in the queue, and then the loop picks again (nil ticket,
// scopeBudget).
func (r *Relay) admitHeld(ctx context.Context, in *inbound, ch *channel, now time.Time, q *queued) (*ticket, limits.Scope, *relayError) {
	hs := in.grant.holds
	first := hs.Account(0)
	// a newcomer does not overtake the requests of its class or better
	// that wait on its budget (unless they are gone by the time it is in
	// line)
	if q.w == nil && q.g.maxQueue > 0 && q.g.state.queue.aheadOn(in.who.key.prio, first) {
		inLine := func() bool { return q.g.state.queue.isBest(q.w) }
		return nil, scopeBudget, r.waitForHolds(ctx, in, q, money.HoldAnswer{Verdict: money.HoldWait}, inLine)
	}
	// what settled since it looked: a hold that settles before it is in
	// line wakes nobody for it
	var freed [money.MaxHolds]uint64
	for i := range hs.Len() {
		freed[i] = hs.Account(i).Freed()
	}
	t, scope, ans, rerr := r.admitFirst(in, ch, now, hs)
	switch {
	case ans.Verdict == money.HoldWait && hs.Channel() != nil && hs.Account(ans.Index) == hs.Channel():
		return nil, scopeCapBusy, nil // the channel's cap is held by others: the next channel may take it, else it waits
	case ans.Verdict != money.HoldTaken && hs.Channel() != nil && hs.Account(ans.Index) == hs.Channel():
		return nil, scopeCapped, nil // the channel's cap cannot take it: the next channel may
	case ans.Verdict == money.HoldRefused:
		return nil, limits.ScopeNone, r.budgetRefusal(in, hs.Account(ans.Index), hs.Amount(ans.Index), ans)
	case ans.Verdict == money.HoldWait:
		settled := func() bool { return hs.Account(ans.Index).Freed() != freed[ans.Index] }
		return nil, scopeBudget, r.waitForHolds(ctx, in, q, ans, settled)
	case rerr != nil:
		return nil, scope, rerr
	case t != nil:
		hs.Taken = true
	}
	return t, scope, nil
}

// waitForHolds waits in the queue, as a request on the budget of the hold
// that did not fit, until a hold of that account settles (or ready says
// it did already); nil when it is to try again, else its answer.
func (r *Relay) waitForHolds(ctx context.Context, in *inbound, q *queued, ans money.HoldAnswer, ready func() bool) *relayError {
	a, usd := in.grant.holds.Account(ans.Index), in.grant.holds.Amount(ans.Index)
	freeAt := time.Time{}
	if a.InFleet() {
		freeAt = r.now().Add(fleetHoldPoll)
	}
	return q.waitOn(ctx, a, freeAt, ready, func(why queueRefusal) *relayError {
		metricRateLimited.WithLabelValues(in.who.key.name, string(scopeBudget)).Inc()
		tail := "; its group does not queue"
		switch why {
		case queueWaited:
			tail = "; it waited " + q.g.maxWait[in.who.key.prio].String() + " (max_wait of class " + in.who.key.prio.String() + ") for them to settle"
		case queueFull:
			tail = "; the queue is full"
		}
		now := a.Tightest(r.now(), usd) // as things stand when it gives up
		if a.Session() {
			return r.sessionBudgetRefusal(in, a, usd, now, tail)
		}
		return errBudgetHeld(a.Who(), now, a.CapOf(now.Period), usd, tail)
	})
}
