package relay

import (
	"slices"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// A model the price table does not know is never free where money is
// counted. A channel without a `models` line serves whatever model a
// client names (an old snapshot, an alias, an id in upper case), and a
// client chooses its model: at no price, a budget or a spend cap would
// hold nothing and charge nothing for it. So a request to which a budget
// or a spend cap applies holds, and is charged, at the dearest row of the
// model's family in the price table (estimates, internal/money), and says so:
// estimated_price in its log line and its ledger row, estimated_price_usd
// in GET /relay/keys, relay_unpriced_total. A request that no budget and
// no cap counts stays free, as before: nothing is owed to anyone. A
// `pricing` row for the model makes it exact.

// ratesFor is what model costs a request: its row of the price table; for
// a model the table does not know, when counted (a budget or a spend cap
// applies to the request), the dearest row of its family, and estimated
// is true; nil when it costs nothing.
func (r *Relay) ratesFor(model string, counted bool) (rates *money.Rates, estimated bool) {
	if rates = r.prices.Lookup(model); rates != nil || !counted {
		return rates, false
	}
	return r.estimates.Of(model), true
}

var metricUnpriced = prometheus.NewCounterVec(prometheus.CounterOpts{
	Name: "relay_unpriced_total",
	Help: "Requests, and batch results, charged at the dearest price of their model's family because the price table does not know the model, by model (other: one no channel lists; the log line names it).",
}, []string{"model"})

// unpriced counts a charge at an unpriced model's estimate, and records
// it in the spend of the principal that pays it.
func (r *Relay) unpriced(in *inbound, model string, cost float64) {
	metricUnpriced.WithLabelValues(r.modelLabel(model)).Inc()
	var a *money.Account
	switch {
	case in.end.batch != nil && in.end.batch.payer != nil: // a batch's maker pays for its results
		a = in.end.batch.payer
	case in.who.state != nil:
		a = in.who.state.spend
	}
	if a != nil {
		a.ChargedEstimate(r.now(), cost, money.EstimatePrice)
	}
}

// warnUnpriced warns, at load, of each group where a budget or a spend cap
// meets a channel that serves models the price table may not know: one
// without a `models` line (it serves every model), or one that lists a
// model without a price. The warning names the budgets, the channels and
// the unpriced models listed, so a `pricing` row can end the estimate.
func (r *Relay) warnUnpriced() {
	// each budget is noted once (a key, a user, a group, a channel of the
	// group); a warning names the first few of a group's, and counts them
	// all: a config of many budgeted keys is read in one pass
	const named = 10
	budgets, counts := map[*group][]string{}, map[*group]int{}
	note := func(g *group, what string) {
		if g == nil {
			return
		}
		if counts[g]++; counts[g] <= named {
			budgets[g] = append(budgets[g], what)
		}
	}
	for _, k := range r.keys {
		if len(k.opts.Budgets) > 0 {
			note(k.group, k.kind()+" "+strconv.Quote(k.name))
		}
		if k.sessions != nil && k.sessions.budgetUSD > 0 {
			note(k.group, "the session budget of "+k.kind()+" "+strconv.Quote(k.name))
		}
	}
	for _, k := range r.users {
		if len(k.opts.Budgets) > 0 {
			note(k.group, "user "+strconv.Quote(k.id))
		}
	}
	if k := r.anyUser; k != nil && len(k.opts.Budgets) > 0 {
		note(k.group, "user *")
	}
	for _, g := range r.groups {
		if g.spend != nil && g.spend.Budgeted() {
			note(g, "group "+strconv.Quote(g.name))
		}
		for _, ch := range g.channels {
			if ch.spend != nil {
				note(g, "the spend_cap of channel "+strconv.Quote(ch.name))
			}
		}
	}
	for _, g := range r.groups {
		if len(budgets[g]) == 0 {
			continue
		}
		var every, unlisted []string
		for _, ch := range g.channels {
			if ch.models == nil {
				every = append(every, ch.name)
			}
			for _, m := range ch.modelNames {
				if r.prices.Lookup(m) == nil && !slices.Contains(unlisted, m) {
					unlisted = append(unlisted, m)
				}
			}
		}
		if len(every) == 0 && len(unlisted) == 0 {
			continue
		}
		slices.Sort(budgets[g])
		fields := []zap.Field{zap.String("group", g.name), zap.Strings("budgets", budgets[g])}
		if counts[g] > named {
			fields = append(fields, zap.Int("budgets_in_all", counts[g]))
		}
		if len(every) > 0 {
			fields = append(fields, zap.Strings("channels_serving_every_model", every))
		}
		if len(unlisted) > 0 {
			slices.Sort(unlisted)
			fields = append(fields, zap.Strings("unpriced_models", unlisted))
		}
		r.logger.Warn("budgets meet models without a price: a request for a model the price table does not know holds and pays the dearest price of its family ("+
			strings.Join(classFamilies[:], ", ")+", else the dearest of all); give such models a pricing row, or the channels a models line", fields...)
	}
}
