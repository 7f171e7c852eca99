package relay

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

// Batches' holds. A Message Batch is priced when its results are read, up
// to a day after it was made, and meanwhile its requests run where no
// budget sees them. So a batch holds, when it is made, the sum of its
// requests' worst cases at the batch price against the budgets of the key
// that makes it; a batch that does not fit in what is left of a budget,
// beside what is held, is refused (429 budget_exceeded) before anything
// is sent upstream. It does not wait in the queue: it is not a request
// that holds a client for seconds. When its results are first read (and
// accounted, claimBatch), its hold becomes what they cost, charged to the
// key that made it.
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
	usd  nanoUSD
	made time.Time
}

// batchHoldID names a batch's hold: by its channel and the upstream's
// id, as its accounting mark is.
func batchHoldID(channel, up string) string { return digest(channel + "\x00" + up) }

// batchWorstCase is the most a batch's requests may cost, in USD: each
// request's worst case as a message's (of its own params), at its model's
// batch price, times factor, the highest price_factor among the channels
// that may take the batch.
func (r *Relay) batchWorstCase(body []byte, factor float64) float64 {
	total := 0.0
	gjson.GetBytes(body, "requests").ForEach(func(_, req gjson.Result) bool {
		params := req.Get("params")
		rates := r.prices.lookup(params.Get("model").Str)
		if rates != nil {
			prompt := int64(len(params.Raw)/4) + 1
			total += rates.worst(prompt, params.Get("max_tokens").Int()) * rates.batch
		}
		return true
	})
	return total * factor
}

// batchHoldTaken is a batch's hold taken at its create, until the batch
// is made (keep) or not (abandon).
type batchHoldTaken struct {
	r     *Relay
	a     *spendAccount
	usd   nanoUSD
	lease string // in a fleet: its member while the create runs
	done  bool
}

// holdBatch takes the hold of a batch of body that one of cands will
// make, for the request's principal; nil when it has no budget. A batch
// that does not fit is answered.
func (r *Relay) holdBatch(in *inbound, body []byte, cands []*channel) (*batchHoldTaken, *relayError) {
	a := in.state.spend
	if a == nil || !a.budgeted.Load() {
		return nil, nil
	}
	factor := 0.0
	for _, ch := range cands {
		factor = max(factor, ch.priceFactor)
	}
	worst := ceilNano(r.batchWorstCase(body, factor))
	if worst == 0 { // none of its models has a price: it costs nothing
		return nil, nil
	}
	now := r.now()
	b := &batchHoldTaken{r: r, a: a, usd: worst}
	var ans holdAnswer
	if f := a.fleet.Load(); f != nil {
		member := holdMember(f.leaseID(), worst)
		hc := f.prepareHold(a, now, worst, member, f.lease)
		var err error
		_, _, _, _, ans, err = f.admitAll(now, nil, []*holdCall{hc})
		switch {
		case err != nil && f.deny:
			return nil, errStorageUnavailable()
		case err != nil: // Redis is down: held on this relay alone meanwhile
			ans = a.reserve(now, worst)
		case ans.verdict == holdTaken:
			b.lease = member
			a.holdsHere(worst)
			f.hold(leaseRef{hc.keys[0], member}, true)
		}
	} else {
		ans = a.reserve(now, worst)
	}
	switch ans.verdict {
	case holdRefused:
		return nil, r.budgetRefusal(in, a, worst, ans)
	case holdWait:
		metricRateLimited.WithLabelValues(in.key.name, string(scopeBudget)).Inc()
		return nil, errBudgetHeld(a.label, ans, a.capOf(ans.period), worst, "; a batch does not wait for them")
	}
	return b, nil
}

// abandon gives the hold back unused, unless the batch was made.
func (b *batchHoldTaken) abandon() {
	if b == nil || b.done {
		return
	}
	b.done = true
	b.a.unreserve(b.usd)
	if b.lease != "" {
		if f := b.a.fleet.Load(); f != nil {
			f.releaseHold(b.a, b.lease)
		}
	}
}

// keep makes the hold the batch's, now that channel made it as up: it
// lasts until the batch's results settle it, or batchHoldFor.
func (b *batchHoldTaken) keep(channel, up string) {
	if b == nil || b.done {
		return
	}
	b.done = true
	id, now := batchHoldID(channel, up), b.r.now()
	f := b.a.fleet.Load()
	if f == nil {
		b.a.mu.Lock()
		b.a.held -= b.usd
		b.a.holding--
		if b.a.batches == nil {
			b.a.batches = map[string]batchHold{}
		}
		b.a.batches[id] = batchHold{usd: b.usd, made: now}
		b.a.batchHeld += b.usd
		b.a.mu.Unlock()
		spend.saveSoon()
		return
	}
	b.a.unreserve(b.usd) // what this relay holds in flight: from now on, only Redis holds it
	if b.lease == "" {
		b.r.logger.Warn("a batch was made while the fleet's storage was unreachable: it holds nothing against its key's budget",
			zap.String("key", b.a.label), zap.String("channel", channel))
		return
	}
	set, total := f.holdKeys(b.a.id)
	member := holdMember("b:"+id, b.usd)
	err := f.do("batch_hold", func(ctx context.Context) error {
		_, err := f.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			keepBatchScript.Eval(ctx, pipe, []string{set, total}, b.lease, member, batchHoldFor.Milliseconds(), holdKeysTTL.Milliseconds())
			pipe.Set(ctx, f.batchHoldKey(id), b.a.id+"\n"+member, batchHoldFor)
			return nil
		})
		return err
	})
	f.drop(leaseRef{set, b.lease}, true) // given back with the batch's hold, or left to expire
	if err != nil {
		b.r.logger.Warn("could not record a batch's hold in the fleet's storage: it holds nothing against its key's budget",
			zap.String("key", b.a.label), zap.String("channel", channel), zap.Error(err))
	}
}

// keepBatchScript turns a create's hold into its batch's. KEYS: the
// account's holds, its held total. ARGV: the create's member, the batch's
// member (the same amount), the batch's hold in ms, the keys' ttl in ms.
var keepBatchScript = redis.NewScript(holdsLua + `
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
func (f *fleet) batchHoldKey(id string) string { return f.prefix + "batch_hold:" + id }

// settleBatch makes the request that accounts the results of the batch up
// on channel settle that batch's hold, when it has one whose key is
// configured here: the results' cost is then that key's, charged as the
// hold is given back. Otherwise (no hold, or its key is gone) the request's
// own principal is charged, and a hold left is given back.
func (r *Relay) settleBatch(in *inbound, channel, up string) {
	id := batchHoldID(channel, up)
	if r.fleet != nil {
		r.settleFleetBatch(in, id)
		return
	}
	var found *spendAccount
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*spendAccount)
		a.mu.Lock()
		_, ok := a.batches[id]
		a.mu.Unlock()
		if ok && a.fleet.Load() == nil {
			found = a
			return false
		}
		return true
	})
	if found == nil {
		spend.forgetBatch(id) // its key is gone: no account holds it any more
		return
	}
	found.mu.Lock()
	usd := found.batches[id].usd
	found.mu.Unlock()
	in.holds = &holds{n: 1, taken: true}
	in.holds.list[0] = hold{a: found, usd: usd, batch: id}
}

// settleFleetBatch is settleBatch in a fleet: the batch's record says whose
// hold it is.
func (r *Relay) settleFleetBatch(in *inbound, id string) {
	f := r.fleet
	var rec string
	err := f.do("batch_hold", func(ctx context.Context) error {
		var err error
		rec, err = f.client.GetDel(ctx, f.batchHoldKey(id)).Result()
		return err
	})
	accountID, member, ok := strings.Cut(rec, "\n")
	if err != nil || !ok {
		return
	}
	n, _ := strconv.ParseInt(member[strings.LastIndexByte(member, '=')+1:], 10, 64)
	var found *spendAccount
	spendAccounts.Range(func(k, v any) bool {
		if a := v.(*spendAccount); k == accountID && a.fleet.Load() == f {
			found = a
			return false
		}
		return true
	})
	if found == nil {
		set, total := f.holdKeys(accountID)
		f.queueRelease(release{holdSet: set, holdTotal: total, member: member})
		return
	}
	in.holds = &holds{n: 1, taken: true}
	in.holds.list[0] = hold{a: found, usd: nanoUSD(n), lease: member, batch: id}
}

// forgetBatch drops the hold of batch id from the stored spend of a key
// that is not loaded.
func (s *spendStore) forgetBatch(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for acct, rec := range s.saved {
		if _, ok := rec[batchHoldPrefix+id]; ok {
			delete(rec, batchHoldPrefix+id)
			s.saved[acct] = rec
			s.dirty.Store(true)
		}
	}
}

// expireBatches drops the batches' holds that outlived batchHoldFor, at
// now, from the accounts of this relay.
func expireBatches(now time.Time) {
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*spendAccount)
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
