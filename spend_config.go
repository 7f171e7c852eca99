package relay

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// The spend accounts a config takes (internal/money keeps them, by id,
// across reloads): its groups' and its capped channels', with what their
// config says of their budgets; the relay's answers to a request a budget
// or a cap refuses; an operator's reset of a key's spend.

// principalOf names the key's or identity's account a as the ledger does:
// the key's (or user entry's) name, and the identity ("" for a relay key).
func principalOf(a *money.Account) (key, user string) {
	key = a.Label()
	if id, ok := strings.CutPrefix(a.ID(), userStatePrefix); ok {
		user = id
	}
	return key, user
}

// takeSpend takes the account id from the pool for this config, with
// the budgets spec says.
func (r *Relay) takeSpend(id string, spec money.BudgetSpec) (*money.Account, error) {
	a, err := money.Open(id)
	if err != nil {
		return nil, err
	}
	r.held.addSpend(id)
	spec.Logger, spec.Now = r.logger, func() time.Time { return r.now() }
	spec.Apply(a, r.fleet.moneyOf())
	return a, nil
}

// groupSpend takes the account of group cfg.
func (r *Relay) groupSpend(cfg *Group) (*money.Account, error) {
	caps, _ := money.ParseBudgets(cfg.Budgets) // validated already
	return r.takeSpend(money.GroupPrefix+cfg.Name, money.BudgetSpec{Scope: money.OfGroup, Caps: caps, Warn: cfg.BudgetWarn, Label: cfg.Name})
}

// channelSpend takes the account of channel cfg when it has a spend cap;
// nil when it has none.
func (r *Relay) channelSpend(cfg *Channel) (*money.Account, error) {
	if len(cfg.SpendCaps) == 0 {
		return nil, nil
	}
	caps, _ := money.ParseBudgets(cfg.SpendCaps) // validated already
	return r.takeSpend(money.ChannelPrefix+cfg.Name, money.BudgetSpec{Scope: money.OfChannel, Caps: caps, Label: cfg.Name})
}

// stateCapped is the state GET /relay/channels gives a channel whose
// spend cap is spent, and that is not out for another reason.
const stateCapped = "capped"

// maxCappedWait is the longest retry-after a capped channel's answer
// gives: a month's cap renews within it; a total cap never does.
const maxCappedWait = 31 * 24 * time.Hour

// errChannelsCapped answers a request whose every channel that serves
// its model is out, one of them (ch) because its spend cap is spent (or
// cannot take the request's worst case), until wait from now (0: never,
// by itself). It names the cap's period, never the channel or what was
// spent on it: a channel serves other groups too, and what it spent is
// theirs as much as this tenant's (the operator has GET /relay/channels).
func errChannelsCapped(model string, ch *channel, now time.Time, wait time.Duration) *relayError {
	msg := "every channel serving " + strconv.Quote(model) + " is out; one of them"
	if p, ok := ch.spend.FirstSpent(now); ok {
		msg += " has spent its " + p.Adjective() + " spend_cap"
	} else {
		msg += " cannot take this request's worst case within what is left of its spend_cap"
	}
	e := &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "no_healthy_channel",
		msg: msg, retryAfter: wait, cause: causeRelay}
	if wait <= 0 || wait > maxCappedWait { // a total cap, or out for other reasons with no end
		e.retryAfter, e.noRetry = 0, true
	}
	return e
}

// errBudgetExceeded answers a request whose budget (of its key, user
// entry or group: who names it, as spendAccount.who does) is spent, or
// whose hold (estimate, its worst case) is more than what remains of it.
// Retrying before the period ends cannot help, so the SDKs are told not
// to. A total budget never renews: its answer says so, and gives no
// retry-after, since no wait would help.
func errBudgetExceeded(who string, p money.Period, capUSD, spent float64, wait time.Duration, estimate float64) *relayError {
	renews, retryAfter := "it renews in "+wait.Round(time.Second).String(), max(wait, time.Second)
	if !p.Renews() {
		renews, retryAfter = "it never renews", 0
	}
	msg := fmt.Sprintf("%s has spent %s of its %s %s budget; %s",
		who, dollars(spent), p.Adjective(), dollars(capUSD), renews)
	if estimate > 0 {
		msg = fmt.Sprintf("%s cannot afford this request: it may cost up to %s (its input estimate and max_tokens), and %s remains of its %s %s budget",
			who, dollars(estimate), dollars(max(0, capUSD-spent)), p.Adjective(), dollars(capUSD))
		if !p.Renews() {
			msg += ", which never renews"
		}
	}
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "budget_exceeded",
		msg: msg, retryAfter: retryAfter, noRetry: true}
}

// dollars formats an amount in US dollars for a message: cents, and below
// a dollar at least two significant digits, so that a sub-cent amount
// reads $0.0042 and not $0.00.
func dollars(v float64) string {
	decimals := 2
	if v > 0 && v < 1 {
		decimals = min(max(2, 1-int(math.Floor(math.Log10(v)))), 10)
	}
	s := strconv.FormatFloat(v, 'f', decimals, 64)
	if decimals > 2 {
		s = strings.TrimRight(s, "0")
		if len(s)-strings.IndexByte(s, '.')-1 < 2 {
			s = strconv.FormatFloat(v, 'f', 2, 64)
		}
	}
	return "$" + s
}

// resetSpend forgives what k spent in periods, the ones current at now,
// and logs it once. In a fleet, an error says Redis did not answer, and
// nothing was reset.
func (k *key) resetSpend(now time.Time, periods []money.Period) error {
	a, err := money.Reset(k.relay.fleet.moneyOf(), k.stateID, periods, now)
	if err != nil {
		return err
	}
	if a != nil {
		k.group.state.queue.WakeFor(a) // a request that waits on its budget may fit now
	}
	names := make([]string, len(periods))
	for i, p := range periods {
		names[i] = p.String()
	}
	k.relay.logger.Info("key spend reset", zap.String("key", k.name), zap.String("kind", k.kind()), zap.Strings("periods", names))
	return nil
}

// configStorage is the storage of ctx's config: Caddy's storage module, the
// file system by default. A context made outside a loaded config, as in a
// unit test, has none: the spend is then kept in memory only.
func configStorage(ctx caddy.Context) (s certmagic.Storage) {
	defer func() {
		if recover() != nil {
			s = nil
		}
	}()
	return ctx.Storage()
}
