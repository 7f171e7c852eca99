package money

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// Resetting spend. An operator forgives what a key or a user entry spent
// in its current periods, or in one of them, with POST
// /relay/keys/<name>/spend/reset on the admin API: a total
// budget never renews otherwise. What it spent goes to zero in its account
// (the part estimated outputs cost with it), in the spend store (which a
// key that has not taken its state yet, or one that comes back, reads),
// and in a fleet in Redis, where the current periods' totals are deleted,
// so that every relay reads zero at its next sync. Holds stay as they
// are: the requests in flight and the batches that hold are charged what
// they cost when they settle.
//
// In a fleet the reset runs under the relay's sync lock (fleet.spendMu), so
// that no sync of this relay is between reading what it charged here and
// adding it to Redis: what it charged and had not yet added is forgiven
// with the rest. What other relays charged and had not yet added (about
// spendSyncEvery of their spend) is added after the reset, and counts.

// Reset forgives what account id spent in periods, the ones current at
// now: in the fleet f (nil: none), under its sync lock, then in the spend
// store, then in the account when a config holds it (returned; nil:
// none). In a fleet, an error says Redis did not answer, and nothing was
// reset.
func Reset(f *Shared, id string, periods []Period, now time.Time) (*Account, error) {
	if f != nil {
		f.spendMu.Lock()
		defer f.spendMu.Unlock()
		if err := f.resetSpend(id, periods, now); err != nil {
			return nil, err
		}
	}
	spend.reset(id, periods, now)
	// looked up after the store: an account taken meanwhile read the reset
	// record
	a := loadedAccount(id)
	if a != nil {
		a.reset(now, periods)
	}
	spend.saveSoon()
	return a, nil
}

// ResetPeriods reads the period query parameter of a reset: the periods it
// names, every period when there is none.
func ResetPeriods(values []string) ([]Period, error) {
	switch len(values) {
	case 0:
		all := make([]Period, NumPeriods)
		for p := range NumPeriods {
			all[p] = p
		}
		return all, nil
	case 1:
		if p, ok := PeriodByName(values[0]); ok {
			return []Period{p}, nil
		}
	}
	return nil, fmt.Errorf("period %q: give one of day, week, month or total, or none to reset them all", strings.Join(values, ","))
}

// loadedAccount is the account of id that a config holds, or nil.
func loadedAccount(id string) *Account {
	var found *Account
	spendAccounts.Range(func(k, v any) bool {
		if k == id {
			found = v.(*Account)
			return false
		}
		return true
	})
	return found
}

// reset sets the account's spend in periods, the ones current at now, to
// zero: what it spent, what this relay charged and has not added to the
// fleet's, and the part estimated outputs cost. Its warnings may be
// logged again.
func (a *Account) reset(now time.Time, periods []Period) {
	a.mu.Lock()
	a.roll(now)
	for _, p := range periods {
		a.periods[p] = periodSpend{start: a.periods[p].start}
	}
	a.mu.Unlock()
	a.freed.Add(1)
}

// reset drops what is stored of the spend of account id in periods, the
// ones current at now. The record is replaced, not changed: save writes
// the records it copied outside s.mu.
func (s *spendStore) reset(id string, periods []Period, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old, ok := s.saved[id]
	if !ok {
		return
	}
	rec := make(spendRecord, len(old))
	for name, r := range old {
		rec[name] = r
	}
	for _, p := range periods {
		if r, ok := rec[p.String()]; ok && r.Start.Equal(p.Start(now)) {
			delete(rec, p.String())
		}
	}
	s.saved[id] = rec
}

// resetSpend deletes the fleet's totals of account id in periods, the ones
// current at now: a relay reads a missing total as zero, and its next
// addition starts it again. It runs under f.spendMu.
func (f *Shared) resetSpend(id string, periods []Period, now time.Time) error {
	keys := make([]string, len(periods))
	for i, p := range periods {
		keys[i] = f.spendKey(id, p, p.Start(now))
	}
	return f.Do("spend", func(ctx context.Context) error {
		return f.Redis.Del(ctx, keys...).Err()
	})
}
