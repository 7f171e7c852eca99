package relay

import (
	"context"
	"net/http"
	"slices"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
)

// A request's holds, as the relay reads them from the request. A message
// to which a budget applies holds its worst case against each budget from
// its first admitted attempt (admit.go) to its end, and its hold of a
// channel's spend cap moves with its attempts; the holds themselves, what
// they wait for and what they cost when they settle, are internal/money's.
// What reads the request stays here: its worst case, its plan of holds,
// their settle at its cost, and the answers it gets.

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
	accts, n := money.Budgeted(in.who.state.spend, g.spend, in.grant.session.budgetAccount())
	if n == 0 && !g.capped {
		return nil
	}
	in.grant.counted = true
	worst := money.CeilNano(r.worstCase(in, false))
	if in.readsOutside() { // at its floor, within what its tightest budget has left
		floored := money.CeilNano(r.worstCase(in, true))
		if room := floorRoom(accts[:n], g, r.now()); room > 0 {
			floored = min(floored, room)
		}
		worst = max(worst, floored)
	}
	for _, a := range accts[:n] {
		if ans := a.Affords(r.now(), worst); ans.Verdict == money.HoldRefused {
			return r.budgetRefusal(in, a, worst, ans)
		}
	}
	if worst == 0 { // a price table whose every row is free
		return nil
	}
	in.grant.worst = worst
	if n > 0 {
		in.grant.holds = &money.Holds{} // only a request that holds pays for the list
		for _, a := range accts[:n] {
			in.grant.holds.Add(a, worst)
		}
	}
	return nil
}

// scopeBudget is a request that waited for holds in flight to settle.
const scopeBudget limits.Scope = "budget"

// fleetHoldPoll is how often a request that waits for holds in flight asks
// the fleet again: holds another relay settles wake nobody here.
const fleetHoldPoll = 100 * time.Millisecond

// budgetRefusal answers a request whose hold of worst could never fit in
// the budget ans names.
func (r *Relay) budgetRefusal(in *inbound, a *money.Account, worst money.NanoUSD, ans money.HoldAnswer) *relayError {
	if a.Session() {
		return r.sessionBudgetRefusal(in, a, worst, ans, "")
	}
	metricRateLimited.WithLabelValues(in.who.key.name, string(scopeBudget)).Inc()
	now := r.now()
	end := ans.Period.End(ans.Period.Start(now))
	limit := a.CapOf(ans.Period)
	if ans.Spent >= limit {
		return errBudgetExceeded(a.Who(), ans.Period, limit.USD(), ans.Spent.USD(), end.Sub(now), 0)
	}
	return errBudgetExceeded(a.Who(), ans.Period, limit.USD(), ans.Spent.USD(), end.Sub(now), worst.USD())
}

// holdRetryAfter is what a request that could not wait for holds in
// flight to settle is told to wait: they settle as requests end.
const holdRetryAfter = 5 * time.Second

// errBudgetHeld answers a request whose hold of worst would fit in what is
// left of a budget once the holds in flight settle, but that could not
// wait for them (tail says why).
func errBudgetHeld(who string, ans money.HoldAnswer, limit, worst money.NanoUSD, tail string) *relayError {
	left := max(0, limit-ans.Spent)
	msg := who + "'s requests in flight hold " + dollars(ans.Held.USD()) + " of the " + dollars(left.USD()) +
		" left of its " + ans.Period.Adjective() + " " + dollars(limit.USD()) + " budget, and this request may cost up to " + dollars(worst.USD()) + tail
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
	var settled [money.MaxHolds]*money.Account
	if hs := in.grant.holds; hs != nil && hs.Taken {
		var q money.Queue
		if in.who.key != nil {
			q = &in.group().state.queue
		}
		settled = hs.Settle(now, cost, q, r.logger)
		if in.grant.capOf != nil { // requests of every group may wait for room on its cap
			in.grant.capOf.health.wakeQueues()
		}
	}
	if cost <= 0 {
		return
	}
	charge := func(a *money.Account) {
		if a != nil && !slices.Contains(settled[:], a) {
			a.Charge(now, cost, r.logger)
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

// holdChannel plans the request's hold against the spend cap of ch, the
// channel of its next attempt, in place of its hold against the channel it
// tried before: the holds it took are given back, to be taken again with
// the attempt's admission. A request whose every model has no price holds
// nothing.
func (r *Relay) holdChannel(in *inbound, ch *channel) {
	hs := in.grant.holds
	var prev *money.Account
	if hs != nil {
		prev = hs.Channel()
	}
	if prev == ch.spend || in.grant.worst == 0 {
		return
	}
	if hs == nil {
		hs = &money.Holds{}
		in.grant.holds = hs
	}
	hs.HoldCap(ch.spend, in.grant.worst, in.group().name)
	in.grant.capOf = nil
	if ch.spend != nil {
		in.grant.capOf = ch
	}
}

// scopeCapped is an attempt whose channel's spend cap could not take the
// request's hold: the request passes the channel over.
const scopeCapped limits.Scope = "spend_cap"

// scopeCapBusy is an attempt whose channel's spend cap could take the
// request's hold once holds in flight on it settle: the request passes
// the channel over, and waits for it when no other channel can serve.
const scopeCapBusy limits.Scope = "spend_cap_busy"

// want counts the request's group g among those waiting for room on the
// cap of acct, once, until unwant.
func (s *selection) want(acct *money.Account, g string) {
	if s.wants != nil {
		return
	}
	s.wants = acct
	acct.Want(g)
}

// unwant ends what want counted.
func (s *selection) unwant(g string) {
	acct := s.wants
	if acct == nil {
		return
	}
	s.wants = nil
	acct.Unwant(g)
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
