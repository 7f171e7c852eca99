package relay

import (
	"time"

	"github.com/caddy-relay/relay/internal/limits"
)

// What goes with a request's first attempt. In a fleet, a request's key's
// limits (its user entry's, its identity's) and its end user's are not
// asked of Redis when the request arrives: the key's gate (enter) lets it
// in on what this relay knows, and both are admitted with the request's
// first channel, its holds too, in the one round trip the request makes to
// Redis before its first attempt (none when this node's blocks serve them
// all, internal/limits). A request answered without an attempt (a cached
// answer, another request's) is admitted against them on its own first.

// takeAll admits one request against the limiters of asks and its holds
// (hs; nil: none), all or nothing (limits.TakeAll); ans says why the holds
// were not taken.
func takeAll(now time.Time, asks []limits.Ask, hs *holds) (refused int, scope limits.Scope, wait time.Duration, ans holdAnswer) {
	if hs == nil {
		return limits.TakeAll[holdAnswer](now, asks, nil)
	}
	return limits.TakeAll[holdAnswer](now, asks, hs)
}

// admitFirst admits the request's attempt on ch, and with it its key's
// and end user's limits when they are pending and its holds (hs; nil:
// none), all or nothing. rerr answers a request its key's or its end
// user's limits refused; ans says why the holds were not taken; else a nil
// ticket is the channel's refusal (scope), as admit's.
func (r *Relay) admitFirst(in *inbound, ch *channel, now time.Time, hs *holds) (*ticket, limits.Scope, holdAnswer, *relayError) {
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
