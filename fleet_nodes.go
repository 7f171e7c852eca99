package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

// The nodes of a fleet. Every node writes a heartbeat every heartbeatEvery
// into a sorted set of the nodes by when they were last seen (on Redis's
// clock) and a hash of what they are; GET /relay/fleet lists them. A node
// not seen for nodeGoneAfter is gone; after nodeForgottenAfter it is
// forgotten.

// nodeInfo is what a node says of itself.
type nodeInfo struct {
	ID      string    `json:"id"`
	Address string    `json:"address"`
	Version string    `json:"version"`
	Started time.Time `json:"started"`
	// Leases are the blocks of large limits the node held at its last
	// heartbeat (fleet_leases.go): each is how far the fleet's count of
	// its limit may be off because of this node, the most being one block
	// per node. Empty: none, and the fleet's limits are exact.
	Leases []blockInfo `json:"leases"`
}

// fleetNode is one row of GET /relay/fleet.
type fleetNode struct {
	nodeInfo
	LastSeen time.Time `json:"last_seen"`
	// State is up (seen within the last few heartbeats) or gone.
	State string `json:"state"`
	// Self marks the node that answered.
	Self bool `json:"self"`
}

// listenAddress is where the server of the relay provisioned last listens
// (host:port, the host's address for a wildcard): the address this node
// gives its fleet. Nil: no relay has said yet.
var listenAddress atomic.Pointer[string]

// noteListenAddress records the first TCP listen address of the server
// that ctx provisions a relay for.
func noteListenAddress(ctx caddy.Context) {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok {
		return
	}
	for _, l := range srv.Listen {
		na, err := caddy.ParseNetworkAddress(l)
		if err != nil || na.IsUnixNetwork() || na.IsFdNetwork() {
			continue
		}
		if na.Host == "" || net.ParseIP(na.Host).IsUnspecified() {
			na.Host = hostAddress()
		}
		a := na.JoinHostPort(0)
		listenAddress.Store(&a)
		return
	}
}

// nodeAddress is this node's address: where its relay listens, else its
// host's address.
func nodeAddress() string {
	if a := listenAddress.Load(); a != nil {
		return *a
	}
	return hostAddress()
}

// heartbeatScript records a heartbeat and forgets the nodes long gone.
// KEYS: the set of nodes by last seen, the hash of their info. ARGV: the
// node's id, its info, the ms after which a node is forgotten, the ms
// after which a node is gone. It returns the number of nodes up (seen
// more recently than gone), this one included.
var heartbeatScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
for _, id in ipairs(old) do redis.call('HDEL', KEYS[2], id) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
return redis.call('ZCOUNT', KEYS[1], now - tonumber(ARGV[4]), '+inf')
`)

// fleetScript reads the nodes: Redis's time in ms, then each node's id,
// last seen (ms) and info.
var fleetScript = redis.NewScript(`
local t = redis.call('TIME')
local out = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
local seen = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #seen, 2 do
  table.insert(out, seen[i])
  table.insert(out, seen[i + 1])
  table.insert(out, redis.call('HGET', KEYS[2], seen[i]) or '{}')
end
return out
`)

func (f *fleet) nodeKeys() []string {
	return []string{f.key("nodes", "seen"), f.key("nodes", "info")}
}

// heartbeat writes this node's heartbeat every heartbeatEvery until ctx
// ends. While Redis is away, it is also what finds it back.
func (f *fleet) heartbeat(ctx context.Context) {
	t := time.NewTicker(heartbeatEvery)
	defer t.Stop()
	for {
		f.beat()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// beat writes one heartbeat: this node, and the blocks it holds; it
// learns how many relays are up, which sizes the blocks it takes.
func (f *fleet) beat() {
	self := thisNode()
	self.Address = nodeAddress()
	self.Leases = f.blockInfos(f.now())
	info, _ := json.Marshal(self)
	var up int64
	err := f.background("heartbeat", func(ctx context.Context) error {
		var err error
		up, err = heartbeatScript.Run(ctx, f.client, f.nodeKeys(), f.node, info, nodeForgottenAfter.Milliseconds(), nodeGoneAfter.Milliseconds()).Int64()
		return err
	})
	if err == nil && up > 0 {
		f.nodesUp.Store(up)
	}
}

// nodes lists the fleet's nodes, sorted by id.
func (f *fleet) nodes() ([]fleetNode, error) {
	var res []any
	err := f.do("fleet", func(ctx context.Context) error {
		var err error
		res, err = fleetScript.Run(ctx, f.client, f.nodeKeys()).Slice()
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(res) == 0 {
		return nil, fmt.Errorf("unexpected answer from Redis")
	}
	now, _ := res[0].(int64)
	out := []fleetNode{}
	for i := 1; i+2 < len(res); i += 3 {
		id, _ := res[i].(string)
		seenStr, _ := res[i+1].(string)
		raw, _ := res[i+2].(string)
		var n fleetNode
		_ = json.Unmarshal([]byte(raw), &n.nodeInfo)
		n.ID = id
		seenF, _ := strconv.ParseFloat(seenStr, 64)
		seen := int64(seenF)
		n.LastSeen = time.UnixMilli(seen).UTC()
		n.State = "up"
		if time.Duration(now-seen)*time.Millisecond > nodeGoneAfter {
			n.State = "gone"
		}
		out = append(out, n)
	}
	slices.SortFunc(out, func(a, b fleetNode) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
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
func fleetRows() ([]fleetNode, error) {
	var rows []fleetNode
	var failed error
	seen := map[string]bool{}
	fleets.Range(func(_, v any) bool {
		nodes, err := v.(*fleet).nodes()
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
		self := fleetNode{nodeInfo: thisNode(), LastSeen: time.Now().UTC(), State: "up"}
		self.Address = nodeAddress()
		rows = []fleetNode{self}
	}
	for i := range rows {
		rows[i].Self = rows[i].ID == thisNode().ID
		if rows[i].Leases == nil {
			rows[i].Leases = []blockInfo{}
		}
	}
	return rows, nil
}
