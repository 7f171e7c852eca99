package relay

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Spend. Every key has a spend account: what it spent in the current day,
// week and month, and in total, and its budgets. Accounts are kept by the
// key's name for the whole process, so a reload carries them over, and
// they survive a restart: without storage, in Caddy's storage (the file
// system unless the config names another), written at most
// spendCheckpointEvery apart and when Caddy stops; in a fleet, in Redis,
// where every relay adds what it charged (fleet_spend.go).

// spendAccounts holds each key's account by name, process-wide.
var spendAccounts = caddy.NewUsagePool()

// spendAccount is one key's spend and budgets.
type spendAccount struct {
	id    string     // what it is kept by: the key's name, group:<name>, channel:<name>
	label string     // what metrics and logs call it: the key's, group's or channel's name
	scope spendScope // whose spend it is

	mu      sync.Mutex
	periods [numPeriods]periodSpend
	caps    [numPeriods]nanoUSD // budgets; 0: none
	warn    float64             // share of a budget that warns
	now     func() time.Time    // the clock of its relay

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
	freed     atomic.Uint64 // counts the holds that ended, for a request about to wait for one

	budgeted atomic.Bool           // it has a budget: requests are checked against it
	fleet    atomic.Pointer[fleet] // where the fleet's totals are, when shared
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
}

// apply configures account a with the spec, shared by fleet f (nil: none).
func (b budgetSpec) apply(a *spendAccount, f *fleet) {
	a.mu.Lock()
	a.scope = b.scope
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
	if day := a.periods[periodDay].start; !now.Before(day) && now.Before(periodDay.end(day)) && !a.periods[periodTotal].start.IsZero() {
		return
	}
	for p := range numPeriods {
		if s := p.start(now); !a.periods[p].start.Equal(s) {
			a.periods[p] = periodSpend{start: s}
		}
	}
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
		wait := p.end(ps.start).Sub(now)
		if ps.usd >= limit {
			return errBudgetExceeded(a.who(), p, limit.usd(), ps.usd.usd(), wait, 0)
		}
		if estimate > 0 && ps.usd+toNano(estimate) > limit {
			return errBudgetExceeded(a.who(), p, limit.usd(), ps.usd.usd(), wait, estimate)
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
func (a *spendAccount) counts(p budgetPeriod) bool { return p != periodTotal || a.caps[p] > 0 }

// chargedEstimate records that usd of what was charged at now is the cost
// of an estimated output (settle.go).
func (a *spendAccount) chargedEstimate(now time.Time, usd float64) {
	if usd <= 0 {
		return
	}
	n := toNano(usd)
	a.mu.Lock()
	a.roll(now)
	for p := range numPeriods {
		if a.counts(p) {
			a.periods[p].estimated += n
		}
	}
	a.mu.Unlock()
	spend.dirty.Store(true)
}

// estimates returns the part of each period's spend, as of now, that
// estimated outputs cost.
func (a *spendAccount) estimates(now time.Time) (usd [numPeriods]float64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.roll(now)
	for p := range numPeriods {
		usd[p] = a.periods[p].estimated.usd()
	}
	return usd
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
	if logger == nil {
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

func toNano(usd float64) nanoUSD { return nanoUSD(math.Round(usd * 1e9)) }

func (n nanoUSD) usd() float64 { return float64(n) / 1e9 }

// spendCheckpointEvery is the longest time spend goes unwritten: what a
// crash can lose, at most.
const spendCheckpointEvery = 10 * time.Second

// spendStorageKey is where the spend is kept in Caddy's storage.
const spendStorageKey = "relay/spend.json"

// spendRecord is an account as stored: each period's start and spend, by
// the period's name, and each batch's hold, by batchHoldPrefix and the
// batch (start: when the batch was made).
type spendRecord map[string]storedPeriod

// batchHoldPrefix starts the name of a batch's hold in a spendRecord.
const batchHoldPrefix = "batch:"

type storedPeriod struct {
	Start   time.Time `json:"start"`
	NanoUSD nanoUSD   `json:"nano_usd"` // billionths of a dollar
	// EstimatedNanoUSD is the part of NanoUSD that estimated outputs cost.
	EstimatedNanoUSD nanoUSD `json:"estimated_nano_usd,omitempty"`
}

// spendStore writes the accounts to Caddy's storage, and holds the stored
// spend of keys that are not loaded now. One per process.
type spendStore struct {
	mu      sync.Mutex
	storage certmagic.Storage
	logger  *zap.Logger
	loaded  bool
	saved   map[string]spendRecord // by account id
	dirty   atomic.Bool
	soon    chan struct{} // asks for a checkpoint now
	stop    context.CancelFunc
	done    chan struct{}
	running int // configs using it
}

var spend = &spendStore{saved: map[string]spendRecord{}, soon: make(chan struct{}, 1)}

// saveSoon asks for a checkpoint now rather than within
// spendCheckpointEvery: for what must outlive a crash (a batch's hold).
func (s *spendStore) saveSoon() {
	s.dirty.Store(true)
	select {
	case s.soon <- struct{}{}:
	default:
	}
}

// use starts using the store from a config: the first one loads what was
// stored and starts the checkpoints. Each config gives it back with
// release.
func (s *spendStore) use(ctx caddy.Context, logger *zap.Logger) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.storage, s.logger = configStorage(ctx), logger
	if !s.loaded && s.storage != nil {
		s.loaded = true
		s.load()
	}
	s.running++
	if s.running == 1 {
		work, stop := context.WithCancel(context.Background())
		s.stop, s.done = stop, make(chan struct{})
		go s.checkpoints(work, s.done)
	}
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

// release gives the store back; the last config to go writes it.
func (s *spendStore) release() {
	s.mu.Lock()
	s.running--
	last := s.running == 0
	stop, done := s.stop, s.done
	s.mu.Unlock()
	if last {
		stop()
		<-done
		s.save()
	}
}

// load reads the stored spend. It runs under s.mu.
func (s *spendStore) load() {
	b, err := s.storage.Load(context.Background(), spendStorageKey)
	if errors.Is(err, fs.ErrNotExist) {
		return
	}
	if err == nil {
		err = json.Unmarshal(b, &s.saved)
	}
	if err != nil {
		s.logger.Error("could not read the keys' spend; it starts from zero", zap.String("storage_key", spendStorageKey), zap.Error(err))
		s.saved = map[string]spendRecord{}
	}
}

// account returns the account of id, from the pool, with what was stored
// for it. The caller gives it back with spendAccounts.Delete(id).
func (s *spendStore) account(id string) (*spendAccount, error) {
	v, _, err := spendAccounts.LoadOrNew(id, func() (caddy.Destructor, error) { return s.stored(id), nil })
	if err != nil {
		return nil, err
	}
	return v.(*spendAccount), nil
}

// stored is a new account of id with what was stored for it, outside the
// pool.
func (s *spendStore) stored(id string) *spendAccount {
	a := &spendAccount{id: id}
	s.mu.Lock()
	rec := s.saved[id]
	s.mu.Unlock()
	for p := range numPeriods {
		if r, ok := rec[p.String()]; ok {
			a.periods[p] = periodSpend{start: r.Start, usd: r.NanoUSD, estimated: r.EstimatedNanoUSD}
		}
	}
	for name, r := range rec {
		if batch, ok := strings.CutPrefix(name, batchHoldPrefix); ok && r.NanoUSD > 0 {
			if a.batches == nil {
				a.batches = map[string]batchHold{}
			}
			a.batches[batch] = batchHold{usd: r.NanoUSD, made: r.Start}
			a.batchHeld += r.NanoUSD
		}
	}
	return a
}

// keep records an account that is being let go, so that it is written and
// found again if its key comes back; one that spent nothing needs no
// record (and identities that come and go leave none).
func (s *spendStore) keep(a *spendAccount) {
	rec := a.record()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range rec {
		if p.NanoUSD != 0 {
			s.saved[a.id] = rec
			return
		}
	}
	delete(s.saved, a.id)
}

// record is the account as stored.
func (a *spendAccount) record() spendRecord {
	a.mu.Lock()
	defer a.mu.Unlock()
	rec := spendRecord{}
	for p := range numPeriods {
		if ps := a.periods[p]; !ps.start.IsZero() {
			rec[p.String()] = storedPeriod{ps.start, ps.usd, ps.estimated}
		}
	}
	for batch, h := range a.batches {
		rec[batchHoldPrefix+batch] = storedPeriod{Start: h.made, NanoUSD: h.usd}
	}
	return rec
}

// checkpoints writes the spend every spendCheckpointEvery while it
// changes, and when asked, until ctx ends; batches' holds that lasted
// their time are dropped on the way.
func (s *spendStore) checkpoints(ctx context.Context, done chan struct{}) {
	defer close(done)
	every(ctx, spendCheckpointEvery, s.soon, func() {
		expireBatches(time.Now())
		if s.dirty.Load() {
			s.save()
		}
	})
}

// save writes every account, loaded or kept, dropping the records whose
// periods have all ended (a record with a total is kept: the total never
// ends).
func (s *spendStore) save() {
	s.dirty.Store(false)
	now := time.Now()
	s.mu.Lock()
	out := make(map[string]spendRecord, len(s.saved))
	for id, rec := range s.saved {
		out[id] = rec
	}
	storage, logger := s.storage, s.logger
	s.mu.Unlock()
	spendAccounts.Range(func(k, v any) bool {
		if a := v.(*spendAccount); a.fleet.Load() == nil { // a fleet's spend is in Redis
			out[k.(string)] = a.record()
		}
		return true
	})
	for id, rec := range out {
		current := false
		for p := range numPeriods {
			if r, ok := rec[p.String()]; ok && p.end(r.Start).After(now) {
				current = true
			}
		}
		for name, r := range rec {
			if strings.HasPrefix(name, batchHoldPrefix) && r.Start.Add(batchHoldFor).After(now) {
				current = true
			}
		}
		if !current {
			delete(out, id)
		}
	}
	if storage == nil {
		return
	}
	b, err := json.Marshal(out)
	if err == nil {
		err = storage.Store(context.Background(), spendStorageKey, b)
	}
	if err != nil {
		s.dirty.Store(true) // try again at the next checkpoint
		logger.Error("could not write the keys' spend", zap.String("storage_key", spendStorageKey), zap.Error(err))
	}
}

// spendCollector exports the accounts at each scrape: every key's and
// group's spend in the current month, a capped channel's in each period
// it caps, and for an account with budgets (or caps), its spend, budget
// and warning threshold in each budgeted period. The scope label says
// whose: key (keys and named user entries, by key), group (by group) or
// channel (by channel); the labels of the other scopes are empty.
type spendCollector struct {
	spend, budget, warn *prometheus.Desc
}

var spendLabels = []string{"scope", "key", "group", "channel", "period"}

var metricSpend = spendCollector{
	spend: prometheus.NewDesc("relay_spend_usd",
		"What a key, a group or a capped channel spent in the current calendar period (UTC), or in total, in USD: month for every key and group, and each period it has a budget (a channel: a spend_cap) for.", spendLabels, nil),
	budget: prometheus.NewDesc("relay_budget_usd",
		"A key's or a group's budget, or a channel's spend_cap, for a period, in USD.", spendLabels, nil),
	warn: prometheus.NewDesc("relay_budget_warn_usd",
		"The spend at which a budget warns (budget times budget_warn), in USD.", spendLabels, nil),
}

// Describe implements prometheus.Collector.
func (c spendCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.spend
	ch <- c.budget
	ch <- c.warn
}

// Collect implements prometheus.Collector.
func (c spendCollector) Collect(ch chan<- prometheus.Metric) {
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*spendAccount)
		if a.perIdentity.Load() {
			return true
		}
		usd, caps := a.spent(time.Time{})
		a.mu.Lock()
		label, warn, scope := a.label, a.warn, a.scope
		a.mu.Unlock()
		names := [3]string{}
		names[scope] = label
		for p := range numPeriods {
			labels := []string{scope.String(), names[spendOfKey], names[spendOfGroup], names[spendOfChannel], p.String()}
			if caps[p] > 0 {
				ch <- prometheus.MustNewConstMetric(c.budget, prometheus.GaugeValue, caps[p], labels...)
				ch <- prometheus.MustNewConstMetric(c.warn, prometheus.GaugeValue, caps[p]*warn, labels...)
			}
			if caps[p] > 0 || p == periodMonth && scope != spendOfChannel {
				ch <- prometheus.MustNewConstMetric(c.spend, prometheus.GaugeValue, usd[p], labels...)
			}
		}
		return true
	})
}
