package relay

import (
	"context"
	"math"
	"net/http"
	"slices"
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

// maxHolds bounds the budgets one request holds against: its key's or
// user entry's (or identity's) today; room for a group's, a channel's cap
// and a session's.
const maxHolds = 4

// hold is what one request holds against one spend account.
type hold struct {
	a   *spendAccount
	usd nanoUSD
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

// holds are a request's holds: planned (n > 0) when its budgets apply,
// taken with its first admitted attempt, settled when it ends.
type holds struct {
	list  [maxHolds]hold
	n     uint8
	taken bool
	// channel is the account of the channel spend cap the last hold is
	// against (spend_scopes.go), and capOf that channel; nil: none
	channel *spendAccount
	capOf   *channel
}

// add plans a hold of usd against a.
func (hs *holds) add(a *spendAccount, usd nanoUSD) {
	if int(hs.n) < len(hs.list) {
		hs.list[hs.n] = hold{a: a, usd: usd}
		hs.n++
	}
}

// pending reports whether the request has holds to take.
func (hs *holds) pending() bool { return hs != nil && hs.n > 0 && !hs.taken }

// holdVerdict is what an account says of a hold.
type holdVerdict uint8

const (
	holdTaken   holdVerdict = iota
	holdWait                // holds in flight stand between the request and a budget
	holdRefused             // what was spent and the hold exceed a budget
)

// holdAnswer is the verdict on a request's holds and, when one did not
// fit, which, against which period's budget, and what that account had
// spent in it and held when judged.
type holdAnswer struct {
	verdict     holdVerdict
	i           int
	period      budgetPeriod
	spent, held nanoUSD
}

// fits judges a hold of n against every budget of the account, with held
// already held. It runs under a.mu.
func (a *spendAccount) fits(n, held nanoUSD) holdAnswer {
	ans := holdAnswer{}
	for p := range numPeriods {
		limit := a.caps[p]
		if limit <= 0 {
			continue
		}
		spent := a.periods[p].usd
		if spent >= limit || spent+n > limit {
			return holdAnswer{verdict: holdRefused, period: p, spent: spent, held: held}
		}
		if ans.verdict == holdTaken && spent+held+n > limit {
			ans = holdAnswer{verdict: holdWait, period: p, spent: spent, held: held}
		}
	}
	return ans
}

// affords judges, without taking anything, whether a hold of n could ever
// fit: holdRefused when what was spent and n exceed a budget.
func (a *spendAccount) affords(now time.Time, n nanoUSD) holdAnswer {
	if !a.budgeted.Load() {
		return holdAnswer{}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	if ans := a.fits(n, 0); ans.verdict == holdRefused {
		return ans
	}
	return holdAnswer{}
}

// reserve takes a hold of n on this relay when every budget has room for
// it beside the holds in flight here.
func (a *spendAccount) reserve(now time.Time, n nanoUSD) holdAnswer {
	return a.reserveAs(now, n, "")
}

// reserveAs is reserve for a request of group g, which must also fit its
// group's share of a channel cap's room ("": no share applies).
func (a *spendAccount) reserveAs(now time.Time, n nanoUSD, g string) holdAnswer {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	ans := a.fits(n, a.held+a.batchHeld)
	if ans.verdict == holdTaken && !a.shareFits(g, n) {
		ans = a.overShare()
	}
	if ans.verdict == holdTaken {
		a.held += n
		a.holding++
		a.groupHolds(g, n)
	}
	return ans
}

// holdsHere records a hold of n the fleet took, so that this relay knows
// what is in flight (for GET /relay/keys, and should Redis go away), for
// group g's share ("": none).
func (a *spendAccount) holdsHere(n nanoUSD, g string) {
	a.mu.Lock()
	a.held += n
	a.holding++
	a.groupHolds(g, n)
	a.mu.Unlock()
}

// unreserve gives back a hold of n that was not used: nothing was spent.
func (a *spendAccount) unreserve(n nanoUSD) { a.unreserveAs(n, "") }

// unreserveAs is unreserve of a hold taken for group g.
func (a *spendAccount) unreserveAs(n nanoUSD, g string) {
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
func (a *spendAccount) settle(now time.Time, h hold, usd float64, q *waitQueue, logger *zap.Logger) (released bool) {
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
		a.addLocked(toNano(usd), f != nil)
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

// heldRelease is a settled hold whose member waits in Redis for the sync
// that adds its cost, and the queue whose waiters its release wakes.
type heldRelease struct {
	lease string
	q     *waitQueue
}

// idle reports whether no hold of a request is in flight on the account.
func (a *spendAccount) idle() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.holding == 0 && len(a.releases) == 0
}

// heldUSD is what the account's holds hold now: in a fleet, what Redis
// said at the last sync (every relay's requests and the batches), at
// least what this relay holds; else this relay's requests in flight and
// its batches.
func (a *spendAccount) heldUSD() float64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return max(a.heldLocked(), 0).usd()
}

// heldLocked is what the account's holds hold now, as heldUSD says. It
// runs under a.mu.
func (a *spendAccount) heldLocked() nanoUSD {
	n := a.held + a.batchHeld
	if a.fleet.Load() != nil {
		n = max(n, a.fleetHeld)
	}
	return n
}

// worstCase is the most a message may cost, in USD: its input estimate
// (every prompt token at the dearest of the input, cache read and cache
// write prices, at the long-prompt tier when the estimate may reach it)
// plus max_tokens at the output price (the model's maximum output when the
// body gives none) plus the web searches its tools may make
// (internal/money), of the dearest model it may be served as (itself and
// its group's fallbacks for it), times the highest price_factor among its
// group's channels. A model without a price costs its estimate
// (internal/money). floored: its input is at least its hold floor
// (hold_floor.go).
func (r *Relay) worstCase(in *inbound, floored bool) float64 {
	g := in.group()
	model := in.servedAs()
	worst := r.worstOf(in, model, floored)
	for _, m := range g.fallbacks[model] {
		worst = max(worst, r.worstOf(in, m, floored))
	}
	return worst * g.maxPriceFactor
}

// worstOf is worstCase's figure for one model it may be served as, at list
// price: its prompt estimate, max_tokens and web searches, its input at
// least its hold floor when floored; a model without a price at its
// estimate.
func (r *Relay) worstOf(in *inbound, model string, floored bool) float64 {
	rates, _ := r.ratesFor(model, true)
	if rates == nil {
		return 0
	}
	maxOut := int64(in.ask.maxOut)
	worst := rates.Worst(in.ask.estimate, maxOut)
	if floored {
		window := contextWindow(model, in.ask.needs.HasBeta(context1m))
		worst = max(worst, rates.Worst(0, maxOut)+r.floorOf(rates, window))
	}
	return worst + float64(in.ask.searches)*rates.WebSearch()
}

// ceilNano rounds an amount up to billionths of a dollar: a hold never
// holds less than its worst case.
func ceilNano(usd float64) nanoUSD {
	if usd <= 0 {
		return 0
	}
	return nanoUSD(math.Ceil(usd * 1e9))
}

// planHolds plans the holds of a message against every budget that
// applies to it (its key's or user entry's, its group's, its session's), and refuses it
// at once when one of them could never fit: what was spent and its worst
// case exceed a budget. Its hold of a channel's spend cap is planned with
// each attempt (holdChannel). A request to which no budget and no cap
// applies plans nothing and pays nothing.
func (r *Relay) planHolds(in *inbound) *relayError {
	if in.route != routeMessages || in.who.state == nil {
		return nil
	}
	g := in.group()
	accts, n := budgeted(in.who.state.spend, g.spend, in.grant.session.budgetAccount())
	if n == 0 && !g.capped {
		return nil
	}
	in.grant.counted = true
	worst := ceilNano(r.worstCase(in, false))
	if in.readsOutside() { // at its floor, within what its tightest budget has left
		floored := ceilNano(r.worstCase(in, true))
		if room := floorRoom(accts[:n], g, r.now()); room > 0 {
			floored = min(floored, room)
		}
		worst = max(worst, floored)
	}
	for _, a := range accts[:n] {
		if ans := a.affords(r.now(), worst); ans.verdict == holdRefused {
			return r.budgetRefusal(in, a, worst, ans)
		}
	}
	if worst == 0 { // a price table whose every row is free
		return nil
	}
	in.grant.worst = worst
	if n > 0 {
		in.grant.holds = &holds{} // only a request that holds pays for the list
		for _, a := range accts[:n] {
			in.grant.holds.add(a, worst)
		}
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
	first := hs.list[0].a
	// a newcomer does not overtake the requests of its class or better
	// that wait on its budget (unless they are gone by the time it is in
	// line)
	if q.w == nil && q.g.maxQueue > 0 && q.g.state.queue.aheadOn(in.who.key.prio, first) {
		inLine := func() bool { return q.g.state.queue.isBest(q.w) }
		return nil, scopeBudget, r.waitForHolds(ctx, in, q, holdAnswer{verdict: holdWait}, inLine)
	}
	// what settled since it looked: a hold that settles before it is in
	// line wakes nobody for it
	var freed [maxHolds]uint64
	for i := range hs.n {
		freed[i] = hs.list[i].a.freed.Load()
	}
	t, scope, ans, rerr := r.admitFirst(in, ch, now, hs)
	switch {
	case ans.verdict == holdWait && hs.channel != nil && hs.list[ans.i].a == hs.channel:
		return nil, scopeCapBusy, nil // the channel's cap is held by others: the next channel may take it, else it waits
	case ans.verdict != holdTaken && hs.channel != nil && hs.list[ans.i].a == hs.channel:
		return nil, scopeCapped, nil // the channel's cap cannot take it: the next channel may
	case ans.verdict == holdRefused:
		h := hs.list[ans.i]
		return nil, limits.ScopeNone, r.budgetRefusal(in, h.a, h.usd, ans)
	case ans.verdict == holdWait:
		settled := func() bool { return hs.list[ans.i].a.freed.Load() != freed[ans.i] }
		return nil, scopeBudget, r.waitForHolds(ctx, in, q, ans, settled)
	case rerr != nil:
		return nil, scope, rerr
	case t != nil:
		hs.taken = true
	}
	return t, scope, nil
}

// scopeBudget is a request that waited for holds in flight to settle.
const scopeBudget limits.Scope = "budget"

// fleetHoldPoll is how often a request that waits for holds in flight asks
// the fleet again: holds another relay settles wake nobody here.
const fleetHoldPoll = 100 * time.Millisecond

// waitForHolds waits in the queue, as a request on the budget of the hold
// that did not fit, until a hold of that account settles (or ready says
// it did already); nil when it is to try again, else its answer.
func (r *Relay) waitForHolds(ctx context.Context, in *inbound, q *queued, ans holdAnswer, ready func() bool) *relayError {
	h := in.grant.holds.list[ans.i]
	freeAt := time.Time{}
	if h.a.fleet.Load() != nil {
		freeAt = r.now().Add(fleetHoldPoll)
	}
	return q.waitOn(ctx, h.a, freeAt, ready, func(why queueRefusal) *relayError {
		metricRateLimited.WithLabelValues(in.who.key.name, string(scopeBudget)).Inc()
		tail := "; its group does not queue"
		switch why {
		case queueWaited:
			tail = "; it waited " + q.g.maxWait[in.who.key.prio].String() + " (max_wait of class " + in.who.key.prio.String() + ") for them to settle"
		case queueFull:
			tail = "; the queue is full"
		}
		now := h.a.tightest(r.now(), h.usd) // as things stand when it gives up
		if h.a.session() {
			return r.sessionBudgetRefusal(in, h.a, h.usd, now, tail)
		}
		return errBudgetHeld(h.a.who(), now, h.a.capOf(now.period), h.usd, tail)
	})
}

// tightest is the budget with the least room for a hold of n beside what
// is spent and held now, with what that is.
func (a *spendAccount) tightest(now time.Time, n nanoUSD) holdAnswer {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	held := a.heldLocked()
	ans, room := holdAnswer{verdict: holdWait, held: held}, nanoUSD(math.MaxInt64)
	for p := range numPeriods {
		if limit := a.caps[p]; limit > 0 {
			spent := a.periods[p].usd
			if r := limit - spent - held - n; r < room {
				ans.period, ans.spent, room = p, spent, r
			}
		}
	}
	return ans
}

// budgetRefusal answers a request whose hold of worst could never fit in
// the budget ans names.
func (r *Relay) budgetRefusal(in *inbound, a *spendAccount, worst nanoUSD, ans holdAnswer) *relayError {
	if a.session() {
		return r.sessionBudgetRefusal(in, a, worst, ans, "")
	}
	metricRateLimited.WithLabelValues(in.who.key.name, string(scopeBudget)).Inc()
	now := r.now()
	end := ans.period.end(ans.period.start(now))
	limit := a.capOf(ans.period)
	if ans.spent >= limit {
		return errBudgetExceeded(a.who(), ans.period, limit.usd(), ans.spent.usd(), end.Sub(now), 0)
	}
	return errBudgetExceeded(a.who(), ans.period, limit.usd(), ans.spent.usd(), end.Sub(now), worst.usd())
}

// capOf is the account's budget for period p.
func (a *spendAccount) capOf(p budgetPeriod) nanoUSD {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.caps[p]
}

// holdRetryAfter is what a request that could not wait for holds in
// flight to settle is told to wait: they settle as requests end.
const holdRetryAfter = 5 * time.Second

// errBudgetHeld answers a request whose hold of worst would fit in what is
// left of a budget once the holds in flight settle, but that could not
// wait for them (tail says why).
func errBudgetHeld(who string, ans holdAnswer, limit, worst nanoUSD, tail string) *relayError {
	left := max(0, limit-ans.spent)
	msg := who + "'s requests in flight hold " + dollars(ans.held.usd()) + " of the " + dollars(left.usd()) +
		" left of its " + ans.period.adjective() + " " + dollars(limit.usd()) + " budget, and this request may cost up to " + dollars(worst.usd()) + tail
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "budget_exceeded",
		msg: msg, retryAfter: holdRetryAfter, noRetry: true}
}

// settleHolds turns what the request holds into what it cost: each
// account's hold is given back and the cost charged, under one lock. The
// accounts its cost goes to that it held nothing against (its principal's,
// its group's, the spend cap's of the channel that answered) are charged;
// for a batch's results whose maker's hold they settle, the maker pays in
// place of the request's principal.
func (r *Relay) settleHolds(in *inbound, cost float64) {
	now := r.now()
	var settled [maxHolds]*spendAccount
	if hs := in.grant.holds; hs != nil && hs.taken {
		var q *waitQueue
		if in.who.key != nil {
			q = &in.group().state.queue
		}
		for i := range hs.n {
			h := hs.list[i]
			settled[i] = h.a
			if h.a.settle(now, h, cost, q, r.logger) && q != nil && h.batch == "" {
				q.wakeFor(h.a)
			}
		}
		hs.taken = false
		if hs.capOf != nil { // requests of every group may wait for room on its cap
			hs.capOf.health.wakeQueues()
		}
	}
	if cost <= 0 {
		return
	}
	charge := func(a *spendAccount) {
		if a != nil && !slices.Contains(settled[:], a) {
			a.charge(now, cost, r.logger)
		}
	}
	if in.who.state != nil && (in.end.batch == nil || in.end.batch.payer == nil) {
		charge(in.who.state.spend) // unless a batch's maker pays for its results
	}
	if in.who.key != nil {
		charge(in.group().spend)
	}
	if ch := in.end.charged(); ch != nil {
		charge(ch.spend)
	}
	charge(in.grant.session.budgetAccount())
}

// fleet is the fleet that keeps every hold of the request; nil when a hold
// is kept on this relay.
func (hs *holds) fleet() *member {
	var f *member
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
var _ limits.Holds[holdAnswer] = (*holds)(nil)

// Pending reports whether the request has holds to take.
func (hs *holds) Pending() bool { return hs.pending() }

// Fleet is the limits of the fleet that keeps every hold; nil when a hold
// is kept on this relay.
func (hs *holds) Fleet() *limits.Shared { return hs.fleet().limitsOf() }

// Reserve takes every hold on this relay, or none.
func (hs *holds) Reserve(now time.Time) (holdAnswer, bool) {
	ans := hs.reserve(now)
	return ans, ans.verdict == holdTaken
}

// Unreserve gives back every hold, unused.
func (hs *holds) Unreserve() { hs.unreserve() }

// Shares judges the request's group's shares of the caps it holds
// against, as this relay sees them.
func (hs *holds) Shares(now time.Time) (holdAnswer, bool) {
	ans := hs.shares(now)
	return ans, ans.verdict == holdTaken
}

// Parts prepares the holds' parts of the fleet's admission.
func (hs *holds) Parts(now time.Time) []*limits.Hold { return hs.fleet().prepareHolds(now, hs) }

// Refused is the answer on a hold the fleet did not take.
func (hs *holds) Refused(i int, part *limits.Hold) holdAnswer { return heldAnswer(i, part) }

// Taken records the holds the fleet took: each is its lease (renewed by
// the fleet until its cost is added), and this relay counts it in flight.
func (hs *holds) Taken(parts []*limits.Hold) {
	for i := range hs.n {
		h := &hs.list[i]
		h.lease = parts[i].Member
		h.a.holdsHere(h.usd, h.group)
	}
}

// reserve takes every hold on this relay, or none.
func (hs *holds) reserve(now time.Time) holdAnswer {
	for i := range hs.n {
		h := &hs.list[i]
		if ans := h.a.reserveAs(now, h.usd, h.group); ans.verdict != holdTaken {
			for j := range uint8(i) {
				hs.list[j].a.unreserveAs(hs.list[j].usd, hs.list[j].group)
			}
			ans.i = int(i)
			return ans
		}
		h.lease = ""
	}
	return holdAnswer{}
}

// unreserve gives back every hold, unused: on this relay, and in the
// fleet for those it took there.
func (hs *holds) unreserve() {
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
