package money

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Batches' holds. A Message Batch is priced when its results are read, up
// to a day after it was made, and meanwhile its requests run where no
// budget sees them. So a batch holds, when it is made, the sum of its
// requests' worst cases at the batch price against the budgets of the key
// (and the group) that makes it; a batch that does not fit in what is left
// of a budget, beside what is held, is refused (429 budget_exceeded)
// before anything is sent upstream. It does not wait for holds in flight
// to settle, as a message may: it would wait for requests that run for
// seconds to make room for one that may run for hours. (A create does wait
// in the queue for a busy channel, as a message does.) When its results
// are first read (and accounted, claimBatch), its hold becomes what they
// cost, charged to the accounts that held it.
//
// A batch's hold outlives the relay: on a single relay it is kept with the
// spend of its key in Caddy's storage (written within moments); in a fleet
// in Redis, with the account's other holds, and a record by batch
// (<prefix>batch_hold:<digest>) says whose it is, for the relay that reads
// the results. It lasts batchHoldFor, then expires uncharged: results not
// read through the relay by then cannot be read at all.

// batchHoldFor is how long a batch's hold lasts unless its results settle
// it: Anthropic keeps a batch's results for 29 days after it was made, and
// a day more covers the clocks.
const batchHoldFor = 30 * 24 * time.Hour

// batchHold is what one batch holds against an account.
type batchHold struct {
	usd  NanoUSD
	made time.Time
}

// BatchHoldID names a batch's hold: by its channel and the upstream's
// id, as its accounting mark is.
func BatchHoldID(channel, up string) string { return fleet.Digest(channel + "\x00" + up) }

// BatchHolds is a batch's holds taken at its create, one per budgeted
// account (its principal's, its group's) and one per spend cap of the
// channels that may make it, until the batch is made (keep) or not
// (abandon).
type BatchHolds struct {
	now    func() time.Time // the relay's clock
	logger *zap.Logger      // the relay's log, for what the fleet failed
	parts  []batchHoldPart
	usd    NanoUSD
	done   bool
}

// NewBatchHolds are the holds of usd of a batch about to be made, on the
// relay of clock now and log logger: none taken yet (Take).
func NewBatchHolds(usd NanoUSD, now func() time.Time, logger *zap.Logger) *BatchHolds {
	return &BatchHolds{now: now, logger: logger, usd: usd}
}

// Held reports whether the batch holds anything.
func (b *BatchHolds) Held() bool { return len(b.parts) > 0 }

// LocalBatchHolds are the holds of batch id that this relay's accounts
// keep (without a fleet), for the request that accounts its results to
// settle (Settle): the results' cost is then charged to each as its hold
// is given back. nil when none holds it any more: its accounts are gone,
// and the stored spend forgets it.
func LocalBatchHolds(id string) *Holds {
	hs := &Holds{Taken: true}
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*Account)
		a.mu.Lock()
		h, ok := a.batches[id]
		a.mu.Unlock()
		if ok && a.fleet.Load() == nil {
			hs.Add(a, h.usd)
			hs.list[hs.n-1].batch = id
		}
		return true
	})
	if hs.n == 0 {
		spend.forgetBatch(id)
		return nil
	}
	return hs
}

// BatchHolds is LocalBatchHolds in the fleet: the batch's record says
// whose holds it has (and goes, so that one relay alone settles them); a
// hold whose account is not configured here is given back. nil when none
// is left, or Redis did not answer.
func (f *Shared) BatchHolds(id string) *Holds {
	var rec string
	err := f.Do("batch_hold", func(ctx context.Context) error {
		var err error
		rec, err = f.Redis.GetDel(ctx, f.batchHoldKey(id)).Result()
		return err
	})
	if err != nil {
		return nil
	}
	hs := &Holds{Taken: true}
	lines := strings.Split(rec, "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		accountID, member := lines[i], lines[i+1]
		n, _ := strconv.ParseInt(member[strings.LastIndexByte(member, '=')+1:], 10, 64)
		var found *Account
		spendAccounts.Range(func(k, v any) bool {
			if a := v.(*Account); k == accountID && a.fleet.Load() == f {
				found = a
				return false
			}
			return true
		})
		if found == nil {
			set, total := f.holdKeys(accountID)
			f.limits.ReleaseHold(set, total, member)
			continue
		}
		hs.Add(found, NanoUSD(n))
		hs.list[hs.n-1].lease, hs.list[hs.n-1].batch = member, id
	}
	if hs.n == 0 {
		return nil
	}
	return hs
}

// batchHoldPart is a batch's hold of one account.
type batchHoldPart struct {
	a     *Account
	lease string // in a fleet: its member while the create runs
	// channel, for the hold of a channel's spend cap, is the channel's
	// name: only the channel that makes the batch keeps it
	channel string
}

// Take takes the batch's holds of accts, all or none: in the fleet's
// storage when the accounts are shared (on this relay alone while it is
// unreachable and the fleet allows it), else on this relay. channel names
// the channel whose cap accts[0] is; "" for budgets. err: the storage is
// unreachable and the fleet denies.
func (b *BatchHolds) Take(accts []*Account, now time.Time, channel string) (HoldAnswer, error) {
	f := accts[0].fleet.Load()
	if f == nil {
		return b.reserve(accts, now, channel), nil
	}
	calls := make([]*limits.Hold, len(accts))
	for i, a := range accts {
		calls[i] = f.prepareHold(a, now, b.usd, holdMember(f.LeaseID(), b.usd), f.Lease)
	}
	notHeld, err := f.limits.AdmitHolds(now, calls)
	switch {
	case err != nil && f.Deny:
		return HoldAnswer{}, err
	case err != nil: // Redis is down: held on this relay alone meanwhile
		return b.reserve(accts, now, channel), nil
	case notHeld >= 0:
		return heldAnswer(notHeld, calls[notHeld]), nil
	}
	for i, a := range accts {
		a.holdsHere(b.usd, "")
		f.limits.HoldLease(calls[i].Keys[0], calls[i].Member)
		b.parts = append(b.parts, batchHoldPart{a: a, lease: calls[i].Member, channel: channel})
	}
	return HoldAnswer{}, nil
}

// reserve takes the batch's holds of accts on this relay, all or none.
func (b *BatchHolds) reserve(accts []*Account, now time.Time, channel string) HoldAnswer {
	from := len(b.parts)
	for i, a := range accts {
		if ans := a.reserve(now, b.usd); ans.Verdict != HoldTaken {
			for _, p := range b.parts[from:] {
				p.a.unreserve(b.usd)
			}
			b.parts = b.parts[:from]
			ans.Index = i
			return ans
		}
		b.parts = append(b.parts, batchHoldPart{a: a, channel: channel})
	}
	return HoldAnswer{}
}

// Abandon gives the holds back unused, unless the batch was made.
func (b *BatchHolds) Abandon() {
	if b == nil || b.done {
		return
	}
	b.done = true
	for _, p := range b.parts {
		p.giveBack(b.usd)
	}
}

// giveBack gives the part's hold of usd back unused.
func (p batchHoldPart) giveBack(usd NanoUSD) {
	p.a.unreserve(usd)
	if p.lease != "" {
		if f := p.a.fleet.Load(); f != nil {
			f.releaseHold(p.a, p.lease)
		}
	}
}

// Keep makes the holds the batch's, now that channel made it as up: they
// last until the batch's results settle them, or batchHoldFor. The holds
// of the other candidates' caps are given back.
func (b *BatchHolds) Keep(channel, up string) {
	if b == nil || b.done {
		return
	}
	b.done = true
	id, now := BatchHoldID(channel, up), b.now()
	kept := b.parts[:0]
	for _, p := range b.parts {
		if p.channel != "" && p.channel != channel {
			p.giveBack(b.usd)
			continue
		}
		kept = append(kept, p)
	}
	b.parts = kept
	if len(b.parts) == 0 {
		return
	}
	f := b.parts[0].a.fleet.Load()
	if f == nil {
		for _, p := range b.parts {
			a := p.a
			a.mu.Lock()
			a.held -= b.usd
			a.holding--
			if a.batches == nil {
				a.batches = map[string]batchHold{}
			}
			a.batches[id] = batchHold{usd: b.usd, made: now}
			a.batchHeld += b.usd
			a.mu.Unlock()
		}
		spend.saveSoon()
		return
	}
	for _, p := range b.parts {
		p.a.unreserve(b.usd) // what this relay holds in flight: from now on, only Redis holds it
	}
	if b.parts[0].lease == "" {
		b.logger.Warn("a batch was made while the fleet's storage was unreachable: it holds nothing against its budgets",
			zap.String("key", b.parts[0].a.label), zap.String("channel", channel))
		return
	}
	member := holdMember("b:"+id, b.usd)
	var rec strings.Builder // whose holds they are: account id and member, a line each
	err := f.Do("batch_hold", func(ctx context.Context) error {
		_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, p := range b.parts {
				set, total := f.holdKeys(p.a.id)
				keepBatchScript.Eval(ctx, pipe, []string{set, total}, p.lease, member, batchHoldFor.Milliseconds(), holdKeysTTL.Milliseconds())
				rec.WriteString(p.a.id + "\n" + member + "\n")
			}
			pipe.Set(ctx, f.batchHoldKey(id), strings.TrimSuffix(rec.String(), "\n"), batchHoldFor)
			return nil
		})
		return err
	})
	for _, p := range b.parts {
		set, _ := f.holdKeys(p.a.id)
		f.limits.DropHoldLease(set, p.lease) // given back with the batch's hold, or left to expire
	}
	if err != nil {
		b.logger.Warn("could not record a batch's hold in the fleet's storage: it holds nothing against its budgets",
			zap.String("key", b.parts[0].a.label), zap.String("channel", channel), zap.Error(err))
	}
}

// keepBatchScript turns a create's hold into its batch's. KEYS: the
// account's holds, its held total. ARGV: the create's member, the batch's
// member (the same amount), the batch's hold in ms, the keys' ttl in ms.
var keepBatchScript = redis.NewScript(fleet.HoldsLua + `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  redis.call('INCRBY', KEYS[2], amountOf(ARGV[2])) -- the create's expired meanwhile
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
keep(KEYS[1], tonumber(ARGV[4]))
keep(KEYS[2], tonumber(ARGV[4]))
return 0
`)

// batchHoldKey is where a fleet records whose a batch's hold is.
func (f *Shared) batchHoldKey(id string) string { return f.Prefix + "batch_hold:" + id }

// forgetBatch drops the hold of batch id from the stored spend of a key
// that is not loaded.
func (s *spendStore) forgetBatch(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for acct, rec := range s.saved {
		if _, ok := rec[batchHoldPrefix+id]; ok {
			// a copy without it: save may be writing the record as it is,
			// outside the lock
			kept := make(spendRecord, len(rec))
			for name, p := range rec {
				if name != batchHoldPrefix+id {
					kept[name] = p
				}
			}
			s.saved[acct] = kept
			s.dirty.Store(true)
		}
	}
}

// expireBatches drops the batches' holds that outlived batchHoldFor, at
// now, from the accounts of this relay.
func expireBatches(now time.Time) {
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*Account)
		a.mu.Lock()
		for id, h := range a.batches {
			if !now.Before(h.made.Add(batchHoldFor)) {
				delete(a.batches, id)
				a.batchHeld -= h.usd
				a.freed.Add(1)
				spend.dirty.Store(true)
			}
		}
		a.mu.Unlock()
		return true
	})
}
