package relay

import (
	"context"
	"time"
)

// Fair shares of a capped channel. A channel's spend cap is shared by the
// groups that use the channel, and a request holds its worst case against
// the cap while it runs: two max_tokens 32000 requests of one group held
// $0.96 of a $1 cap for as long as they ran, and the small requests of
// another group found no room. So while more than one group holds a cap,
// each group's holds may take at most its share of the cap's room (what is
// left of it, evenly among the groups holding it and the one asking); a
// request past its group's share waits, as for a busy channel, for holds
// to settle, and so does one that does not fit beside the holds in flight
// (failover.go waits on the cap rather than answering 503). A group alone
// on a cap may take all of it. A hold that could never fit the cap is
// refused as before.
//
// The shares are kept by each relay for the holds it took. In a fleet the
// cap itself holds across the nodes (Redis), and each node shares its own
// holds out fairly; two groups on different nodes are not weighed against
// each other.

// shareFits reports whether a hold of n for group g fits g's share of the
// account's room beside the other groups that hold some of it here or wait
// for room on it. It runs under a.mu.
func (a *spendAccount) shareFits(g string, n nanoUSD) bool {
	if g == "" {
		return true
	}
	active := 1 // the group that asks
	for other, held := range a.groups {
		if other != g && held > 0 {
			active++
		}
	}
	for other, waiters := range a.waiting {
		if other != g && waiters > 0 && a.groups[other] <= 0 {
			active++
		}
	}
	if active == 1 {
		return true
	}
	return a.groups[g]+n <= a.roomLocked()/nanoUSD(active)
}

// roomLocked is what is left of the account's tightest budget, spent
// counted and holds not. It runs under a.mu.
func (a *spendAccount) roomLocked() nanoUSD {
	room, known := nanoUSD(0), false
	for p := range numPeriods {
		if limit := a.caps[p]; limit > 0 {
			if left := max(0, limit-a.periods[p].usd); !known || left < room {
				room, known = left, true
			}
		}
	}
	return room
}

// overShare is the answer to a hold past its group's share: wait, as for
// holds in flight, naming the tightest budget. It runs under a.mu.
func (a *spendAccount) overShare() holdAnswer {
	ans := holdAnswer{verdict: holdWait, held: a.heldLocked()}
	room, known := nanoUSD(0), false
	for p := range numPeriods {
		if limit := a.caps[p]; limit > 0 {
			if left := limit - a.periods[p].usd; !known || left < room {
				ans.period, ans.spent, room, known = p, a.periods[p].usd, left, true
			}
		}
	}
	return ans
}

// groupHolds adds n (negative: gives back) to what group g holds here. It
// runs under a.mu.
func (a *spendAccount) groupHolds(g string, n nanoUSD) {
	if g == "" {
		return
	}
	if a.groups == nil {
		a.groups = map[string]nanoUSD{}
	}
	if v := a.groups[g] + n; v > 0 {
		a.groups[g] = v
	} else {
		delete(a.groups, g)
	}
}

// shares checks, before a fleet takes the holds, that each of them fits
// its group's share as this relay sees it.
func (hs *holds) shares(now time.Time) holdAnswer {
	for i := range hs.n {
		h := &hs.list[i]
		if h.group == "" {
			continue
		}
		a := h.a
		a.mu.Lock()
		a.roll(now)
		ok := a.shareFits(h.group, h.usd)
		ans := holdAnswer{}
		if !ok {
			ans = a.overShare()
			ans.i = int(i)
		}
		a.mu.Unlock()
		if !ok {
			return ans
		}
	}
	return holdAnswer{}
}

// want counts the request's group g among those waiting for room on the
// cap of acct, once, until unwant.
func (s *selection) want(acct *spendAccount, g string) {
	if s.wants != nil {
		return
	}
	s.wants = acct
	acct.mu.Lock()
	if acct.waiting == nil {
		acct.waiting = map[string]int{}
	}
	acct.waiting[g]++
	acct.mu.Unlock()
}

// unwant ends what want counted.
func (s *selection) unwant(g string) {
	acct := s.wants
	if acct == nil {
		return
	}
	s.wants = nil
	acct.mu.Lock()
	if acct.waiting[g]--; acct.waiting[g] <= 0 {
		delete(acct.waiting, g)
	}
	acct.mu.Unlock()
}

// waitForCap waits in the queue, as for a busy channel, for holds in
// flight on the cap of ch (and every cap the request passed over) to
// settle: a settle on this relay wakes it, and it looks again every
// fleetHoldPoll for those other relays settle. When it cannot wait on,
// the answer names the cap, as when no channel could take it.
func (q *queued) waitForCap(ctx context.Context, ch *channel, s *selection) *relayError {
	return q.waitOn(ctx, nil, s.now.Add(fleetHoldPoll), nil, func(queueRefusal) *relayError {
		metricRateLimited.WithLabelValues(q.in.who.key.name, string(scopeCapped)).Inc()
		return errChannelsCapped(s.model, ch, q.r.now(), holdRetryAfter)
	})
}
