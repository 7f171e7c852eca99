package relay

import (
	"cmp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/money"
)

// The status page's picture of the relay: the last requests this node
// answered (a ring written once per request by account) and a snapshot of
// every channel, group, key and fleet node of the running config, built
// only when a page asks. Nothing here is ever a secret: rows are made of
// names, counters and what the client and upstream said.

// recentSize is how many requests the ring keeps.
const recentSize = 1000

// chainSize is how many attempts of a request the ring keeps by name; the
// count of attempts is kept whole.
const chainSize = 4

// recentRequest is one slot of the ring: fixed fields, and strings the
// request already held (its id, key and channel names, its model), so
// writing a slot allocates nothing.
type recentRequest struct {
	seq       uint64
	at        int64 // unix ns, when the request arrived
	id        string
	key       string
	model     string
	served    string
	channel   string // the channel whose answer the client got; "" none
	chain     [chainSize]string
	outcomes  [chainSize]outcome
	attempts  int
	status    int
	stream    bool
	firstByte time.Duration
	duration  time.Duration
	input     int64
	output    int64
	cost      float64
	code      string
}

// requestRing is the last recentSize requests of this node (never shared
// in a fleet): a fixed array, written under a short lock.
type requestRing struct {
	mu   sync.Mutex
	next uint64 // the seq of the next slot written; slot seq-1 is the newest
	rows [recentSize]recentRequest
}

// recentRequests is the process-wide ring: it outlives reloads, as the
// channels' health does.
var recentRequests = new(requestRing)

// record writes in's slot; account calls it once per request.
func (g *requestRing) record(in *inbound, duration time.Duration, cost float64) {
	g.mu.Lock()
	g.next++
	s := &g.rows[(g.next-1)%recentSize]
	s.seq = g.next
	s.at = in.start.UnixNano()
	s.id, s.model, s.served, s.code = in.id, in.ask.model, in.grant.target, in.end.errCode
	s.key, s.channel = "", ""
	if in.who.key != nil {
		s.key = in.who.key.name
	}
	if in.end.answered != nil {
		s.channel = in.end.answered.name
	}
	s.chain, s.outcomes = [chainSize]string{}, [chainSize]outcome{}
	for i := range min(len(in.end.chain), chainSize) {
		s.chain[i], s.outcomes[i] = in.end.chain[i].channel, in.end.chain[i].outcome
	}
	s.attempts, s.status, s.stream = in.end.attempts, in.end.status, in.ask.stream
	s.firstByte, s.duration = in.end.firstByte, duration
	s.input, s.output, s.cost = in.end.usage.input, in.end.usage.output, cost
	g.mu.Unlock()
}

// since copies the rows written after seq, oldest first, and returns the
// newest seq.
func (g *requestRing) since(seq uint64) ([]recentRequest, uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	first := max(seq+1, g.next-min(g.next, recentSize)+1)
	out := make([]recentRequest, 0, g.next+1-min(first, g.next+1))
	for s := first; s <= g.next; s++ {
		out = append(out, g.rows[(s-1)%recentSize])
	}
	return out, g.next
}

// requestRow is a ring slot as the page gets it.
type requestRow struct {
	Seq         uint64    `json:"seq"`
	At          time.Time `json:"at"`
	ID          string    `json:"id"`
	Key         string    `json:"key"`
	Model       string    `json:"model"`
	Served      string    `json:"served,omitempty"`
	Channel     string    `json:"channel"`
	Chain       []string  `json:"chain"` // channel:outcome per attempt
	Attempts    int       `json:"attempts"`
	Status      int       `json:"status"`
	Stream      bool      `json:"stream"`
	FirstByteMs float64   `json:"first_byte_ms"`
	DurationMs  float64   `json:"duration_ms"`
	Input       int64     `json:"input_tokens"`
	Output      int64     `json:"output_tokens"`
	CostUSD     float64   `json:"cost_usd"`
	// Code is the error code of the relay's own answer, or how the last
	// attempt ended when an upstream's failure was passed on.
	Code string `json:"code,omitempty"`
}

func (s *recentRequest) row() requestRow {
	r := requestRow{
		Seq: s.seq, At: time.Unix(0, s.at).UTC(), ID: s.id, Key: s.key, Model: s.model,
		Channel: s.channel, Attempts: s.attempts, Status: s.status, Stream: s.stream,
		FirstByteMs: ms(s.firstByte), DurationMs: ms(s.duration),
		Input: s.input, Output: s.output, CostUSD: s.cost, Code: s.code, Chain: []string{},
	}
	if s.served != s.model {
		r.Served = s.served
	}
	n := 0
	for i := range min(s.attempts, chainSize) {
		if s.chain[i] != "" {
			r.Chain = append(r.Chain, s.chain[i]+":"+s.outcomes[i].String())
			n = i + 1
		}
	}
	if r.Code == "" && s.status >= 400 && n > 0 {
		r.Code = s.outcomes[n-1].String() // an upstream's failure passed on: how the last attempt ended
	}
	return r
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// statusMaxKeys bounds the keys of a snapshot, which every viewer of the
// page is sent each time it changes: a relay may have a hundred thousand.
const statusMaxKeys = 500

// statusMaxSessions bounds the sessions the status page shows.
const statusMaxSessions = 20

// statusSnapshot is everything the page shows but the requests.
type statusSnapshot struct {
	Node     string          `json:"node"`
	Channels []statusChannel `json:"channels"`
	Groups   []statusGroup   `json:"groups"`
	// Keys are the keys that have served a request since their config
	// loaded, at most statusMaxKeys of them (those that spent most this
	// month); KeysTotal counts every key. GET /relay/keys lists them all.
	Keys      []keyStatus `json:"keys"`
	KeysTotal int         `json:"keys_total"`
	// Sessions are the costliest live agent sessions, at most
	// statusMaxSessions (GET /relay/sessions lists more).
	Sessions []sessionView `json:"sessions"`
	// Fleet lists the fleet's nodes when a relay handler has storage;
	// FleetError says why it could not be read.
	Fleet      []fleet.Node `json:"fleet,omitempty"`
	FleetError string       `json:"fleet_error,omitempty"`
}

// statusChannel is a channel's row of GET /relay/channels, with what the
// ring tells of its recent traffic.
type statusChannel struct {
	channelStatus
	Recent channelRecent `json:"recent"`
}

// channelRecent is a channel's attempts among the requests in the ring, of
// the last recentMinutes minutes.
type channelRecent struct {
	// PerMinute counts attempts by minute, the oldest first, the current
	// minute last; ErrorsPerMinute those that did not succeed.
	PerMinute       [recentMinutes]int `json:"per_minute"`
	ErrorsPerMinute [recentMinutes]int `json:"errors_per_minute"`
	// ErrorRatio is the failed share of the attempts of the last 5
	// minutes; FirstByteP50Ms the median first byte of the answers it gave
	// in that time.
	ErrorRatio     float64 `json:"error_ratio"`
	FirstByteP50Ms float64 `json:"first_byte_p50_ms"`
}

// recentMinutes is how far back a channel's sparkline goes.
const recentMinutes = 10

// statusGroup is a group's queue: how many requests wait, by priority;
// and what its keys and users spent together, in the current month and
// each period it has a budget for, its budgets and what requests in
// flight and batches hold against them.
type statusGroup struct {
	Name      string             `json:"name"`
	Queue     map[string]int     `json:"queue"`
	SpendUSD  map[string]float64 `json:"spend_usd,omitempty"`
	BudgetUSD map[string]float64 `json:"budget_usd,omitempty"`
	HeldUSD   float64            `json:"held_usd,omitempty"`
}

// snapshot builds the page's picture at now from the channels, groups and
// keys of every loaded relay handler, the fleet (fleet, when not nil) and
// the ring's rows.
func snapshot(now time.Time, rows []recentRequest, nodes func() ([]fleet.Node, error)) statusSnapshot {
	snap := statusSnapshot{Node: fleet.ThisNode().ID, Channels: []statusChannel{}, Groups: []statusGroup{}, Keys: []keyStatus{}}
	byName := map[string]int{}
	channelStates.Range(func(k, v any) bool {
		byName[k.(string)] = len(snap.Channels)
		snap.Channels = append(snap.Channels, statusChannel{channelStatus: v.(*channelHealth).status(k.(string), now)})
		return true
	})
	recentStats(snap.Channels, byName, rows, now)
	slices.SortFunc(snap.Channels, func(a, b statusChannel) int { return strings.Compare(a.Name, b.Name) })

	groupStates.Range(func(k, v any) bool {
		st := v.(*groupState)
		g := statusGroup{Name: k.(string), Queue: map[string]int{}}
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
		snap.Groups = append(snap.Groups, g)
		return true
	})
	slices.SortFunc(snap.Groups, func(a, b statusGroup) int { return strings.Compare(a.Name, b.Name) })

	keys := provisionedKeys.current()
	snap.KeysTotal = len(keys)
	for _, k := range keys {
		if k.active.Load() { // a key that has served nothing has nothing to show
			snap.Keys = append(snap.Keys, k.status(k.relay.now()))
		}
	}
	if len(snap.Keys) > statusMaxKeys { // those that spent most this month
		slices.SortFunc(snap.Keys, func(a, b keyStatus) int { return cmp.Compare(b.SpendUSD["month"], a.SpendUSD["month"]) })
		snap.Keys = snap.Keys[:statusMaxKeys]
	}
	slices.SortFunc(snap.Keys, func(a, b keyStatus) int {
		return cmp.Or(strings.Compare(a.Name, b.Name), strings.Compare(a.Kind, b.Kind))
	})
	snap.Sessions = topSessions(now, statusMaxSessions)
	if nodes != nil {
		nodes, err := nodes()
		if err != nil {
			snap.FleetError = err.Error()
		}
		snap.Fleet = nodes
	}
	return snap
}

// recentStats fills each channel's recent traffic from the ring's rows.
func recentStats(chs []statusChannel, byName map[string]int, rows []recentRequest, now time.Time) {
	minute := now.Unix() / 60
	firstBytes := make([][]time.Duration, len(chs))
	tries := make([][2]int, len(chs)) // attempts, failures of the last 5 minutes
	for i := range rows {
		s := &rows[i]
		age := minute - s.at/int64(time.Second)/60
		if age < 0 || age >= recentMinutes {
			continue
		}
		for j := range min(s.attempts, chainSize) {
			c, ok := byName[s.chain[j]]
			if !ok {
				continue
			}
			failed := s.outcomes[j] != outcomeSuccess
			chs[c].Recent.PerMinute[recentMinutes-1-age]++
			if failed {
				chs[c].Recent.ErrorsPerMinute[recentMinutes-1-age]++
			}
			if age < 5 {
				tries[c][0]++
				if failed {
					tries[c][1]++
				}
			}
		}
		if c, ok := byName[s.channel]; ok && age < 5 && s.firstByte > 0 {
			firstBytes[c] = append(firstBytes[c], s.firstByte)
		}
	}
	for c := range chs {
		if tries[c][0] > 0 {
			chs[c].Recent.ErrorRatio = float64(tries[c][1]) / float64(tries[c][0])
		}
		if fb := firstBytes[c]; len(fb) > 0 {
			slices.Sort(fb)
			chs[c].Recent.FirstByteP50Ms = ms(fb[len(fb)/2])
		}
	}
}
