package relay

import (
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/tidwall/gjson"
)

// A Message Batch's holds, as the relay reads them from its create: the
// sum of its requests' worst cases, held at its create against the
// budgets of its principal and group and the caps of the channels that
// may make it, and settled when its results are read
// (internal/money's hold_batches.go says how they last).

// batchWorstCase is the most a batch's requests may cost, in USD: each
// request's worst case as a message's (of its own params, its input at
// least its hold floor when it reads from outside them, a floor that no
// budget caps: a batch's requests are many), its tokens at its model's
// batch price (an unpriced model's estimate: internal/money) and its web
// searches at their full price, times factor, the highest price_factor
// among the channels that may take the batch; long: the create asks for
// the 1M context.
func (r *Relay) batchWorstCase(body []byte, factor float64, long bool) float64 {
	total := 0.0
	gjson.GetBytes(body, "requests").ForEach(func(_, req gjson.Result) bool {
		params := req.Get("params")
		model := params.Get("model").Str
		if rates, _ := r.ratesFor(model, true); rates != nil {
			prompt, maxOut := int64(len(params.Raw)/4)+1, params.Get("max_tokens").Int()
			worst := rates.Worst(prompt, maxOut)
			if rawReadsOutside([]byte(params.Raw)) {
				worst = max(worst, rates.Worst(0, maxOut)+r.floorOf(rates, contextWindow(model, long)))
			}
			total += worst*rates.Batch() + float64(money.WebSearchesOf(params.Get("tools")))*rates.WebSearch()
		}
		return true
	})
	return total * factor
}

// holdBatch takes the holds of a batch of body that one of cands will
// make: against the budgets of the request's principal and its group,
// all or none, then against the spend cap of each candidate, the
// candidates whose cap cannot take it dropped from cands. nil when no
// budget and no cap applies. A batch that does not fit is answered.
//
// Every candidate's cap is held while the create runs, as the relay does
// not know which of them will make the batch; the one that makes it keeps
// its hold until the results settle it, the others are given back. A cap
// is held, not only looked at: creates that arrive together each saw room
// for themselves alone.
func (r *Relay) holdBatch(in *inbound, body []byte, cands *[]*channel) (held *money.BatchHolds, rerr *relayError) {
	var accts []*money.Account
	for _, a := range [2]*money.Account{in.who.state.spend, in.group().spend} {
		if a != nil && a.Budgeted() {
			accts = append(accts, a)
		}
	}
	capped := in.group().capped
	if len(accts) == 0 && !capped {
		return nil, nil
	}
	factor := 0.0
	for _, ch := range *cands {
		factor = max(factor, ch.priceFactor)
	}
	long := strings.Contains(strings.Join(in.ask.header.Values("Anthropic-Beta"), ","), context1m)
	worst := money.CeilNano(r.batchWorstCase(body, factor, long))
	if worst == 0 { // a price table whose every row is free
		return nil, nil
	}
	now := r.now()
	b := money.NewBatchHolds(worst, func() time.Time { return r.now() }, r.logger)
	var ans money.HoldAnswer
	if len(accts) > 0 {
		var err error
		if ans, err = b.Take(accts, now, ""); err != nil {
			return nil, errStorageUnavailable()
		}
	}
	switch ans.Verdict {
	case money.HoldRefused:
		return nil, r.budgetRefusal(in, accts[ans.Index], worst, ans)
	case money.HoldWait:
		a := accts[ans.Index]
		metricRateLimited.WithLabelValues(in.who.key.name, string(scopeBudget)).Inc()
		return nil, errBudgetHeld(a.Who(), ans, a.CapOf(ans.Period), worst, "; a batch does not wait for them")
	}
	if capped {
		if rerr := holdCaps(b, cands, now); rerr != nil {
			b.Abandon()
			return nil, rerr
		}
	}
	if !b.Held() {
		return nil, nil
	}
	return b, nil
}

// holdCaps holds the batch b against the spend cap of each candidate that
// has one, and drops from cands the channels whose cap is spent or cannot
// take it beside what it spent and holds. None left: the batch is
// answered as a request is.
func holdCaps(b *money.BatchHolds, cands *[]*channel, now time.Time) *relayError {
	var out *channel
	kept := (*cands)[:0:0]
	for _, ch := range *cands {
		if ch.spend != nil {
			ans, err := b.Take([]*money.Account{ch.spend}, now, ch.name)
			if err != nil {
				return errStorageUnavailable()
			}
			if ans.Verdict != money.HoldTaken {
				out = ch
				continue
			}
		}
		kept = append(kept, ch)
	}
	if len(kept) > 0 {
		*cands = kept
		return nil
	}
	_, until := out.spend.Capped(now)
	return errChannelsCapped("the batch's models", out, now, untilFrom(until, now))
}

// settleBatch makes the request that accounts the results of the batch up
// on channel settle that batch's holds, those whose accounts are
// configured here: the results' cost is then charged to each as its hold
// is given back. The request's own principal and group are charged what
// held nothing (settleHolds), and a hold whose account is gone is given
// back.
func (r *Relay) settleBatch(in *inbound, channel, up string) {
	id := money.BatchHoldID(channel, up)
	var hs *money.Holds
	if r.fleet != nil {
		hs = r.fleet.money.BatchHolds(id) // the batch's record says whose holds it has
	} else {
		hs = money.LocalBatchHolds(id)
	}
	if hs == nil {
		return
	}
	in.grant.holds = hs
	in.payBatch(hs)
}

// payBatch notes whose spend the cost of the batch results that the
// request settles the holds hs of goes to: the principal that made the
// batch, when it held (its key's or identity's account is among hs). The
// request's own principal is then not charged (settleHolds): a batch's
// cost is charged once, to one key, whichever key of the group reads it.
func (in *inbound) payBatch(hs *money.Holds) {
	if a := hs.Payer(); a != nil {
		in.end.batchPayer(a) // nothing when the request accounts no batch
	}
}
