package money

import (
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
// (the relay waits on the cap rather than answering 503). A group alone
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
func (a *Account) shareFits(g string, n NanoUSD) bool {
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
	return a.groups[g]+n <= a.roomLocked()/NanoUSD(active)
}

// roomLocked is what is left of the account's tightest budget, spent
// counted and holds not. It runs under a.mu.
func (a *Account) roomLocked() NanoUSD {
	room, known := NanoUSD(0), false
	for p := range NumPeriods {
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
func (a *Account) overShare() HoldAnswer {
	ans := HoldAnswer{Verdict: HoldWait, Held: a.heldLocked()}
	room, known := NanoUSD(0), false
	for p := range NumPeriods {
		if limit := a.caps[p]; limit > 0 {
			if left := limit - a.periods[p].usd; !known || left < room {
				ans.Period, ans.Spent, room, known = p, a.periods[p].usd, left, true
			}
		}
	}
	return ans
}

// groupHolds adds n (negative: gives back) to what group g holds here. It
// runs under a.mu.
func (a *Account) groupHolds(g string, n NanoUSD) {
	if g == "" {
		return
	}
	if a.groups == nil {
		a.groups = map[string]NanoUSD{}
	}
	if v := a.groups[g] + n; v > 0 {
		a.groups[g] = v
	} else {
		delete(a.groups, g)
	}
}

// Want counts group g among those waiting for room on the account's cap
// (a channel's), until Unwant: its share of the room counts then too.
func (a *Account) Want(g string) {
	a.mu.Lock()
	if a.waiting == nil {
		a.waiting = map[string]int{}
	}
	a.waiting[g]++
	a.mu.Unlock()
}

// Unwant ends what Want counted.
func (a *Account) Unwant(g string) {
	a.mu.Lock()
	if a.waiting[g]--; a.waiting[g] <= 0 {
		delete(a.waiting, g)
	}
	a.mu.Unlock()
}

// shares checks, before a fleet takes the holds, that each of them fits
// its group's share as this relay sees it.
func (hs *Holds) shares(now time.Time) HoldAnswer {
	for i := range hs.n {
		h := &hs.list[i]
		if h.group == "" {
			continue
		}
		a := h.a
		a.mu.Lock()
		a.roll(now)
		ok := a.shareFits(h.group, h.usd)
		ans := HoldAnswer{}
		if !ok {
			ans = a.overShare()
			ans.Index = int(i)
		}
		a.mu.Unlock()
		if !ok {
			return ans
		}
	}
	return HoldAnswer{}
}
