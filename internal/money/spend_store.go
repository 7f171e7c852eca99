package money

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/loop"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

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

// storedPeriod is one period of a spendRecord, or a batch's hold.
type storedPeriod struct {
	Start   time.Time `json:"start"`
	NanoUSD NanoUSD   `json:"nano_usd"` // billionths of a dollar
	// EstimatedNanoUSD is the part of NanoUSD that estimated outputs cost.
	EstimatedNanoUSD NanoUSD `json:"estimated_nano_usd,omitempty"`
	// EstimatedPriceNanoUSD is the part of NanoUSD charged at the estimate
	// of a model the price table does not know.
	EstimatedPriceNanoUSD NanoUSD `json:"estimated_price_nano_usd,omitempty"`
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

// spend is the process's spend store.
var spend = &spendStore{saved: map[string]spendRecord{}, soon: make(chan struct{}, 1)}

// UseStore starts using the spend store from a config whose storage is
// storage (nil: none, the spend is kept in memory only): the first config
// loads what was stored and starts the checkpoints. Each config gives it
// back with ReleaseStore; the last one writes it.
func UseStore(storage certmagic.Storage, logger *zap.Logger) { spend.use(storage, logger) }

// ReleaseStore gives the spend store back (UseStore).
func ReleaseStore() { spend.release() }

// Open returns the account of id, from the process-wide pool, with what
// was stored for it; the caller gives it back with Drop(id).
func Open(id string) (*Account, error) { return spend.account(id) }

// Stored is a new account of id with what was stored for it, outside the
// pool: what a key that has not taken its state yet spent.
func Stored(id string) *Account { return spend.stored(id) }

// Refs is the number of configs that hold the pool's account of id
// (Open); 0: it is not in the pool.
func Refs(id string) int {
	n, _ := spendAccounts.References(id)
	return n
}

// StoreUsers is the number of configs that use the spend store now
// (UseStore).
func StoreUsers() int {
	spend.mu.Lock()
	defer spend.mu.Unlock()
	return spend.running
}

// Drop gives back the pool's account of id (Open).
func Drop(id string) { _, _ = spendAccounts.Delete(id) }

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
func (s *spendStore) use(storage certmagic.Storage, logger *zap.Logger) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.storage, s.logger = storage, logger
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
func (s *spendStore) account(id string) (*Account, error) {
	v, _, err := spendAccounts.LoadOrNew(id, func() (caddy.Destructor, error) { return s.stored(id), nil })
	if err != nil {
		return nil, err
	}
	return v.(*Account), nil
}

// stored is a new account of id with what was stored for it, outside the
// pool.
func (s *spendStore) stored(id string) *Account {
	a := &Account{id: id}
	s.mu.Lock()
	rec := s.saved[id]
	s.mu.Unlock()
	for p := range NumPeriods {
		if r, ok := rec[p.String()]; ok {
			a.periods[p] = periodSpend{start: r.Start, usd: r.NanoUSD, estimated: r.EstimatedNanoUSD, estimatedPrice: r.EstimatedPriceNanoUSD}
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
func (s *spendStore) keep(a *Account) {
	if a.Session() {
		return
	}
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
func (a *Account) record() spendRecord {
	a.mu.Lock()
	defer a.mu.Unlock()
	rec := spendRecord{}
	for p := range NumPeriods {
		if ps := a.periods[p]; !ps.start.IsZero() {
			rec[p.String()] = storedPeriod{ps.start, ps.usd, ps.estimated, ps.estimatedPrice}
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
	loop.Every(ctx, spendCheckpointEvery, s.soon, func() {
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
		if a := v.(*Account); a.fleet.Load() == nil && !a.Session() { // a fleet's spend is in Redis; a session's is not kept
			out[k.(string)] = a.record()
		}
		return true
	})
	for id, rec := range out {
		current := false
		for p := range NumPeriods {
			if r, ok := rec[p.String()]; ok && p.End(r.Start).After(now) {
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
