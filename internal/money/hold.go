package money

import (
	"math"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"go.uber.org/zap"
)

// Holds. A budget is a ceiling, not a check: a message, when it is
// admitted to its first attempt, holds its worst case against every budget
// that applies to it (see worstCase), and when it ends the hold becomes
// what it really cost: the hold is given back and the cost charged under
// one lock. What a budget has room for is its budget less what was spent
// (settled) and less what requests in flight hold. A request whose hold
// does not fit:
//
//   - when what was spent and its own hold already exceed a budget, is
//     refused at once, 429 budget_exceeded with a retry-after to the
//     period's end: nothing that settles can make room;
//   - else, holds in flight stand between it and the budget, and they may
//     settle lower: it waits in its group's queue, best class first, until
//     a hold of that account settles (and, in a fleet, polls Redis), for
//     at most its class's max_wait; then 429 budget_exceeded.
//
// So spend passes a budget only by what requests cost beyond their holds,
// which only an input estimate below the real prompt allows.
//
// In a fleet the holds live in Redis (fleet_holds.go), in the same script
// as the request's other admissions after its body.

// MaxHolds bounds the budgets one request holds against: its key's or
// user entry's (or identity's) today; room for a group's, a channel's cap
// and a session's.
const MaxHolds = 4

// hold is what one request holds against one spend account.
type hold struct {
	a   *Account
	usd NanoUSD
	// lease, in a fleet, is the hold's member in the account's holds in
	// Redis; "" when held on this relay only
	lease string
	// batch names a batch's hold (hold_batches.go), which its results
	// settle; "" for a request's
	batch string
	// group, for the hold of a channel's spend cap, is the group of the
	// request, whose share of the cap's room it takes (hold_share.go)
	group string
}

// Holds are a request's holds: planned (n > 0) when its budgets apply,
// taken with its first admitted attempt, settled when it ends.
type Holds struct {
	list  [MaxHolds]hold
	n     uint8
	Taken bool // taken with an admitted attempt, until settled
	// channel is the account of the channel spend cap the last hold is
	// against (spend_scopes.go); nil: none
	channel *Account
}

// Add plans a hold of usd against a.
func (hs *Holds) Add(a *Account, usd NanoUSD) {
	if int(hs.n) < len(hs.list) {
		hs.list[hs.n] = hold{a: a, usd: usd}
		hs.n++
	}
}

// pending reports whether the request has holds to take.
func (hs *Holds) pending() bool { return hs != nil && hs.n > 0 && !hs.Taken }

// HoldVerdict is what an account says of a hold.
type HoldVerdict uint8

const (
	HoldTaken   HoldVerdict = iota // every hold fits: taken
	HoldWait                       // holds in flight stand between the request and a budget
	HoldRefused                    // what was spent and the hold exceed a budget
)

// HoldAnswer is the verdict on a request's holds and, when one did not
// fit, which, against which period's budget, and what that account had
// spent in it and held when judged.
type HoldAnswer struct {
	Verdict     HoldVerdict // taken, or why not
	Index       int         // the hold that did not fit
	Period      Period      // the period of the budget it did not fit
	Spent, Held NanoUSD     // what its account had spent in it, and held
}

// fits judges a hold of n against every budget of the account, with held
// already held. It runs under a.mu.
func (a *Account) fits(n, held NanoUSD) HoldAnswer {
	ans := HoldAnswer{}
	for p := range NumPeriods {
		limit := a.caps[p]
		if limit <= 0 {
			continue
		}
		spent := a.periods[p].usd
		if spent >= limit || spent+n > limit {
			return HoldAnswer{Verdict: HoldRefused, Period: p, Spent: spent, Held: held}
		}
		if ans.Verdict == HoldTaken && spent+held+n > limit {
			ans = HoldAnswer{Verdict: HoldWait, Period: p, Spent: spent, Held: held}
		}
	}
	return ans
}

// Affords judges, without taking anything, whether a hold of n could ever
// fit: holdRefused when what was spent and n exceed a budget.
func (a *Account) Affords(now time.Time, n NanoUSD) HoldAnswer {
	if !a.budgeted.Load() {
		return HoldAnswer{}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	if ans := a.fits(n, 0); ans.Verdict == HoldRefused {
		return ans
	}
	return HoldAnswer{}
}

// reserve takes a hold of n on this relay when every budget has room for
// it beside the holds in flight here.
func (a *Account) reserve(now time.Time, n NanoUSD) HoldAnswer {
	return a.reserveAs(now, n, "")
}

// reserveAs is reserve for a request of group g, which must also fit its
// group's share of a channel cap's room ("": no share applies).
func (a *Account) reserveAs(now time.Time, n NanoUSD, g string) HoldAnswer {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	ans := a.fits(n, a.held+a.batchHeld)
	if ans.Verdict == HoldTaken && !a.shareFits(g, n) {
		ans = a.overShare()
	}
	if ans.Verdict == HoldTaken {
		a.held += n
		a.holding++
		a.groupHolds(g, n)
	}
	return ans
}

// holdsHere records a hold of n the fleet took, so that this relay knows
// what is in flight (for GET /relay/keys, and should Redis go away), for
// group g's share ("": none).
func (a *Account) holdsHere(n NanoUSD, g string) {
	a.mu.Lock()
	a.held += n
	a.holding++
	a.groupHolds(g, n)
	a.mu.Unlock()
}

// unreserve gives back a hold of n that was not used: nothing was spent.
func (a *Account) unreserve(n NanoUSD) { a.unreserveAs(n, "") }

// unreserveAs is unreserve of a hold taken for group g.
func (a *Account) unreserveAs(n NanoUSD, g string) {
	a.mu.Lock()
	a.held -= n
	a.holding--
	a.groupHolds(g, -n)
	a.mu.Unlock()
	a.freed.Add(1)
}

// settle ends a hold: it is given back and usd, what the request cost,
// charged, under one lock, so that no reader sees the hold gone and the
// cost not yet there. In a fleet the hold's member in Redis is given back
// by the sync that adds this cost to the fleet's totals, in the same
// script: the fleet never counts the cost and the hold as neither. It
// returns whether the hold is given back already (on this relay alone).
func (a *Account) settle(now time.Time, h hold, usd float64, q Queue, logger *zap.Logger) (released bool) {
	a.logger.Store(logger)
	f := a.fleet.Load()
	a.mu.Lock()
	a.roll(now)
	if h.batch == "" {
		a.held -= h.usd
		a.holding--
		a.groupHolds(h.group, -h.usd)
	} else if bh, ok := a.batches[h.batch]; ok {
		delete(a.batches, h.batch)
		a.batchHeld -= bh.usd
	}
	if usd > 0 {
		a.addLocked(ToNano(usd), f != nil)
	}
	if h.lease != "" && f != nil {
		a.releases = append(a.releases, heldRelease{lease: h.lease, q: q})
	}
	crossed := a.crossed()
	a.mu.Unlock()
	a.freed.Add(1)
	if usd > 0 {
		spend.dirty.Store(true)
	}
	a.warnOf(crossed)
	if h.batch != "" && f == nil {
		spend.saveSoon() // a batch's hold is gone for good: written at once
	}
	if h.lease != "" && f != nil {
		f.spendSoon()
		return false
	}
	return true
}

// Len is the number of holds.
func (hs *Holds) Len() int { return int(hs.n) }

// Account is the account of hold i.
func (hs *Holds) Account(i int) *Account { return hs.list[i].a }

// Amount is what hold i holds.
func (hs *Holds) Amount(i int) NanoUSD { return hs.list[i].usd }

// Channel is the account of the channel spend cap the request holds
// against (the last of its holds); nil: none.
func (hs *Holds) Channel() *Account { return hs.channel }

// HoldCap plans the request's hold of usd against the spend cap of a
// channel (its account a; nil: none), for its group, in place of its hold
// against the cap of the channel it tried before: the holds it took are
// given back, to be taken again with the next attempt's admission.
func (hs *Holds) HoldCap(a *Account, usd NanoUSD, group string) {
	if hs.Taken {
		hs.unreserve()
		hs.Taken = false
	}
	if hs.channel != nil {
		hs.n--
		hs.list[hs.n] = hold{}
		hs.channel = nil
	}
	if a != nil {
		hs.Add(a, usd)
		hs.list[hs.n-1].group = group
		hs.channel = a
	}
}

// Settle turns what the request holds, taken, into what it cost (usd):
// each account's hold is given back and the cost charged, under one
// lock; q (nil: none) is woken for each account whose request's hold is
// given back on this relay alone. It returns the accounts it charged.
func (hs *Holds) Settle(now time.Time, usd float64, q Queue, logger *zap.Logger) (settled [MaxHolds]*Account) {
	for i := range hs.n {
		h := hs.list[i]
		settled[i] = h.a
		if h.a.settle(now, h, usd, q, logger) && q != nil && h.batch == "" {
			q.WakeFor(h.a)
		}
	}
	hs.Taken = false
	return settled
}

// Payer is the principal that made the batch whose holds hs are: the key's
// or identity's account among them; nil when none held.
func (hs *Holds) Payer() *Account {
	for i := range hs.n {
		if a := hs.list[i].a; a.scopeIs(OfKey) {
			return a
		}
	}
	return nil
}

// Queue wakes the requests that wait on an account's budget for holds in
// flight to settle: a group's queue.
type Queue interface {
	// WakeFor wakes the best request waiting on a's budget.
	WakeFor(a *Account)
}

// heldRelease is a settled hold whose member waits in Redis for the sync
// that adds its cost, and the queue whose waiters its release wakes.
type heldRelease struct {
	lease string
	q     Queue
}

// Idle reports whether no hold of a request is in flight on the account.
func (a *Account) Idle() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.holding == 0 && len(a.releases) == 0
}

// HeldUSD is what the account's holds hold now: in a fleet, what Redis
// said at the last sync (every relay's requests and the batches), at
// least what this relay holds; else this relay's requests in flight and
// its batches.
func (a *Account) HeldUSD() float64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return max(a.heldLocked(), 0).USD()
}

// heldLocked is what the account's holds hold now, as heldUSD says. It
// runs under a.mu.
func (a *Account) heldLocked() NanoUSD {
	n := a.held + a.batchHeld
	if a.fleet.Load() != nil {
		n = max(n, a.fleetHeld)
	}
	return n
}

// CeilNano rounds an amount up to billionths of a dollar: a hold never
// holds less than its worst case.
func CeilNano(usd float64) NanoUSD {
	if usd <= 0 {
		return 0
	}
	return NanoUSD(math.Ceil(usd * 1e9))
}

// Tightest is the budget with the least room for a hold of n beside what
// is spent and held now, with what that is.
func (a *Account) Tightest(now time.Time, n NanoUSD) HoldAnswer {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	held := a.heldLocked()
	ans, room := HoldAnswer{Verdict: HoldWait, Held: held}, NanoUSD(math.MaxInt64)
	for p := range NumPeriods {
		if limit := a.caps[p]; limit > 0 {
			spent := a.periods[p].usd
			if r := limit - spent - held - n; r < room {
				ans.Period, ans.Spent, room = p, spent, r
			}
		}
	}
	return ans
}

// CapOf is the account's budget for period p.
func (a *Account) CapOf(p Period) NanoUSD {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.caps[p]
}

// fleet is the fleet that keeps every hold of the request; nil when a hold
// is kept on this relay.
func (hs *Holds) fleet() *Shared {
	var f *Shared
	for i := range hs.n {
		af := hs.list[i].a.fleet.Load()
		if af == nil || f != nil && af != f {
			return nil
		}
		f = af
	}
	return f
}

// A request's holds are taken with its limits (limits.Holds).
var _ limits.Holds[HoldAnswer] = (*Holds)(nil)

// Pending reports whether the request has holds to take.
func (hs *Holds) Pending() bool { return hs.pending() }

// Fleet is the limits of the fleet that keeps every hold; nil when a hold
// is kept on this relay.
func (hs *Holds) Fleet() *limits.Shared { return hs.fleet().limitsOf() }

// Reserve takes every hold on this relay, or none.
func (hs *Holds) Reserve(now time.Time) (HoldAnswer, bool) {
	ans := hs.reserve(now)
	return ans, ans.Verdict == HoldTaken
}

// Unreserve gives back every hold, unused.
func (hs *Holds) Unreserve() { hs.unreserve() }

// Shares judges the request's group's shares of the caps it holds
// against, as this relay sees them.
func (hs *Holds) Shares(now time.Time) (HoldAnswer, bool) {
	ans := hs.shares(now)
	return ans, ans.Verdict == HoldTaken
}

// Parts prepares the holds' parts of the fleet's admission.
func (hs *Holds) Parts(now time.Time) []*limits.Hold { return hs.fleet().prepareHolds(now, hs) }

// Refused is the answer on a hold the fleet did not take.
func (hs *Holds) Refused(i int, part *limits.Hold) HoldAnswer { return heldAnswer(i, part) }

// Admitted records the holds the fleet took: each is its lease (renewed by
// the fleet until its cost is added), and this relay counts it in flight.
func (hs *Holds) Admitted(parts []*limits.Hold) {
	for i := range hs.n {
		h := &hs.list[i]
		h.lease = parts[i].Member
		h.a.holdsHere(h.usd, h.group)
	}
}

// reserve takes every hold on this relay, or none.
func (hs *Holds) reserve(now time.Time) HoldAnswer {
	for i := range hs.n {
		h := &hs.list[i]
		if ans := h.a.reserveAs(now, h.usd, h.group); ans.Verdict != HoldTaken {
			for j := range uint8(i) {
				hs.list[j].a.unreserveAs(hs.list[j].usd, hs.list[j].group)
			}
			ans.Index = int(i)
			return ans
		}
		h.lease = ""
	}
	return HoldAnswer{}
}

// unreserve gives back every hold, unused: on this relay, and in the
// fleet for those it took there.
func (hs *Holds) unreserve() {
	for i := range hs.n {
		h := &hs.list[i]
		h.a.unreserveAs(h.usd, h.group)
		if h.lease != "" {
			if f := h.a.fleet.Load(); f != nil {
				f.releaseHold(h.a, h.lease)
			}
			h.lease = ""
		}
	}
}

// HoldsNow is how many of this relay's requests hold against the account,
// and what its holds hold (heldUSD).
func (a *Account) HoldsNow() (int, float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.holding, max(a.heldLocked(), 0).USD()
}
