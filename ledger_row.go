package relay

import (
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
)

// The relay's side of the usage ledger (internal/ledger): a request's row,
// built from what the request noted and handed to the config's writer,
// and that writer, taken from the ledger's pool when the config loads.

// recordUsage hands the request's row to w's queue, with its cost and the
// part of it server tools made (tools), in USD; a nil w (no ledger
// configured) does nothing. Only requests of a principal (a key or an
// identity) are recorded: an unauthenticated one is nobody's usage.
func recordUsage(w *ledger.Writer, in *inbound, at time.Time, duration time.Duration, cost, tools float64) {
	if w == nil || in.who.key == nil {
		return
	}
	row := ledgerRow(in, at, duration, cost, tools)
	if in.end.batch != nil {
		batchRows(row, in.end.batch, w.Add)
		return
	}
	w.Add(row)
}

// ledgerRow is the row of in, a principal's request: its strings refer to
// what the request already holds, so building it allocates nothing. A
// session id longer than maxIDLen (a client's choice, as long as a
// header) is digested at once, so that a queue of rows waiting for a
// database that is down holds no more than their bound; a shorter one is
// digested by the writer, off the request path.
func ledgerRow(in *inbound, at time.Time, duration time.Duration, cost, tools float64) ledger.Row {
	row := ledger.Row{
		At: at, ID: in.id, Key: in.who.key.name, Group: in.who.key.group.name,
		Model: in.ask.model, Served: in.grant.target, Cause: in.causeLabel(),
		Session: in.agentSession(), Status: in.end.status,
		Input: in.end.usage.input, Output: in.end.usage.output,
		CacheRead: in.end.usage.cacheRead, CacheWrite: in.end.usage.cacheWrite,
		CostNano:  int64(money.ToNano(cost)), // as the budgets' spend counts it
		ToolNano:  int64(money.ToNano(tools)),
		Estimated: in.end.estimated, Incomplete: in.end.incomplete, EstimatedPrice: in.end.estimatedPrice,
		Duration: duration, FirstByte: in.end.firstByte,
	}
	if len(row.Session) > maxIDLen {
		row.Session, row.SessionDigested = sessionDigest(row.Session), true
	}
	if in.who.key.kind() == kindUser {
		row.User, _ = strings.CutPrefix(in.who.stateID, userStatePrefix)
	}
	if ch := in.end.charged(); ch != nil {
		row.Channel = ch.name
	}
	return row
}

// causeBatch is the cause of the rows of a batch's results, charged by the
// request that read them first.
const causeBatch = "batch"

// batchRows gives add the rows of the request (row) that accounted a
// batch's results: one per model the results used, each with that model's
// tokens and cost, the first under the request's id and each further one
// under <request id>/<model>; one row without a model when no result
// succeeded. They are the principal's that paid (the batch's maker's),
// cause batch. Their costs add up, to the nano-USD, to the cost the
// budgets charged.
func batchRows(row ledger.Row, b *batchCharge, add func(ledger.Row)) {
	row.Cause, row.Model, row.Served = causeBatch, "", ""
	if b.payer != nil {
		row.Key, row.User = principalOf(b.payer)
	}
	if len(b.models) == 0 {
		add(row)
		return
	}
	// each row's cost is what it adds to the running sum, rounded as the
	// budgets round the whole: never negative, and the last row ends at
	// the whole the budgets charged (accountBatch sums in the same order)
	id, total := row.ID, row.CostNano
	var sum float64
	var prev int64
	for i, m := range b.models {
		sum += m.cost
		upTo := int64(money.ToNano(sum))
		if i == len(b.models)-1 {
			upTo = total
		}
		row.Model, row.Served = m.model, m.model
		row.Input, row.Output, row.CacheRead, row.CacheWrite = m.usage.input, m.usage.output, m.usage.cacheRead, m.usage.cacheWrite
		row.CostNano, prev = upTo-prev, upTo
		row.ToolNano = int64(money.ToNano(m.tools))
		row.EstimatedPrice = m.estimated
		if i > 0 {
			row.ID = id + "/" + m.model
		}
		add(row)
	}
}

// openLedger takes the config's ledger from the pool (opening its
// database when no config holds it yet).
func (r *Relay) openLedger(ctx caddy.Context) error {
	if r.Ledger == nil {
		return nil
	}
	if err := register(ctx.GetMetricsRegistry(), ledgerCollectors); err != nil {
		return err
	}
	l, key, err := ledger.Load(ctx, r.Ledger, sessionDigest)
	if err != nil {
		return err
	}
	r.ledger = l
	r.held.addLedger(key)
	return nil
}
