package relay

import (
	"bytes"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/money"
)

// Degrade before refusing. A budget that nears its end need not stop a
// developer in the middle of a task: from a share of the tightest budget
// that applies to a message (its principal's, its group's or its agent
// session's, after the holds in flight), budget_degrade serves it more cheaply, on the channels
// of the live tier with the lowest price_factor (cheaper) or as another,
// cheaper model (model <id>). Only a budget that is spent refuses it, with
// the usual 429 budget_exceeded. Every answer to a request a budget
// applies to says what is left of the tightest one, in
// x-relay-budget-remaining-usd.

// BudgetDegrade is one step of budget_degrade: from a share of the
// tightest budget that applies to a message, it is served more cheaply.
type BudgetDegrade struct {
	// Percent is the share of the tightest budget, in percent (above 0 and
	// below 100), from which the step applies: what was spent in the
	// budget's period and what the requests in flight hold, over the
	// budget. The tightest budget is the one with the least left, of the
	// principal's, its group's and its agent session's (session_budget).
	Percent float64 `json:"percent"`

	// Mode is what the step does: `cheaper` picks among the channels of
	// the live tier those with the lowest price_factor; `model` serves the
	// message as Model instead (announced in the x-relay-model response
	// header, and billed at that model's price) when that costs less than
	// the model asked.
	Mode string `json:"mode"`

	// Model is the model a `model` step serves instead of the one asked;
	// a channel of the group must serve it.
	Model string `json:"model,omitempty"`
}

// Modes of budget_degrade, and the mode label of relay_degraded_total.
const (
	degradeCheaper = "cheaper"
	degradeModel   = "model"
)

// degradeRule is a provisioned BudgetDegrade.
type degradeRule struct {
	percent float64
	model   string // "" for cheaper
}

// checkDegrade checks the steps of an entry's budget_degrade: each share
// within (0, 100), each mode known, a model for model steps and none
// otherwise, one cheaper step at most, and model steps at different
// shares.
func checkDegrade(steps []BudgetDegrade) error {
	cheaper, models := false, map[float64]string{}
	for i, s := range steps {
		at := fmt.Sprintf("budget_degrade #%d", i+1)
		if !(s.Percent > 0 && s.Percent < 100) {
			return fmt.Errorf("%s: the percent must be above 0 and below 100 (at 100%% the budget is spent and refuses), not %v", at, s.Percent)
		}
		switch s.Mode {
		case degradeCheaper:
			if s.Model != "" {
				return fmt.Errorf("%s: mode cheaper takes no model (to serve another model, use mode model)", at)
			}
			if cheaper {
				return fmt.Errorf("%s: cheaper is given twice: give it once, at the share it should start from", at)
			}
			cheaper = true
		case degradeModel:
			if !validModelName(s.Model) {
				return fmt.Errorf("%s: mode model needs the model to serve instead, such as claude-haiku-4-5, not %q", at, s.Model)
			}
			if was, dup := models[s.Percent]; dup {
				return fmt.Errorf("%s: two models at %v%% (%s and %s): give each its own share", at, s.Percent, was, s.Model)
			}
			models[s.Percent] = s.Model
		default:
			return fmt.Errorf("%s: mode must be cheaper or model, not %q", at, s.Mode)
		}
	}
	return nil
}

// degradeRules provisions checked steps, by share.
func degradeRules(steps []BudgetDegrade) []degradeRule {
	if len(steps) == 0 {
		return nil
	}
	out := make([]degradeRule, 0, len(steps))
	for _, s := range steps {
		out = append(out, degradeRule{percent: s.Percent, model: s.Model})
	}
	slices.SortStableFunc(out, func(a, b degradeRule) int {
		switch {
		case a.percent < b.percent:
			return -1
		case a.percent > b.percent:
			return 1
		}
		return 0
	})
	return out
}

// checkDegradeModels checks that a channel of g serves each model that
// steps serve instead; who names their entry.
func checkDegradeModels(steps []BudgetDegrade, g *group, who string) error {
	for _, s := range steps {
		if s.Mode == degradeModel && !g.servesModel(s.Model) {
			return fmt.Errorf("%s: budget_degrade %v%% model %s: no channel of group %q serves %s", who, s.Percent, s.Model, g.name, s.Model)
		}
	}
	return nil
}

// servesModel reports whether a channel of g serves model.
func (g *group) servesModel(model string) bool {
	for _, ch := range g.channels {
		if ch.serves(model) {
			return true
		}
	}
	return false
}

// degraded is what budget_degrade did to a request.
type degraded struct {
	cheaper bool   // it picks among the cheapest channels of the live tier
	model   string // the model it is served as in place of the one asked; "" none
}

// budgetAccounts are the accounts whose budgets apply to a request of
// in: its principal's, its group's and, once its session was admitted,
// its session's, those with a budget.
func (in *inbound) budgetAccounts() (accts [3]*money.Account, n int) {
	if in.who.key == nil || in.who.state == nil {
		return accts, 0
	}
	return money.Budgeted(in.who.state.spend, in.group().spend, in.grant.session.budgetAccount())
}

// tightestBudget is the budget with the least left of those that apply to
// in, at now; known is false when none does.
func (in *inbound) tightestBudget(now time.Time) money.Room {
	accts, n := in.budgetAccounts()
	var t money.Room
	for _, a := range accts[:n] {
		a.Rooms(now, func(b money.Room) {
			if b.Tighter(t) {
				t = b
			}
		})
	}
	return t
}

// degradeAt is what steps degrade to with the budget t spent as it is:
// whether a cheaper step is reached, and the model of the last model step
// reached when the group serves it ("" for none). degrade and the usage
// answer both read it, so the answer never names a model a request would
// not be sent to (a request also needs the model to cost it less).
func (in *inbound) degradeAt(steps []degradeRule, t money.Room) (cheaper bool, model string) {
	if !t.Known || t.Spent >= t.Limit {
		return false, ""
	}
	used := t.Percent()
	for _, s := range steps {
		if used < s.percent {
			break
		}
		if s.model == "" {
			cheaper = true
		} else {
			model = s.model
		}
	}
	if model != "" && !in.group().servesModel(model) {
		model = ""
	}
	return cheaper, model
}

// degradeSteps are the budget_degrade steps of a request of in: its
// principal's entry's, else its group's.
func (in *inbound) degradeSteps() []degradeRule {
	if steps := in.who.key.degrade; len(steps) > 0 {
		return steps
	}
	return in.group().degrade
}

// degrade applies the budget_degrade steps a message has reached: every
// cheaper step, and the model of the last model step, when it costs less
// for this request than the model asked and the group serves it. A spent
// budget degrades nothing: the request is refused by its holds. A request
// without steps pays nothing.
func (r *Relay) degrade(in *inbound) {
	if in.route != routeMessages || in.who.state == nil {
		return
	}
	steps := in.degradeSteps()
	if len(steps) == 0 {
		return
	}
	t := in.tightestBudget(r.now())
	if !t.Known || t.Spent >= t.Limit {
		return
	}
	cheaper, model := in.degradeAt(steps, t)
	in.grant.degrade.cheaper = cheaper
	g := in.group()
	if model != "" && model != in.ask.model &&
		r.worstOf(in, model, false) < r.worstOf(in, in.ask.model, false) {
		in.grant.degrade.model, in.grant.target = model, model
		metricDegraded.WithLabelValues(g.name, degradeModel).Inc()
	}
	if in.grant.degrade.cheaper {
		metricDegraded.WithLabelValues(g.name, degradeCheaper).Inc()
	}
}

// servedAs is the model a request is served as before any fallback: the
// one asked, or the one budget_degrade serves instead.
func (in *inbound) servedAs() string {
	if in.grant.degrade.model != "" {
		return in.grant.degrade.model
	}
	return in.ask.model
}

// cheapest keeps the channels of the lowest price_factor, in place.
func cheapest(chs []*channel) []*channel {
	least := chs[0].priceFactor
	for _, ch := range chs[1:] {
		least = min(least, ch.priceFactor)
	}
	return filter(chs, func(ch *channel) bool { return ch.priceFactor == least })
}

// headerBudgetRemaining is what is left of the tightest budget that
// applies to a request, in US dollars, on every answer to it.
const headerBudgetRemaining = "X-Relay-Budget-Remaining-Usd"

// budgetHeader sets x-relay-budget-remaining-usd on an answer to in, when
// a budget applies to it: what is left of the tightest, once the requests
// in flight (this one among them, while it holds) cost what they hold. A
// request no budget applies to pays nothing for it.
func (in *inbound) budgetHeader(h http.Header) {
	if in.who.key == nil || in.who.state == nil {
		return
	}
	if _, n := in.budgetAccounts(); n == 0 {
		return
	}
	if t := in.tightestBudget(in.who.key.relay.now()); t.Known {
		h[headerBudgetRemaining] = []string{formatUSD(t.Left())}
	}
}

// formatUSD writes n as a plain decimal number of US dollars, exactly (to
// the billionth), without trailing zeros: 12, 0.75, 0.000001.
func formatUSD(n money.NanoUSD) string {
	var b [32]byte
	return string(appendUSD(b[:0], n))
}

// appendUSD appends formatUSD(n) to b.
func appendUSD(b []byte, n money.NanoUSD) []byte {
	if n < 0 {
		b, n = append(b, '-'), -n
	}
	whole, frac := int64(n)/1e9, int64(n)%1e9
	b = strconv.AppendInt(b, whole, 10)
	if frac == 0 {
		return b
	}
	dot := len(b)
	b = strconv.AppendInt(append(b, '.'), frac+1e9, 10) // a 1, then nine digits, leading zeros kept
	b = append(b[:dot+1], b[dot+2:]...)
	return bytes.TrimRight(b, "0")
}

// checkDegrade checks, once its group is known, the budget_degrade steps
// of a key or user entry (who names it): a model step's model must be
// served by the group, and some budget must apply for a step to reach.
func (k *key) checkDegrade(who string) error {
	steps := k.opts.BudgetDegrade
	if len(steps) == 0 {
		return nil
	}
	if len(k.opts.Budgets) == 0 && !k.group.spend.Budgeted() {
		return fmt.Errorf("%s: budget_degrade needs a budget to degrade by, and neither it nor group %q has one: give it a budget", who, k.group.name)
	}
	return checkDegradeModels(steps, k.group, who)
}
