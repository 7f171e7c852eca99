package relay

import (
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/idle"
	"github.com/caddy-relay/relay/internal/limits"
)

// End user limits: a key's (or a user entry's) user_rate and user_tokens
// hold each of its end users, told apart by the metadata.user_id of the
// request body, to a limit of their own. The id is the client's to choose,
// so the limiters are kept in an idle.Cache (bounded in number, dropped
// when idle), by the principal's state id and the id bounded in length,
// and never name a metric.

// admitEndUser holds a request to its entry's user_rate and user_tokens.
// It runs once the body is read, since the end user is named in it; a
// request without metadata.user_id is not held to them. In a fleet, the
// end user is admitted later, together with the request's first channel
// (in.endUserPending), so that both take the request's one round trip to
// the store after its body.
func (r *Relay) admitEndUser(in *inbound) *relayError {
	k := in.who.key
	if !k.endUsers || in.ask.userID == "" {
		return nil
	}
	now := r.now()
	l := k.state.endUser(in.who.stateID+"\x00"+boundedID(in.ask.userID), now)
	if l == nil {
		return nil // a reload is taking the limits away
	}
	estimate := int64(-1) // other routes are not held to the token limit
	if in.route == routeMessages {
		estimate = in.ask.estimate
	}
	if l.InFleet() {
		in.grant.endUserPending, in.grant.endUserEstimate = l, estimate
		return nil
	}
	g, scope, wait := l.Take(now, estimate)
	if scope == limits.ScopeNone {
		in.grant.endUser, in.grant.endUserGrant = l, g
		return nil
	}
	return endUserRefused(in, scope, wait)
}

// endUserRefused answers a request its end user's limits refused.
func endUserRefused(in *inbound, scope limits.Scope, wait time.Duration) *relayError {
	if scope == limits.ScopeFleetDown {
		return errStorageUnavailable()
	}
	metricRateLimited.WithLabelValues(in.who.key.name, "user_"+string(scope)).Inc()
	return errUserLimited(in.who.key.describe(), scope, wait)
}

// endUser is the limiter of one end user (by the principal's state id and
// its bounded user_id), made with the entry's end user limits when it has
// none; nil when the entry has no such limits.
func (s *keyState) endUser(id string, now time.Time) *limits.Limiter {
	c := s.endUsers.Load()
	if c == nil {
		return nil
	}
	return c.Get(id, now, func() *limits.Limiter {
		l := new(limits.Limiter)
		if sp := s.endUserSpec.Load(); sp != nil {
			l.Configure(sp.limits, now)
			l.Share(sp.fleet.limitsOf(), endUserTag(id))
		}
		return l
	})
}

// configureEndUsers pushes an entry's end user limits into every end user
// limiter it keeps, and into those it will make; with none, it forgets
// them all.
func (s *keyState) configureEndUsers(sp stateSpec, now time.Time) {
	s.mu.Lock()
	if sp.limits == (limits.Spec{}) {
		s.endUsers.Store(nil)
		s.endUserSpec.Store(nil)
		s.mu.Unlock()
		return
	}
	c := s.endUsers.Load()
	if c == nil {
		c = idle.New[*limits.Limiter](maxEndUsers, idleAfter)
		s.endUsers.Store(c)
	}
	s.endUserSpec.Store(&sp)
	s.mu.Unlock()
	c.Each(func(id string, l *limits.Limiter) {
		l.Configure(sp.limits, now)
		l.Share(sp.fleet.limitsOf(), endUserTag(id))
	})
}

// endUserTag is where a fleet keeps an end user's limits: a digest, so the
// client's id never reaches Redis, and the key stays short.
func endUserTag(id string) string { return "e:" + fleet.Digest(id) }
