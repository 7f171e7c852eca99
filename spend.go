package relay

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// Spend. Every key has a spend account: what it spent in the current day,
// week and month, and in total, and its budgets. Accounts are kept by the
// key's name for the whole process, so a reload carries them over, and
// they survive a restart: without a fleet, in Caddy's storage (the file
// system unless the config names another), written at most
// spendCheckpointEvery apart and when Caddy stops (spend_store.go); in a
// fleet, in Redis, where every relay adds what it charged (fleet_spend.go).

// spendAccounts holds each key's account by name, process-wide.
var spendAccounts = caddy.NewUsagePool()

// spendAccount is one key's spend and budgets.
type spendAccount struct {
	id    string     // what it is kept by: the key's name, group:<name>, channel:<name>
	label string     // what metrics and logs call it: the key's, group's or channel's name
	scope spendScope // whose spend it is

	mu      sync.Mutex
	periods [numPeriods]periodSpend
	dayEnd  time.Time           // the end of periods[periodDay], when roll has work again
	caps    [numPeriods]nanoUSD // budgets; 0: none
	warn    float64             // share of a budget that warns
	// window, for a session's account, is its budget's window: its only
	// period is periods[periodDay], a window of this length aligned to
	// UTC (sessions.go); 0: calendar periods
	window time.Duration
	now    func() time.Time // the clock of its relay

	// holds (hold.go): what this relay's requests in flight hold, and how
	// many hold; what batches hold, by batch (on a single relay: in a
	// fleet, Redis keeps them); in a fleet, the settled holds whose members
	// the next sync gives back with their cost, and what Redis said the
	// fleet holds
	held      nanoUSD
	holding   int
	batches   map[string]batchHold
	batchHeld nanoUSD
	releases  []heldRelease
	fleetHeld nanoUSD
	// groups, for a channel's spend cap, is what each group's requests in
	// flight hold of it on this relay, for their shares (hold_share.go)
	groups map[string]nanoUSD
	// waiting counts, by group, the requests waiting for room on a
	// channel's cap: their groups share it too
	waiting map[string]int
	freed   atomic.Uint64 // counts the holds that ended, for a request about to wait for one

	budgeted atomic.Bool            // it has a budget: requests are checked against it
	fleet    atomic.Pointer[member] // where the fleet's totals are, when shared
	logger   atomic.Pointer[zap.Logger]
	// perIdentity marks the account of one identity of a user * entry:
	// not exported as metrics, whose key label would be unbounded
	perIdentity atomic.Bool
}

// budgetSpec is what an entry's options say of its spend account.
type budgetSpec struct {
	scope  spendScope
	caps   [numPeriods]float64
	warn   float64
	label  string
	logger *zap.Logger
	now    func() time.Time
	window time.Duration // a session's; 0: calendar periods
}

// apply configures account a with the spec, shared by fleet f (nil: none).
func (b budgetSpec) apply(a *spendAccount, f *member) {
	a.mu.Lock()
	a.scope = b.scope
	if a.window != b.window {
		a.window, a.dayEnd = b.window, time.Time{} // rolls at its next look
	}
	a.mu.Unlock()
	a.configure(b.caps, b.warn, b.label, b.logger, b.now)
	a.share(f)
}

// periodSpend is what was spent in one period.
type periodSpend struct {
	start   time.Time // of the period these are for
	usd     nanoUSD   // spent in it, as far as this relay knows
	pending nanoUSD   // in a fleet: charged here and not yet added in Redis
	warned  bool      // the warning was logged for this period
	spent   bool      // and that the budget is spent

	// estimated is the part of usd that estimated outputs cost (settle.go),
	// as this relay charged them
	estimated nanoUSD
	// estimatedPrice is the part of usd charged at the estimate of a model
	// the price table does not know (pricing.go), as this relay charged it
	estimatedPrice nanoUSD
}

// Destruct implements caddy.Destructor: the account's last config is gone.
// What it spent stays in the spend store, for a key that comes back.
func (a *spendAccount) Destruct() error {
	spend.keep(a)
	return nil
}

// configure sets the account's budgets.
func (a *spendAccount) configure(caps [numPeriods]float64, warn float64, label string, logger *zap.Logger, now func() time.Time) {
	if warn <= 0 {
		warn = defaultBudgetWarn
	}
	a.mu.Lock()
	for p, c := range caps {
		a.caps[p] = toNano(c)
	}
	a.warn, a.label, a.now = warn, label, now
	a.budgeted.Store(a.caps != [numPeriods]nanoUSD{})
	a.mu.Unlock()
	a.logger.Store(logger)
}

// roll starts the periods that began since the account last looked, at
// now. A day lies within its week and its month, so while the day holds,
// nothing rolls; the total never does, once begun (a record stored before
// there were totals has none yet). It runs under a.mu.
func (a *spendAccount) roll(now time.Time) {
	if a.window > 0 {
		if now.Before(a.dayEnd) && !now.Before(a.periods[periodDay].start) {
			return
		}
		if s := now.Truncate(a.window); !a.periods[periodDay].start.Equal(s) {
			a.periods[periodDay] = periodSpend{start: s}
		}
		a.dayEnd = a.periods[periodDay].start.Add(a.window)
		return
	}
	if day := a.periods[periodDay].start; !now.Before(day) && now.Before(a.dayEnd) && !a.periods[periodTotal].start.IsZero() {
		return
	}
	for p := range numPeriods {
		if s := p.start(now); !a.periods[p].start.Equal(s) {
			a.periods[p] = periodSpend{start: s}
		}
	}
	a.dayEnd = periodDay.end(a.periods[periodDay].start)
}

// check refuses a request when a budget is spent, or when estimate (USD)
// is more than what remains of one.
func (a *spendAccount) check(now time.Time, estimate float64) *relayError {
	if !a.budgeted.Load() {
		return nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	for p := range numPeriods {
		limit, ps := a.caps[p], a.periods[p]
		if limit <= 0 {
			continue
		}
		if ps.usd >= limit {
			return errBudgetExceeded(a.who(), p, limit.usd(), ps.usd.usd(), p.end(ps.start).Sub(now), 0)
		}
		if estimate > 0 && ps.usd+toNano(estimate) > limit {
			return errBudgetExceeded(a.who(), p, limit.usd(), ps.usd.usd(), p.end(ps.start).Sub(now), estimate)
		}
	}
	return nil
}

// charge adds what a request cost, at now, and warns in logger once per
// period when a budget's warning share is crossed.
func (a *spendAccount) charge(now time.Time, usd float64, logger *zap.Logger) {
	if usd <= 0 {
		return
	}
	a.logger.Store(logger)
	shared := a.fleet.Load() != nil
	a.mu.Lock()
	a.roll(now)
	a.addLocked(toNano(usd), shared)
	crossed := a.crossed()
	a.mu.Unlock()
	spend.dirty.Store(true)
	a.warnOf(crossed)
}

// addLocked adds n to the spend of every period; in a fleet (shared) it
// waits to be added to the fleet's. It runs under a.mu, after roll.
func (a *spendAccount) addLocked(n nanoUSD, shared bool) {
	for p := range numPeriods {
		if !a.counts(p) {
			continue
		}
		ps := &a.periods[p]
		ps.usd += n
		if shared {
			ps.pending += n
		}
	}
}

// counts reports whether the account counts its spend in period p: every
// calendar period, and the total only while it has a total budget, so that
// the accounts that come and go (each identity of user *, keys removed
// from the config) leave no record that is never dropped. It runs under
// a.mu.
func (a *spendAccount) counts(p budgetPeriod) bool {
	if a.window > 0 {
		return p == periodDay
	}
	return p != periodTotal || a.caps[p] > 0
}

// periodEnd is when the account's period p that began at start ends: a
// session's window, or the calendar's. It runs under a.mu.
func (a *spendAccount) periodEnd(p budgetPeriod, start time.Time) time.Time {
	if a.window > 0 {
		return start.Add(a.window)
	}
	return p.end(start)
}

// Kinds of estimate in a charge.
const (
	estimateOutput = iota // an output estimated after its client left (settle.go)
	estimatePrice         // the price of a model the price table does not know (pricing.go)
)

// chargedEstimate records that usd of what was charged at now is an
// estimate of the kind.
func (a *spendAccount) chargedEstimate(now time.Time, usd float64, kind int) {
	if usd <= 0 {
		return
	}
	n := toNano(usd)
	a.mu.Lock()
	a.roll(now)
	for p := range numPeriods {
		if a.counts(p) {
			if kind == estimatePrice {
				a.periods[p].estimatedPrice += n
			} else {
				a.periods[p].estimated += n
			}
		}
	}
	a.mu.Unlock()
	spend.dirty.Store(true)
}

// estimates returns the part of each period's spend, as of now, that
// estimated outputs cost, and the part charged at an unpriced model's
// estimate.
func (a *spendAccount) estimates(now time.Time) (output, price [numPeriods]float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	for p := range numPeriods {
		output[p], price[p] = a.periods[p].estimated.usd(), a.periods[p].estimatedPrice.usd()
	}
	return output, price
}

// warning is a budget whose warning share was crossed.
type warning struct {
	period     budgetPeriod
	spent, cap float64
}

// crossed marks and returns the budgets whose warning share, or whose
// whole, the spend has reached since the last time in this period. It runs
// under a.mu.
func (a *spendAccount) crossed() []warning {
	var w []warning
	for p := range numPeriods {
		ps, limit := &a.periods[p], a.caps[p]
		if limit <= 0 {
			continue
		}
		warn, spent := !ps.warned && ps.usd >= toNano(a.warn*limit.usd()), !ps.spent && ps.usd >= limit
		if warn || spent {
			ps.warned, ps.spent = ps.warned || warn, ps.spent || spent
			w = append(w, warning{period: p, spent: ps.usd.usd(), cap: limit.usd()})
		}
	}
	return w
}

// warnOf logs the budgets that crossed their warning share.
func (a *spendAccount) warnOf(crossed []warning) {
	logger := a.logger.Load()
	if logger == nil || a.scope == spendOfSession { // a session is told; it has no name to log
		return
	}
	for _, w := range crossed {
		msg, field := "key budget nearly spent", "key"
		switch a.scope {
		case spendOfGroup:
			msg, field = "group budget nearly spent", "group"
		case spendOfChannel:
			msg, field = "channel spend_cap nearly spent", "channel"
		}
		switch {
		case w.spent >= w.cap && !w.period.renews():
			msg = [...]string{"key budget spent: it never renews, and its requests are refused until it is raised or the key's spend reset",
				"group budget spent: it never renews, and its requests are refused until it is raised",
				"channel spend_cap spent: it never renews, and the channel is out of selection until it is raised"}[a.scope]
		case w.spent >= w.cap:
			msg = [...]string{"key budget spent: its requests are refused until the period ends",
				"group budget spent: its requests are refused until the period ends",
				"channel spend_cap spent: it leaves selection until the period ends"}[a.scope]
		}
		logger.Warn(msg, zap.String(field, a.label), zap.String("period", w.period.String()),
			zap.Float64("spent_usd", w.spent), zap.Float64("budget_usd", w.cap))
	}
}

// spent returns what the account spent in each period as of now (its
// relay's clock when zero), and its budgets.
func (a *spendAccount) spent(now time.Time) (usd, caps [numPeriods]float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if now.IsZero() {
		now = a.clock()
	}
	a.roll(now)
	for p := range numPeriods {
		usd[p], caps[p] = a.periods[p].usd.usd(), a.caps[p].usd()
	}
	return usd, caps
}

// clock is the time on the account's relay's clock. It runs under a.mu.
func (a *spendAccount) clock() time.Time {
	if a.now == nil {
		return time.Now()
	}
	return a.now()
}

// nanoUSD is an amount in billionths of a US dollar: spend is summed in
// integers, so that adding many small costs is exact and a budget is
// reached when it is, not a rounding error later.
type nanoUSD int64

// toNano is usd in nanoUSD, rounded to the nearest.
func toNano(usd float64) nanoUSD { return nanoUSD(math.Round(usd * 1e9)) }

// usd is n in US dollars.
func (n nanoUSD) usd() float64 { return float64(n) / 1e9 }
