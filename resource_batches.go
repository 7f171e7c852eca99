package relay

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

// A batch's results are accounted once, when they are first read: their
// tokens, by model, at the batch price (see Price.Batch), and their web
// searches at the full price, times the price factor of the channel, into
// the metrics, the key's spend and its token limit. Which batches were accounted is remembered by the batch, in Redis
// in fleet mode, else in Caddy's storage, for as long as Anthropic keeps
// results (29 days), so reading them again costs nothing.

// batchAccountedFor is how long a batch is remembered as accounted.
const batchAccountedFor = 30 * 24 * time.Hour

// batchLedgerPrefix is where, in Caddy's storage, the accounted batches are
// marked.
const batchLedgerPrefix = "relay/batches_accounted/"

// accountedHere marks the batches this process accounted, so two readers
// of one batch at once do not both account it while its mark is stored.
var accountedHere sync.Map

// claimBatch reports whether the results of the batch up on channel are to
// be accounted by this read: true for the first read only.
func (r *Relay) claimBatch(channel, up string) bool {
	id := fleet.Digest(channel + "\x00" + up)
	if _, loaded := accountedHere.LoadOrStore(id, struct{}{}); loaded {
		return false
	}
	if f := r.fleet; f != nil {
		claimed := false
		err := f.Do("batch_accounted", func(ctx context.Context) error {
			ok, err := f.Redis.SetNX(ctx, f.Prefix+"batch_accounted:"+id, 1, batchAccountedFor).Result()
			claimed = ok
			return err
		})
		if err == nil {
			return claimed
		}
		// Redis is down: this relay decides alone, as its limits do
	}
	if r.storage == nil {
		return true
	}
	ctx := context.Background()
	key := batchLedgerPrefix + id
	if _, err := r.storage.Stat(ctx, key); err == nil {
		return false
	} else if !errors.Is(err, fs.ErrNotExist) {
		r.logger.Warn("could not read whether a batch was accounted; accounting it", zap.Error(err))
	}
	if err := r.storage.Store(ctx, key, []byte(time.Now().UTC().Format(time.RFC3339))); err != nil {
		r.logger.Warn("could not mark a batch as accounted", zap.Error(err))
	}
	return true
}

// batchUsage sums the usage of a batch's results, by model, from the JSONL
// as it streams.
type batchUsage struct {
	partial []byte // the start of a line not ended yet
	skip    bool   // the line being read is too long to account
	limit   int
	byModel map[string]usage
	total   usage
}

// see takes the next bytes of the results.
func (b *batchUsage) see(p []byte) {
	for len(p) > 0 {
		i := bytes.IndexByte(p, '\n')
		if i < 0 {
			b.keep(p)
			return
		}
		b.keep(p[:i])
		b.line()
		p = p[i+1:]
	}
}

func (b *batchUsage) keep(p []byte) {
	if b.skip || len(b.partial)+len(p) > b.limit {
		b.skip, b.partial = true, b.partial[:0]
		return
	}
	b.partial = append(b.partial, p...)
}

// line accounts a complete line: a result whose request succeeded.
func (b *batchUsage) line() {
	defer func() { b.partial, b.skip = b.partial[:0], false }()
	if b.skip || len(b.partial) == 0 {
		return
	}
	res := gjson.GetBytes(b.partial, "result")
	if res.Get("type").Str != "succeeded" {
		return
	}
	msg := res.Get("message")
	var u usage
	u.read(msg.Get("usage"))
	model := msg.Get("model").Str
	if b.byModel == nil {
		b.byModel = map[string]usage{}
	}
	m := b.byModel[model]
	m.input += u.input
	m.output += u.output
	m.cacheRead += u.cacheRead
	m.cacheWrite += u.cacheWrite
	m.cacheWrite1h += u.cacheWrite1h
	m.webSearches += u.webSearches
	b.byModel[model] = m
	b.total.input += u.input
	b.total.output += u.output
	b.total.cacheRead += u.cacheRead
	b.total.cacheWrite += u.cacheWrite
	b.total.cacheWrite1h += u.cacheWrite1h
	b.total.webSearches += u.webSearches
}

// results streams a batch's results (JSONL) to the client and, on their
// first read, accounts them. A client that leaves before the end does not
// stop the accounting: the relay reads the rest.
func (c *resourceCtx) results(a *resourceAttempt, up string) {
	if !c.r.claimBatch(a.ch.name, up) {
		c.stream(a, nil)
		return
	}
	c.in.end.chargesBatch()
	c.r.settleBatch(c.in, a.ch.name, up) // the batch's hold becomes what its results cost
	b := &batchUsage{limit: int(c.r.MaxResponseSize)}
	complete := c.stream(a, b.see)
	if complete {
		b.line() // a last line without its newline
	}
	c.accountBatch(a.ch, b, complete)
}

// batchCharge is what a request that accounted a batch's results charged,
// for its ledger rows: whose spend, and the cost of each model.
type batchCharge struct {
	// payer is the account of the principal the cost went to: the batch
	// maker's, whose hold the results settled; nil: the request's own
	// principal (the maker held nothing, or is gone)
	payer *money.Account
	// models are the results' usage and cost by model, sorted by model
	models []batchModel
}

// batchModel is the usage of a batch's results of one model, its cost in
// USD, and its server tools' part of it.
type batchModel struct {
	model     string
	usage     usage
	cost      float64
	tools     float64
	estimated bool // its cost is at an unpriced model's estimate
}

// accountBatch accounts a batch's usage at the batch price (its tokens;
// its server tools at their full price): metrics by model, the request's
// cost (the key's spend) and its tokens (the key's token limit).
func (c *resourceCtx) accountBatch(ch *channel, b *batchUsage, complete bool) {
	r, in := c.r, c.in
	in.end.batchResults(b.total, complete)
	_, budgets := money.Budgeted(in.who.state.spend, in.group().spend, nil)
	counted := in.grant.holds != nil || budgets > 0 || in.group().capped // a model without a price costs its estimate
	models := slices.Sorted(maps.Keys(b.byModel))
	for _, model := range models {
		u := b.byModel[model]
		label := r.modelLabel(model)
		for _, t := range [...]struct {
			kind string
			n    int64
		}{{"input", u.input}, {"output", u.output}, {"cache_read", u.cacheRead}, {"cache_write", u.cacheWrite}} {
			metricTokens.WithLabelValues(c.group.name, ch.name, label, t.kind).Add(float64(t.n))
		}
		cost, tools, estimated := 0.0, 0.0, false
		if rates, est := r.ratesFor(model, counted); rates != nil {
			cost = rates.BatchCost(u.priced()) * ch.priceFactor
			tools = rates.ServerTools(u.priced()) * ch.priceFactor
			if estimated = est && cost > 0; estimated {
				r.unpriced(in, model, cost)
			}
		}
		in.end.addCost(cost, estimated)
		if cost > 0 {
			metricCost.WithLabelValues(c.group.name, ch.name, label).Add(cost)
		}
		in.end.batchModel(batchModel{model: model, usage: u, cost: cost, tools: tools, estimated: estimated})
	}
	metricBatchResultsAccounted.WithLabelValues(c.group.name, ch.name).Inc()
}
