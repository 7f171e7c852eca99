package money

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

// Account is one key's spend and budgets.
type Account struct {
	id    string // what it is kept by: the key's name, group:<name>, channel:<name>
	label string // what metrics and logs call it: the key's, group's or channel's name
	scope Scope  // whose spend it is

	mu      sync.Mutex
	periods [NumPeriods]periodSpend
	dayEnd  time.Time           // the end of periods[periodDay], when roll has work again
	caps    [NumPeriods]NanoUSD // budgets; 0: none
	warn    float64             // share of a budget that warns
	// window, for a session's account, is its budget's window: its only
	// period is periods[periodDay], a window of this length aligned to
	// UTC (a session budget's window); 0: calendar periods
	window time.Duration
	now    func() time.Time // the clock of its relay

	// holds (hold.go): what this relay's requests in flight hold, and how
	// many hold; what batches hold, by batch (on a single relay: in a
	// fleet, Redis keeps them); in a fleet, the settled holds whose members
	// the next sync gives back with their cost, and what Redis said the
	// fleet holds
	held      NanoUSD
	holding   int
	batches   map[string]batchHold
	batchHeld NanoUSD
	releases  []heldRelease
	fleetHeld NanoUSD
	// groups, for a channel's spend cap, is what each group's requests in
	// flight hold of it on this relay, for their shares (hold_share.go)
	groups map[string]NanoUSD
	// waiting counts, by group, the requests waiting for room on a
	// channel's cap: their groups share it too
	waiting map[string]int
	freed   atomic.Uint64 // counts the holds that ended, for a request about to wait for one

	budgeted atomic.Bool            // it has a budget: requests are checked against it
	fleet    atomic.Pointer[Shared] // where the fleet's totals are, when shared
	logger   atomic.Pointer[zap.Logger]
	// perIdentity marks the account of one identity of a user * entry:
	// not exported as metrics, whose key label would be unbounded
	perIdentity atomic.Bool
}

// BudgetSpec is what an entry's options say of its spend account.
type BudgetSpec struct {
	Scope  Scope               // whose spend it is
	Caps   [NumPeriods]float64 // budgets by period, USD; 0: none
	Warn   float64             // share of a budget that warns; 0: the default
	Label  string              // what metrics and logs call it
	Logger *zap.Logger         // where its warnings go
	Now    func() time.Time    // the clock of its relay; nil: the wall clock
	Window time.Duration       // a session's; 0: calendar periods
}

// Apply configures account a with the spec, shared by fleet f (nil: none).
func (b BudgetSpec) Apply(a *Account, f *Shared) {
	a.mu.Lock()
	a.scope = b.Scope
	if a.window != b.Window {
		a.window, a.dayEnd = b.Window, time.Time{} // rolls at its next look
	}
	a.mu.Unlock()
	a.Configure(b.Caps, b.Warn, b.Label, b.Logger, b.Now)
	a.Share(f)
}

// periodSpend is what was spent in one period.
type periodSpend struct {
	start   time.Time // of the period these are for
	usd     NanoUSD   // spent in it, as far as this relay knows
	pending NanoUSD   // in a fleet: charged here and not yet added in Redis
	warned  bool      // the warning was logged for this period
	spent   bool      // and that the budget is spent

	// estimated is the part of usd that estimated outputs cost (a client that left),
	// as this relay charged them
	estimated NanoUSD
	// estimatedPrice is the part of usd charged at the estimate of a model
	// the price table does not know (pricing.go), as this relay charged it
	estimatedPrice NanoUSD
}

// Destruct implements caddy.Destructor: the account's last config is gone.
// What it spent stays in the spend store, for a key that comes back.
func (a *Account) Destruct() error {
	spend.keep(a)
	return nil
}

// ID is what the account is kept by: its key's state id, group:<name>,
// channel:<name>, session:<digest>.
func (a *Account) ID() string { return a.id }

// Label is what metrics and logs call the account: its key's, group's or
// channel's name.
func (a *Account) Label() string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.label
}

// Scope is whose spend the account is.
func (a *Account) Scope() Scope {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.scope
}

// SetPerIdentity marks the account of one identity of a user * entry: it
// is not exported as metrics, whose key label would be unbounded.
func (a *Account) SetPerIdentity() { a.perIdentity.Store(true) }

// NewAccount is an account of id outside the pool, with nothing spent.
func NewAccount(id string) *Account { return &Account{id: id} }

// Freed counts the holds of the account that ended: a request about to
// wait for one compares it with what it was when it looked.
func (a *Account) Freed() uint64 { return a.freed.Load() }

// InFleet reports whether a fleet keeps the account's spend and holds.
func (a *Account) InFleet() bool { return a.fleet.Load() != nil }

// Budgeted reports whether the account has a budget: requests are checked
// against it.
func (a *Account) Budgeted() bool { return a.budgeted.Load() }

// Configure sets the account's budgets.
func (a *Account) Configure(caps [NumPeriods]float64, warn float64, label string, logger *zap.Logger, now func() time.Time) {
	if warn <= 0 {
		warn = defaultBudgetWarn
	}
	a.mu.Lock()
	for p, c := range caps {
		a.caps[p] = ToNano(c)
	}
	a.warn, a.label, a.now = warn, label, now
	a.budgeted.Store(a.caps != [NumPeriods]NanoUSD{})
	a.mu.Unlock()
	a.logger.Store(logger)
}

// roll starts the periods that began since the account last looked, at
// now. A day lies within its week and its month, so while the day holds,
// nothing rolls; the total never does, once begun (a record stored before
// there were totals has none yet). It runs under a.mu.
func (a *Account) roll(now time.Time) {
	if a.window > 0 {
		if now.Before(a.dayEnd) && !now.Before(a.periods[PeriodDay].start) {
			return
		}
		if s := now.Truncate(a.window); !a.periods[PeriodDay].start.Equal(s) {
			a.periods[PeriodDay] = periodSpend{start: s}
		}
		a.dayEnd = a.periods[PeriodDay].start.Add(a.window)
		return
	}
	if day := a.periods[PeriodDay].start; !now.Before(day) && now.Before(a.dayEnd) && !a.periods[PeriodTotal].start.IsZero() {
		return
	}
	for p := range NumPeriods {
		if s := p.Start(now); !a.periods[p].start.Equal(s) {
			a.periods[p] = periodSpend{start: s}
		}
	}
	a.dayEnd = PeriodDay.End(a.periods[PeriodDay].start)
}

// Exceeded is a budget that refuses a request: its period, the budget
// and what was spent in it (USD), the time until the period ends, and
// the request's estimate (USD) when the budget is not spent but cannot
// afford it (0: it is spent).
type Exceeded struct {
	Period     Period        // the budget's period
	Cap, Spent float64       // the budget and what was spent in its period, USD
	Wait       time.Duration // until the period ends
	Estimate   float64       // the request's worst case, USD; 0: the budget is spent
}

// Check refuses a request when a budget is spent, or when estimate (USD)
// is more than what remains of one: which, and how (false: it passes).
func (a *Account) Check(now time.Time, estimate float64) (Exceeded, bool) {
	if !a.budgeted.Load() {
		return Exceeded{}, false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	for p := range NumPeriods {
		limit, ps := a.caps[p], a.periods[p]
		if limit <= 0 {
			continue
		}
		if ps.usd >= limit {
			return Exceeded{p, limit.USD(), ps.usd.USD(), p.End(ps.start).Sub(now), 0}, true
		}
		if estimate > 0 && ps.usd+ToNano(estimate) > limit {
			return Exceeded{p, limit.USD(), ps.usd.USD(), p.End(ps.start).Sub(now), estimate}, true
		}
	}
	return Exceeded{}, false
}

// Charge adds what a request cost, at now, and warns in logger once per
// period when a budget's warning share is crossed.
func (a *Account) Charge(now time.Time, usd float64, logger *zap.Logger) {
	if usd <= 0 {
		return
	}
	a.logger.Store(logger)
	shared := a.fleet.Load() != nil
	a.mu.Lock()
	a.roll(now)
	a.addLocked(ToNano(usd), shared)
	crossed := a.crossed()
	a.mu.Unlock()
	spend.dirty.Store(true)
	a.warnOf(crossed)
}

// addLocked adds n to the spend of every period; in a fleet (shared) it
// waits to be added to the fleet's. It runs under a.mu, after roll.
func (a *Account) addLocked(n NanoUSD, shared bool) {
	for p := range NumPeriods {
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
func (a *Account) counts(p Period) bool {
	if a.window > 0 {
		return p == PeriodDay
	}
	return p != PeriodTotal || a.caps[p] > 0
}

// periodEnd is when the account's period p that began at start ends: a
// session's window, or the calendar's. It runs under a.mu.
func (a *Account) periodEnd(p Period, start time.Time) time.Time {
	if a.window > 0 {
		return start.Add(a.window)
	}
	return p.End(start)
}

// Kinds of estimate in a charge.
const (
	EstimateOutput = iota // an output estimated after its client left
	EstimatePrice         // the price of a model the price table does not know (pricing.go)
)

// ChargedEstimate records that usd of what was charged at now is an
// estimate of the kind.
func (a *Account) ChargedEstimate(now time.Time, usd float64, kind int) {
	if usd <= 0 {
		return
	}
	n := ToNano(usd)
	a.mu.Lock()
	a.roll(now)
	for p := range NumPeriods {
		if a.counts(p) {
			if kind == EstimatePrice {
				a.periods[p].estimatedPrice += n
			} else {
				a.periods[p].estimated += n
			}
		}
	}
	a.mu.Unlock()
	spend.dirty.Store(true)
}

// Estimates returns the part of each period's spend, as of now, that
// estimated outputs cost, and the part charged at an unpriced model's
// estimate.
func (a *Account) Estimates(now time.Time) (output, price [NumPeriods]float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	for p := range NumPeriods {
		output[p], price[p] = a.periods[p].estimated.USD(), a.periods[p].estimatedPrice.USD()
	}
	return output, price
}

// warning is a budget whose warning share was crossed.
type warning struct {
	period     Period
	spent, cap float64
}

// crossed marks and returns the budgets whose warning share, or whose
// whole, the spend has reached since the last time in this period. It runs
// under a.mu.
func (a *Account) crossed() []warning {
	var w []warning
	for p := range NumPeriods {
		ps, limit := &a.periods[p], a.caps[p]
		if limit <= 0 {
			continue
		}
		warn, spent := !ps.warned && ps.usd >= ToNano(a.warn*limit.USD()), !ps.spent && ps.usd >= limit
		if warn || spent {
			ps.warned, ps.spent = ps.warned || warn, ps.spent || spent
			w = append(w, warning{period: p, spent: ps.usd.USD(), cap: limit.USD()})
		}
	}
	return w
}

// warnOf logs the budgets that crossed their warning share.
func (a *Account) warnOf(crossed []warning) {
	logger := a.logger.Load()
	if logger == nil || a.scope == OfSession { // a session is told; it has no name to log
		return
	}
	for _, w := range crossed {
		msg, field := "key budget nearly spent", "key"
		switch a.scope {
		case OfGroup:
			msg, field = "group budget nearly spent", "group"
		case OfChannel:
			msg, field = "channel spend_cap nearly spent", "channel"
		}
		switch {
		case w.spent >= w.cap && !w.period.Renews():
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

// Spent returns what the account spent in each period as of now (its
// relay's clock when zero), and its budgets.
func (a *Account) Spent(now time.Time) (usd, caps [NumPeriods]float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if now.IsZero() {
		now = a.clock()
	}
	a.roll(now)
	for p := range NumPeriods {
		usd[p], caps[p] = a.periods[p].usd.USD(), a.caps[p].USD()
	}
	return usd, caps
}

// clock is the time on the account's relay's clock. It runs under a.mu.
func (a *Account) clock() time.Time {
	if a.now == nil {
		return time.Now()
	}
	return a.now()
}

// NanoUSD is an amount in billionths of a US dollar: spend is summed in
// integers, so that adding many small costs is exact and a budget is
// reached when it is, not a rounding error later.
type NanoUSD int64

// ToNano is usd in nanoUSD, rounded to the nearest.
func ToNano(usd float64) NanoUSD { return NanoUSD(math.Round(usd * 1e9)) }

// USD is n in US dollars.
func (n NanoUSD) USD() float64 { return float64(n) / 1e9 }
