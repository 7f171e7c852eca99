package statuspage

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"time"
)

// Source is what the page reads of the relay, and the one way it acts on
// it. The relay implements it over its process-wide state (every loaded
// relay handler's channels, groups, keys, sessions, fleet and ledger) and
// registers it once with SetSource, so that one Source serves every page
// of every config, across reloads. Nothing a Source gives is ever a
// secret: rows are made of names, counters and what clients and upstreams
// said.
type Source interface {
	// Snapshot is the relay's state at now: this node's id, every
	// channel (without its Recent traffic, which the page counts from
	// the ring), every group, the keys that have served a request since
	// their config loaded (KeysTotal counting them all), and the
	// costliest live sessions, at most MaxSessions, the costliest first.
	// Fleet and FleetError are left empty: see Fleet.
	Snapshot(now time.Time) Snapshot
	// Fleet lists the fleet's nodes, or nil and no error when no relay
	// handler has storage; the error says why the fleet's storage could
	// not be read. The page asks at most every few seconds.
	Fleet() ([]FleetNode, error)
	// Act resets, disables or enables the channel named channel, as the
	// admin API's POST /relay/channels/<name>/<action> does, and returns
	// the channel's new state; the error says which of the two is
	// unknown.
	Act(channel, action string) (Channel, error)
	// Ledger says why the page has no ledger to read (none is
	// configured, or more than one); nil when it has one.
	Ledger() error
	// Spend calls emit with each row of the ledger's usage in [from, to),
	// summed by the columns by (of key, user, group, channel, model and
	// day), in the order they are asked.
	Spend(ctx context.Context, from, to time.Time, by []string, emit func(SpendRow) error) error
	// SpendCSV writes to w the ledger's usage in [from, to) by day,
	// group, key and model, as the admin API's GET /relay/usage does in
	// CSV, with its headers. When the ledger does not answer before
	// anything is written, it writes nothing and returns a
	// caddy.APIError that says so.
	SpendCSV(w http.ResponseWriter, r *http.Request, from, to time.Time) error
}

// SpendRow is one row of the ledger's usage: the values of the columns it
// was summed by, in the order asked, then its sums.
type SpendRow struct {
	Values   []string
	Requests int64
	// CostNano is the cost in billionths of a dollar.
	CostNano int64
}

// source is the Source the relay registered.
var source atomic.Pointer[Source]

// SetSource registers the relay's Source: every page, of every config,
// reads the relay through it. The relay calls it once, as its package is
// initialized.
func SetSource(s Source) { source.Store(&s) }

// errNoSource refuses a page in a binary without the relay.
var errNoSource = errors.New("relay_status shows the relay module's state, and this binary has no relay: build Caddy with github.com/caddy-relay/relay")

// theSource is the registered Source, or an error when none is.
func theSource() (Source, error) {
	s := source.Load()
	if s == nil {
		return nil, errNoSource
	}
	return *s, nil
}
