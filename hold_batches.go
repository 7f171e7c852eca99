package relay

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/redis/go-redis/v9"
	"github.com/tidwall/gjson"
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
	usd  nanoUSD
	made time.Time
}

// batchHoldID names a batch's hold: by its channel and the upstream's
// id, as its accounting mark is.
func batchHoldID(channel, up string) string { return fleet.Digest(channel + "\x00" + up) }

// batchWorstCase is the most a batch's requests may cost, in USD: each
// request's worst case as a message's (of its own params, its input at
// least its hold floor when it reads from outside them, a floor that no
// budget caps: a batch's requests are many), its tokens at its model's
// batch price (an unpriced model's estimate: internal/money) and its web
// searches at their full price, times factor, the highest price_factor
// among the channels that may take the batch; long: the create asks for
// the 1M context.
func (r *Relay) batchWorstCase(body []byte, factor float64, long bool) float64 {
	total := 0.0
	gjson.GetBytes(body, "requests").ForEach(func(_, req gjson.Result) bool {
		params := req.Get("params")
		model := params.Get("model").Str
		if rates, _ := r.ratesFor(model, true); rates != nil {
			prompt, maxOut := int64(len(params.Raw)/4)+1, params.Get("max_tokens").Int()
			worst := rates.Worst(prompt, maxOut)
			if rawReadsOutside([]byte(params.Raw)) {
				worst = max(worst, rates.Worst(0, maxOut)+r.floorOf(rates, contextWindow(model, long)))
			}
			total += worst*rates.Batch() + float64(money.WebSearchesOf(params.Get("tools")))*rates.WebSearch()
		}
		return true
	})
	return total * factor
}

// batchHoldTaken is a batch's holds taken at its create, one per budgeted
// account (its principal's, its group's) and one per spend cap of the
// channels that may make it, until the batch is made (keep) or not
// (abandon).
type batchHoldTaken struct {
	r     *Relay
	parts []batchHoldPart
	usd   nanoUSD
	done  bool
}

// batchHoldPart is a batch's hold of one account.
type batchHoldPart struct {
	a     *spendAccount
	lease string // in a fleet: its member while the create runs
	// channel, for the hold of a channel's spend cap, is the channel's
	// name: only the channel that makes the batch keeps it
	channel string
}

// holdBatch takes the holds of a batch of body that one of cands will
// make: against the budgets of the request's principal and its group,
// all or none, then against the spend cap of each candidate, the
// candidates whose cap cannot take it dropped from cands. nil when no
// budget and no cap applies. A batch that does not fit is answered.
//
// Every candidate's cap is held while the create runs, as the relay does
// not know which of them will make the batch; the one that makes it keeps
// its hold until the results settle it, the others are given back. A cap
// is held, not only looked at: creates that arrive together each saw room
// for themselves alone.
func (r *Relay) holdBatch(in *inbound, body []byte, cands *[]*channel) (held *batchHoldTaken, rerr *relayError) {
	var accts []*spendAccount
	for _, a := range [2]*spendAccount{in.who.state.spend, in.group().spend} {
		if a != nil && a.budgeted.Load() {
			accts = append(accts, a)
		}
	}
	capped := in.group().capped
	if len(accts) == 0 && !capped {
		return nil, nil
	}
	factor := 0.0
	for _, ch := range *cands {
		factor = max(factor, ch.priceFactor)
	}
	long := strings.Contains(strings.Join(in.ask.header.Values("Anthropic-Beta"), ","), context1m)
	worst := ceilNano(r.batchWorstCase(body, factor, long))
	if worst == 0 { // a price table whose every row is free
		return nil, nil
	}
	now := r.now()
	b := &batchHoldTaken{r: r, usd: worst}
	var ans holdAnswer
	if len(accts) > 0 {
		var err error
		if ans, err = b.take(accts, now, ""); err != nil {
			return nil, errStorageUnavailable()
		}
	}
	switch ans.verdict {
	case holdRefused:
		return nil, r.budgetRefusal(in, accts[ans.i], worst, ans)
	case holdWait:
		a := accts[ans.i]
		metricRateLimited.WithLabelValues(in.who.key.name, string(scopeBudget)).Inc()
		return nil, errBudgetHeld(a.who(), ans, a.capOf(ans.period), worst, "; a batch does not wait for them")
	}
	if capped {
		if rerr := b.holdCaps(cands, now); rerr != nil {
			b.abandon()
			return nil, rerr
		}
	}
	if len(b.parts) == 0 {
		return nil, nil
	}
	return b, nil
}

// take takes the batch's holds of accts, all or none: in the fleet's
// storage when the accounts are shared (on this relay alone while it is
// unreachable and the fleet allows it), else on this relay. channel names
// the channel whose cap accts[0] is; "" for budgets. err: the storage is
// unreachable and the fleet denies.
func (b *batchHoldTaken) take(accts []*spendAccount, now time.Time, channel string) (holdAnswer, error) {
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
		return holdAnswer{}, err
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
	return holdAnswer{}, nil
}

// reserve takes the batch's holds of accts on this relay, all or none.
func (b *batchHoldTaken) reserve(accts []*spendAccount, now time.Time, channel string) holdAnswer {
	from := len(b.parts)
	for i, a := range accts {
		if ans := a.reserve(now, b.usd); ans.verdict != holdTaken {
			for _, p := range b.parts[from:] {
				p.a.unreserve(b.usd)
			}
			b.parts = b.parts[:from]
			ans.i = i
			return ans
		}
		b.parts = append(b.parts, batchHoldPart{a: a, channel: channel})
	}
	return holdAnswer{}
}

// holdCaps holds the batch against the spend cap of each candidate that
// has one, and drops from cands the channels whose cap is spent or cannot
// take it beside what it spent and holds. None left: the batch is
// answered as a request is.
func (b *batchHoldTaken) holdCaps(cands *[]*channel, now time.Time) *relayError {
	var out *channel
	kept := (*cands)[:0:0]
	for _, ch := range *cands {
		if ch.spend != nil {
			ans, err := b.take([]*spendAccount{ch.spend}, now, ch.name)
			if err != nil {
				return errStorageUnavailable()
			}
			if ans.verdict != holdTaken {
				out = ch
				continue
			}
		}
		kept = append(kept, ch)
	}
	if len(kept) > 0 {
		*cands = kept
		return nil
	}
	_, until := out.spend.capped(now)
	return errChannelsCapped("the batch's models", out, now, untilFrom(until, now))
}

// abandon gives the holds back unused, unless the batch was made.
func (b *batchHoldTaken) abandon() {
	if b == nil || b.done {
		return
	}
	b.done = true
	for _, p := range b.parts {
		p.giveBack(b.usd)
	}
}

// giveBack gives the part's hold of usd back unused.
func (p batchHoldPart) giveBack(usd nanoUSD) {
	p.a.unreserve(usd)
	if p.lease != "" {
		if f := p.a.fleet.Load(); f != nil {
			f.releaseHold(p.a, p.lease)
		}
	}
}

// keep makes the holds the batch's, now that channel made it as up: they
// last until the batch's results settle them, or batchHoldFor. The holds
// of the other candidates' caps are given back.
func (b *batchHoldTaken) keep(channel, up string) {
	if b == nil || b.done {
		return
	}
	b.done = true
	id, now := batchHoldID(channel, up), b.r.now()
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
		b.r.logger.Warn("a batch was made while the fleet's storage was unreachable: it holds nothing against its budgets",
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
		b.r.logger.Warn("could not record a batch's hold in the fleet's storage: it holds nothing against its budgets",
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
func (f *member) batchHoldKey(id string) string { return f.Prefix + "batch_hold:" + id }

// settleBatch makes the request that accounts the results of the batch up
// on channel settle that batch's holds, those whose accounts are
// configured here: the results' cost is then charged to each as its hold
// is given back. The request's own principal and group are charged what
// held nothing (settleHolds), and a hold whose account is gone is given
// back.
func (r *Relay) settleBatch(in *inbound, channel, up string) {
	id := batchHoldID(channel, up)
	if r.fleet != nil {
		r.settleFleetBatch(in, id)
		return
	}
	hs := &holds{taken: true}
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*spendAccount)
		a.mu.Lock()
		h, ok := a.batches[id]
		a.mu.Unlock()
		if ok && a.fleet.Load() == nil {
			hs.add(a, h.usd)
			hs.list[hs.n-1].batch = id
		}
		return true
	})
	if hs.n == 0 {
		spend.forgetBatch(id) // its accounts are gone: none holds it any more
		return
	}
	in.grant.holds = hs
	in.payBatch(hs)
}

// payBatch notes whose spend the cost of the batch results that the
// request settles the holds hs of goes to: the principal that made the
// batch, when it held (its key's or identity's account is among hs). The
// request's own principal is then not charged (settleHolds): a batch's
// cost is charged once, to one key, whichever key of the group reads it.
func (in *inbound) payBatch(hs *holds) {
	if in.end.batch == nil {
		return
	}
	for i := range hs.n {
		if a := hs.list[i].a; a.scopeIs(spendOfKey) {
			in.end.batchPayer(a)
			return
		}
	}
}

// settleFleetBatch is settleBatch in a fleet: the batch's record says whose
// holds it has.
func (r *Relay) settleFleetBatch(in *inbound, id string) {
	f := r.fleet
	var rec string
	err := f.Do("batch_hold", func(ctx context.Context) error {
		var err error
		rec, err = f.Redis.GetDel(ctx, f.batchHoldKey(id)).Result()
		return err
	})
	if err != nil {
		return
	}
	hs := &holds{taken: true}
	lines := strings.Split(rec, "\n")
	for i := 0; i+1 < len(lines); i += 2 {
		accountID, member := lines[i], lines[i+1]
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
			f.limits.ReleaseHold(set, total, member)
			continue
		}
		hs.add(found, nanoUSD(n))
		hs.list[hs.n-1].lease, hs.list[hs.n-1].batch = member, id
	}
	if hs.n > 0 {
		in.grant.holds = hs
		in.payBatch(hs)
	}
}

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
