package relay

import (
	"context"
	"net/http"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-relay/relay/statuspage"
)

// The relay's side of the status page (package statuspage): the row of
// each request it writes into the page's ring, and what the page reads of
// the relay, its Source, over the process-wide state of every loaded relay
// handler (channels' health, groups, provisioned keys, sessions, fleets,
// ledgers), so that one Source serves every page across reloads.

func init() {
	statuspage.SetSource(statusSource{})
}

// recordStatus writes in's row into the status page's ring; account
// calls it once per request. It allocates nothing.
func recordStatus(in *inbound, duration time.Duration, cost float64) {
	row := statusRow(in, duration, cost)
	statuspage.Record(&row)
}

// statusRow is in's row of the status page: counters and strings in
// already holds.
func statusRow(in *inbound, duration time.Duration, cost float64) statuspage.Request {
	row := statuspage.Request{
		At: in.start, ID: in.id, Model: in.ask.model, Served: in.grant.target, Code: in.end.errCode,
		Attempts: in.end.attempts, Status: in.end.status, Stream: in.ask.stream,
		FirstByte: in.end.firstByte, Duration: duration,
		Input: in.end.usage.input, Output: in.end.usage.output, CostUSD: cost,
	}
	if in.who.key != nil {
		row.Key = in.who.key.name
	}
	if in.end.answered != nil {
		row.Channel = in.end.answered.name
	}
	for i := range min(len(in.end.chain), statuspage.ChainSize) {
		row.Chain[i], row.Outcomes[i] = in.end.chain[i].channel, in.end.chain[i].outcome.String()
	}
	return row
}

// statusSource is the status page's view of the relay. Its ledger is the
// one it reads; nil: the process's (theLedger).
type statusSource struct {
	ledger *ledger.Writer
}

// Snapshot lists every channel, group, key in use and the costliest
// sessions at now.
func (statusSource) Snapshot(now time.Time) statuspage.Snapshot {
	snap := statuspage.Snapshot{Node: fleet.ThisNode().ID}
	channelStates.Range(func(k, v any) bool {
		st := v.(*channelHealth).status(k.(string), now)
		snap.Channels = append(snap.Channels, statuspage.ChannelView{Channel: pageChannel(st)})
		return true
	})
	groupStates.Range(func(k, v any) bool {
		snap.Groups = append(snap.Groups, pageGroup(k.(string), v.(*groupState)))
		return true
	})
	keys := provisionedKeys.current()
	snap.KeysTotal = len(keys)
	for _, k := range keys {
		if k.active.Load() { // a key that has served nothing has nothing to show
			snap.Keys = append(snap.Keys, pageKey(k.status(k.relay.now())))
		}
	}
	for _, v := range topSessions(now, statuspage.MaxSessions) {
		snap.Sessions = append(snap.Sessions, statuspage.Session(v))
	}
	return snap
}

// pageGroup is a group's queue by priority, and its spend, budgets and
// holds.
func pageGroup(name string, st *groupState) statuspage.Group {
	g := statuspage.Group{Name: name, Queue: map[string]int{}}
	st.queue.mu.Lock()
	for p := range priorityCount {
		g.Queue[p.String()] = st.queue.levels[p].Len()
	}
	st.queue.mu.Unlock()
	if a := st.spend.Load(); a != nil { // on its relay's clock
		spent, caps := a.Spent(time.Time{})
		g.SpendUSD, g.HeldUSD = map[string]float64{}, a.HeldUSD()
		for p := range money.NumPeriods {
			if caps[p] > 0 || p == money.PeriodMonth {
				g.SpendUSD[p.String()] = spent[p]
			}
			if caps[p] > 0 {
				if g.BudgetUSD == nil {
					g.BudgetUSD = map[string]float64{}
				}
				g.BudgetUSD[p.String()] = caps[p]
			}
		}
	}
	return g
}

// Fleet lists the fleet's nodes, or none when no relay handler has
// storage.
func (statusSource) Fleet() ([]statuspage.FleetNode, error) {
	has := false
	fleets.Range(func(_, _ any) bool { has = true; return false })
	if !has {
		return nil, nil
	}
	return fleetRows()
}

// Act steers a channel as the admin API does.
func (statusSource) Act(channel, action string) (statuspage.Channel, error) {
	st, err := steerChannel(channel, action)
	if err != nil {
		return statuspage.Channel{}, err
	}
	return pageChannel(st), nil
}

// theLedger is the ledger the page reads.
func (s statusSource) theLedger() (*ledger.Writer, error) {
	if s.ledger != nil {
		return s.ledger, nil
	}
	return ledger.Current()
}

// Ledger says why there is no ledger to read.
func (s statusSource) Ledger() error {
	_, err := s.theLedger()
	return err
}

// Spend runs a usage query of the ledger.
func (s statusSource) Spend(ctx context.Context, from, to time.Time, by []string, emit func(statuspage.SpendRow) error) error {
	l, err := s.theLedger()
	if err != nil {
		return err
	}
	return l.Usage(ctx, ledger.Query{From: from, To: to, GroupBy: by}, func(u ledger.UsageRow) error {
		return emit(statuspage.SpendRow{Values: u.Values, Requests: u.Requests, CostNano: u.CostNano})
	})
}

// SpendCSV writes the usage by day, group, key and model as GET
// /relay/usage's CSV.
func (s statusSource) SpendCSV(w http.ResponseWriter, r *http.Request, from, to time.Time) error {
	l, err := s.theLedger()
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: err}
	}
	return ledger.WriteUsage(w, r, l, ledger.Query{From: from, To: to, GroupBy: []string{"day", "group", "key", "model"}, CSV: true})
}

// pageChannel is a channel's admin row as the page shows it.
func pageChannel(st channelStatus) statuspage.Channel {
	c := statuspage.Channel{
		Name: st.Name, Provider: st.Provider, Groups: st.Groups, State: st.State,
		CooldownUntil: st.CooldownUntil, Inflight: st.Inflight, Busy: st.Busy, BusyUntil: st.BusyUntil,
		Requests: st.Requests, Failures: st.Failures, EWMALatencyMs: st.EWMALatencyMs,
		LastError: st.LastError, LastErrorReason: st.LastErrorReason, LastErrorAt: st.LastErrorAt, ResetAt: st.ResetAt,
		RefusedModels: st.RefusedModels, Lacks: st.Lacks,
		SpendUSD: st.SpendUSD, SpendCapUSD: st.SpendCapUSD, CappedUntil: st.CappedUntil,
	}
	if st.Classes != nil {
		c.Classes = make(map[string]statuspage.ClassCooldown, len(st.Classes))
		for name, cs := range st.Classes {
			c.Classes[name] = statuspage.ClassCooldown(cs)
		}
	}
	return c
}

// pageKey is a key's admin row as the page shows it.
func pageKey(st keyStatus) statuspage.Key {
	return statuspage.Key{
		Name: st.Name, Kind: st.Kind, Group: st.Group, Priority: st.Priority,
		Expires: st.Expires, Expired: st.Expired, Disabled: st.Disabled, Limits: statuspage.KeyLimits(st.Limits),
		SpendUSD: st.SpendUSD, BudgetUSD: st.BudgetUSD, RemainingUSD: st.RemainingUSD,
		EstimatedUSD: st.EstimatedUSD, EstimatedPriceUSD: st.EstimatedPriceUSD, HeldUSD: st.HeldUSD,
	}
}

// Interface guard
var _ statuspage.Source = statusSource{}
