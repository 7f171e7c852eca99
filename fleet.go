package relay

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"

	"github.com/caddy-relay/relay/internal/affinity"
	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/signatures"
	"github.com/caddyserver/caddy/v2"
)

// Fleet says where the state that a fleet of relays shares is kept; it is
// `storage` in the JSON config and the Caddyfile.
// Without it, every relay keeps its own state in memory, which needs
// nothing and is right for a single relay.
type Fleet struct {
	// Redis keeps the shared state in Redis or Valkey.
	Redis *FleetRedis `json:"redis,omitempty"`
}

// FleetRedis is the Redis (or Valkey) a fleet shares: its fields are
// fleet.Config's.
type FleetRedis = fleet.Config

// fleets keeps each fleet's Redis connection and background work across
// config reloads, by its config, like channels' transports: a reload that
// keeps the fleet's config keeps its connections, its leases and its heartbeat.
var fleets = caddy.NewUsagePool()

// fleet is this relay's membership of a fleet: its Redis client, its node
// identity, and the background work that keeps the shared state (slot
// leases, heartbeats, health changes from the other nodes).
type member struct {
	// Client is the Redis client, its breaker, this node's id and the
	// background work (internal/fleet)
	*fleet.Client

	// limits is the limits this relay shares with the fleet: leases,
	// blocks of large limits, slots, and what is given back
	limits *limits.Shared
	// money is the spend this relay adds to the fleet's totals and the
	// holds of budgets it takes there (with the limits' admission)
	money *money.Shared

	// health is the channels' health this relay shares with the fleet:
	// their changes published and stored, the others' applied
	health *health.Shared

	signed   *signatures.Shared // the signatures this node learns, shared (internal/signatures)
	affinity *affinity.Shared   // prompt-cache affinity records (internal/affinity)
}

// loadFleet returns the fleet of Redis config s, from the pool; the caller gives
// it back with fleets.Delete(key) when its config ends.
func loadFleet(ctx caddy.Context, s *FleetRedis) (*member, string, error) {
	raw, err := json.Marshal(s)
	if err != nil {
		return nil, "", err
	}
	key := string(raw)
	v, _, err := fleets.LoadOrNew(key, func() (caddy.Destructor, error) { return newFleet(ctx, s) })
	if err != nil {
		return nil, "", err
	}
	f := v.(*member)
	f.SetLogger(ctx.Logger())
	return f, key, nil
}

func newFleet(ctx caddy.Context, s *FleetRedis) (*member, error) {
	c, err := fleet.New(ctx, s)
	if err != nil {
		return nil, err
	}
	f := &member{
		Client:   c,
		limits:   limits.New(c),
		health:   health.NewShared(c),
		signed:   signatures.NewShared(c, signatures.Learned),
		affinity: affinity.NewShared(c),
	}
	f.money = money.New(c, f.limits)
	c.Go(c.Heartbeat) // each concern's work was registered by its constructor
	return f, nil
}

// Destruct implements caddy.Destructor: the last config that used the
// fleet is gone. Spend not yet added is added (with it, the holds of the
// requests that spent it are given back), what the worker had not given
// back yet and the unused part of this node's blocks of large limits are
// given back, slots still held are given back, the node leaves. The holds
// of requests still in flight expire with their lease: their cost is not
// known yet.
func (f *member) Destruct() error {
	f.Stop()
	f.money.Flush()
	f.limits.Flush()
	return f.Close()
}

// limitsOf is the limits the fleet f keeps (nil f: none).
func (f *member) limitsOf() *limits.Shared {
	if f == nil {
		return nil
	}
	return f.limits
}

// moneyOf is the spend and holds the fleet f keeps (nil f: none).
func (f *member) moneyOf() *money.Shared {
	if f == nil {
		return nil
	}
	return f.money
}

// Interface guards
var _ caddy.Destructor = (*member)(nil)

// joinFleet connects the relay to its fleet (the `storage` config), when
// it has one.
func (r *Relay) joinFleet(ctx caddy.Context) error {
	fleet.NoteListenAddress(ctx)
	if r.Fleet == nil || r.Fleet.Redis == nil {
		return nil
	}
	s := r.Fleet.Redis
	if p := s.Password; p != "" && !strings.Contains(p, "{") {
		r.logger.Warn("storage redis: the password is written in the config, so GET /config/ shows it; use a placeholder such as {env.REDIS_PASSWORD}")
	}
	if err := register(ctx.GetMetricsRegistry(), fleet.Collectors()); err != nil {
		return err
	}
	f, key, err := loadFleet(ctx, s)
	if err != nil {
		return err
	}
	r.fleet = f
	r.held.addFleet(key)
	return nil
}

// fleet answers GET /relay/fleet: the nodes of the fleet this process
// belongs to, or this process alone when it keeps its state to itself.
func (adminAPI) fleet(w http.ResponseWriter, _ *http.Request) error {
	rows, err := fleetRows()
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: err}
	}
	return writeAdminJSON(w, rows)
}

// fleetRows lists the nodes of every fleet of the loaded configs, or this
// node alone when none has storage.
func fleetRows() ([]fleet.Node, error) {
	var rows []fleet.Node
	var failed error
	seen := map[string]bool{}
	fleets.Range(func(_, v any) bool {
		nodes, err := v.(*member).Nodes()
		if err != nil {
			failed = err
			return false
		}
		for _, n := range nodes {
			if !seen[n.ID] {
				seen[n.ID] = true
				rows = append(rows, n)
			}
		}
		return true
	})
	if failed != nil {
		return nil, fmt.Errorf("the fleet's storage (Redis) did not answer: %v", failed)
	}
	if rows == nil {
		rows = []fleet.Node{fleet.SelfNode()}
	}
	for i := range rows {
		rows[i].Self = rows[i].ID == fleet.ThisNode().ID
		if rows[i].Leases == nil {
			rows[i].Leases = []fleet.Block{}
		}
	}
	return rows, nil
}
