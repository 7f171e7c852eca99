package money

import (
	"context"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/loop"
	"github.com/redis/go-redis/v9"
)

// Spend shared by a fleet. Each relay charges its own requests to its
// accounts at once, as a single relay does, and every spendSyncEvery adds
// what it charged to the fleet's totals in Redis (INCRBY of billionths of a
// dollar, one key per
// account and period) and reads the totals back, in one pipelined round
// trip for all its accounts. Budgets are then enforced on the fleet's
// totals as of the last sync plus what this relay charged since: a fleet
// may overspend a budget by what it spends in about spendSyncEvery, on top
// of the requests in flight. Nothing of this is on a request's path, and a
// sync touches only what changed here or has a budget: the totals of a key
// without budgets come back when this relay adds to them.

// spendSyncEvery is how often a relay adds its spend to the fleet's.
const spendSyncEvery = time.Second

// spendKeyTTL is how long a period's total stays in Redis after the period
// ended, for reports. The total period ends in year 9999: its key stays.
const spendKeyTTL = 35 * 24 * time.Hour

// Share makes the account's spend the fleet's (nil: this relay's own).
// Holds the fleet it leaves was to give back with their cost are left to
// expire there with their lease.
func (a *Account) Share(f *Shared) {
	if a.fleet.Swap(f) != f {
		a.mu.Lock()
		a.releases, a.fleetHeld = nil, 0
		a.mu.Unlock()
		if f != nil {
			f.spendSoon()
		}
	}
}

// spendKey is the Redis key of an account's total for the period that
// began at start.
func (f *Shared) spendKey(id string, p Period, start time.Time) string {
	if start.Hour() != 0 || start.Minute() != 0 || start.Second() != 0 { // a session's window
		return f.Key(fleet.Tag("s:", id), p.String()+":"+start.UTC().Format("20060102T150405"))
	}
	return f.Key(fleet.Tag("s:", id), p.String()+":"+start.Format("20060102"))
}

// spendSoon asks for a sync of the spend now rather than at the next tick.
func (f *Shared) spendSoon() {
	select {
	case f.spendNow <- struct{}{}:
	default:
	}
}

// syncSpend adds this relay's spend to the fleet's and reads the totals,
// every spendSyncEvery and when asked, until ctx ends.
func (f *Shared) syncSpend(ctx context.Context) {
	loop.Every(ctx, spendSyncEvery, f.spendNow, f.flushSpend)
}

// spendSync is one account period's part of a sync.
type spendSync struct {
	a       *Account
	p       Period
	start   time.Time
	pending NanoUSD
	end     time.Time     // of the period
	cmd     *redis.IntCmd // the total, after adding pending
	get     *redis.StringCmd
	total   int64 // from the account's settleScript
}

// heldSync is the part of a sync of an account that has budgets or holds:
// its periods go to Redis in one settleScript, with the holds its settled
// requests give back.
type heldSync struct {
	a        *Account
	periods  []*spendSync
	releases []heldRelease
	cmd      *redis.Cmd
}

// flushSpend runs one sync of every account this fleet shares. An account
// with budgets or holds syncs in one script that adds what was charged
// here, gives back the holds of the requests that charged it, and reads
// the totals and what the fleet holds (settleScript); the others add what
// was charged, a command a period.
func (f *Shared) flushSpend() {
	f.spendMu.Lock() // one sync at a time: each adds what the one before did not
	defer f.spendMu.Unlock()
	var work []*spendSync
	var held []*heldSync
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*Account)
		if a.fleet.Load() != f {
			return true
		}
		a.mu.Lock()
		a.roll(a.clock())
		var h *heldSync
		if a.budgeted.Load() || len(a.releases) > 0 {
			h = &heldSync{a: a, releases: append([]heldRelease(nil), a.releases...)}
			held = append(held, h)
		}
		for p := range NumPeriods {
			// what was charged here goes to Redis; totals are read for the
			// budgets (and come back with every addition)
			if ps := a.periods[p]; ps.pending != 0 || a.caps[p] > 0 {
				w := &spendSync{a: a, p: p, start: ps.start, pending: ps.pending, end: a.periodEnd(p, ps.start)}
				if h != nil {
					h.periods = append(h.periods, w)
				} else {
					work = append(work, w)
				}
			}
		}
		a.mu.Unlock()
		return true
	})
	if len(work) == 0 && len(held) == 0 {
		return
	}
	err := f.Background("spend", func(ctx context.Context) error {
		_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, w := range work {
				k := f.spendKey(w.a.id, w.p, w.start)
				if w.pending != 0 {
					w.cmd = pipe.IncrBy(ctx, k, int64(w.pending))
					pipe.PExpireAt(ctx, k, w.end.Add(w.a.keepFor()))
				} else {
					w.get = pipe.Get(ctx, k)
				}
			}
			for _, h := range held {
				set, total := f.holdKeys(h.a.id)
				keys := []string{set, total}
				args := []any{len(h.periods)}
				for _, w := range h.periods {
					keys = append(keys, f.spendKey(w.a.id, w.p, w.start))
					args = append(args, int64(w.pending), w.end.Add(w.a.keepFor()).UnixMilli())
				}
				for _, r := range h.releases {
					args = append(args, r.lease)
				}
				h.cmd = settleScript.Eval(ctx, pipe, keys, args...)
			}
			return nil
		})
		return err
	})
	if err != nil {
		return // the pending spend, and the holds it settles, wait for the next sync
	}
	for _, h := range held {
		res, err := h.cmd.Int64Slice()
		if err != nil || len(res) != len(h.periods)+1 {
			continue
		}
		for i, w := range h.periods {
			w.total = res[i]
			work = append(work, w)
		}
		set, _ := f.holdKeys(h.a.id)
		for _, r := range h.releases {
			f.limits.DropHoldLease(set, r.lease)
		}
		h.a.mu.Lock()
		h.a.releases = h.a.releases[len(h.releases):]
		h.a.fleetHeld = NanoUSD(res[len(h.periods)])
		h.a.mu.Unlock()
		if len(h.releases) > 0 {
			h.a.freed.Add(1)
		}
		woken := map[Queue]bool{}
		for _, r := range h.releases {
			if r.q != nil && !woken[r.q] {
				woken[r.q] = true
				r.q.WakeFor(h.a)
			}
		}
	}
	var crossed []func()
	for _, w := range work {
		var total int64
		switch {
		case w.cmd != nil:
			total = w.cmd.Val()
		case w.get != nil:
			total, _ = w.get.Int64() // none yet: 0
		default:
			total = w.total
		}
		a := w.a
		a.mu.Lock()
		if ps := &a.periods[w.p]; ps.start.Equal(w.start) {
			ps.pending -= w.pending
			ps.usd = NanoUSD(total) + ps.pending
		}
		if c := a.crossed(); len(c) > 0 {
			crossed = append(crossed, func() { a.warnOf(c) })
		}
		a.mu.Unlock()
	}
	for _, warn := range crossed {
		warn()
	}
}
