package statuspage

import (
	"cmp"
	"slices"
	"strings"
	"time"
)

// The page's picture of the relay: a snapshot of every channel, group,
// key and fleet node of the running config, built only when a page asks,
// with what the ring tells of each channel's recent traffic.

// MaxKeys bounds the keys of a snapshot, which every viewer of the page is
// sent each time it changes: a relay may have a hundred thousand.
const MaxKeys = 500

// MaxSessions bounds the sessions the page shows.
const MaxSessions = 20

// recentMinutes is how far back a channel's sparkline goes.
const recentMinutes = 10

// Snapshot is everything the page shows but the requests, as it is sent
// to the page's script in its `state` event.
type Snapshot struct {
	// Node is this node's id in its fleet.
	Node     string        `json:"node"`
	Channels []ChannelView `json:"channels"`
	Groups   []Group       `json:"groups"`
	// Keys are the keys that have served a request since their config
	// loaded, at most MaxKeys of them (those that spent most this
	// month); KeysTotal counts every key. GET /relay/keys lists them all.
	Keys      []Key `json:"keys"`
	KeysTotal int   `json:"keys_total"`
	// Sessions are the costliest live agent sessions, at most
	// MaxSessions (GET /relay/sessions lists more).
	Sessions []Session `json:"sessions"`
	// Fleet lists the fleet's nodes when a relay handler has storage;
	// FleetError says why it could not be read.
	Fleet      []FleetNode `json:"fleet,omitempty"`
	FleetError string      `json:"fleet_error,omitempty"`
}

// ChannelRecent is a channel's attempts among the requests in the ring, of
// the last recentMinutes minutes.
type ChannelRecent struct {
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

// Group is a group's queue: how many requests wait, by priority; and what
// its keys and users spent together, in the current month and each period
// it has a budget for, its budgets and what requests in flight and
// batches hold against them.
type Group struct {
	Name      string             `json:"name"`
	Queue     map[string]int     `json:"queue"`
	SpendUSD  map[string]float64 `json:"spend_usd,omitempty"`
	BudgetUSD map[string]float64 `json:"budget_usd,omitempty"`
	HeldUSD   float64            `json:"held_usd,omitempty"`
}

// snapshot builds the page's picture at now from src, the fleet (fleet,
// when not nil) and the ring's rows.
func snapshot(src Source, now time.Time, rows []Request, fleet func() ([]FleetNode, error)) Snapshot {
	snap := src.Snapshot(now)
	if snap.Channels == nil {
		snap.Channels = []ChannelView{}
	}
	if snap.Groups == nil {
		snap.Groups = []Group{}
	}
	if snap.Keys == nil {
		snap.Keys = []Key{}
	}
	if snap.Sessions == nil {
		snap.Sessions = []Session{}
	}
	snap.Sessions = snap.Sessions[:min(len(snap.Sessions), MaxSessions)]
	slices.SortFunc(snap.Channels, func(a, b ChannelView) int { return strings.Compare(a.Name, b.Name) })
	recentStats(snap.Channels, rows, now)
	slices.SortFunc(snap.Groups, func(a, b Group) int { return strings.Compare(a.Name, b.Name) })
	if len(snap.Keys) > MaxKeys { // those that spent most this month
		slices.SortFunc(snap.Keys, func(a, b Key) int { return cmp.Compare(b.SpendUSD["month"], a.SpendUSD["month"]) })
		snap.Keys = snap.Keys[:MaxKeys]
	}
	slices.SortFunc(snap.Keys, func(a, b Key) int {
		return cmp.Or(strings.Compare(a.Name, b.Name), strings.Compare(a.Kind, b.Kind))
	})
	snap.Fleet, snap.FleetError = nil, ""
	if fleet != nil {
		nodes, err := fleet()
		if err != nil {
			snap.FleetError = err.Error()
		}
		snap.Fleet = nodes
	}
	return snap
}

// recentStats fills each channel's recent traffic from the ring's rows.
func recentStats(chs []ChannelView, rows []Request, now time.Time) {
	byName := make(map[string]int, len(chs))
	for i := range chs {
		chs[i].Recent = ChannelRecent{}
		byName[chs[i].Name] = i
	}
	minute := now.Unix() / 60
	firstBytes := make([][]time.Duration, len(chs))
	tries := make([][2]int, len(chs)) // attempts, failures of the last 5 minutes
	for i := range rows {
		s := &rows[i]
		age := minute - s.At.UnixNano()/int64(time.Second)/60
		if age < 0 || age >= recentMinutes {
			continue
		}
		for j := range min(s.Attempts, ChainSize) {
			c, ok := byName[s.Chain[j]]
			if !ok {
				continue
			}
			failed := s.Outcomes[j] != Success
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
		if c, ok := byName[s.Channel]; ok && age < 5 && s.FirstByte > 0 {
			firstBytes[c] = append(firstBytes[c], s.FirstByte)
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
