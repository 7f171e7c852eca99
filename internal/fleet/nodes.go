package fleet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

// The nodes of a fleet. Every node writes a heartbeat every HeartbeatEvery
// into a sorted set of the nodes by when they were last seen (on Redis's
// clock) and a hash of what they are; GET /relay/fleet lists them. A node
// not seen for NodeGoneAfter is gone; after NodeForgottenAfter it is
// forgotten.

// NodeInfo is what a node says of itself.
type NodeInfo struct {
	ID      string    `json:"id"`
	Address string    `json:"address"`
	Version string    `json:"version"`
	Started time.Time `json:"started"`
	// Leases are the blocks of large limits the node held at its last
	// heartbeat: each is how far the fleet's count of its limit may be off
	// because of this node, the most being one block per node. Empty:
	// none, and the fleet's limits are exact.
	Leases []Block `json:"leases"`
}

// Block is one block of a large limit a node holds, in GET /relay/fleet.
type Block struct {
	// Limit is the thing whose limit it is: k:<key name>, u:<identity>,
	// c:<channel>, e:<digest of an end user>.
	Limit string `json:"limit"`
	// Kind is requests (a rate), tokens, or concurrency (slots).
	Kind string `json:"kind"`
	// Block is what the node took; Left what it has not used yet. Of
	// concurrency, Block is the size of a block of slots, Held the slots
	// the node holds (whole blocks, the last one maybe smaller) and Left
	// those no request of it uses; Until is when it next gives back what
	// its requests in flight did not need.
	Block int64 `json:"block"`
	Left  int64 `json:"left"`
	Held  int64 `json:"held,omitempty"`
	// Nodes is the number of relays up the block was sized for, and
	// MaxFleetError the most the fleet's count of this limit can be off
	// while each holds a block of this size: one block per node.
	Nodes         int64     `json:"nodes"`
	MaxFleetError int64     `json:"max_fleet_error"`
	Until         time.Time `json:"until"`
}

// Node is one row of GET /relay/fleet.
type Node struct {
	NodeInfo
	LastSeen time.Time `json:"last_seen"`
	// State is up (seen within the last few heartbeats) or gone.
	State string `json:"state"`
	// Self marks the node that answered.
	Self bool `json:"self"`
}

// ThisNode is this process as a node of a fleet: its id (its host and a
// random part, so two relays on one host are two nodes), the module's
// version, and an address of its host.
var ThisNode = sync.OnceValue(func() NodeInfo {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return NodeInfo{ID: host + "-" + hex.EncodeToString(b[:]), Address: HostAddress(), Version: relayVersion(), Started: time.Now().UTC()}
})

// SelfNode is this process's row of GET /relay/fleet when it keeps its
// state to itself.
func SelfNode() Node {
	self := Node{NodeInfo: ThisNode(), LastSeen: time.Now().UTC(), State: "up"}
	self.Address = NodeAddress()
	return self
}

// relayVersion is the module's version as built in.
func relayVersion() string {
	bi, _ := debug.ReadBuildInfo()
	return ModuleVersion(bi)
}

// ModuleVersion is the relay module's version in bi: its version as a
// dependency (built with xcaddy), else the main module's version when the
// go command stamped one, else the commit it was built from (+dirty when
// changed), else (devel), as under go run and go test.
func ModuleVersion(bi *debug.BuildInfo) string {
	const module = "github.com/caddy-relay/relay"
	if bi == nil {
		return "(devel)"
	}
	for _, m := range bi.Deps {
		if m.Path == module {
			if m.Replace != nil && m.Replace.Version != "" {
				return m.Replace.Version
			}
			return m.Version
		}
	}
	if bi.Main.Path == module && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	var rev, dirty string
	for _, s := range bi.Settings {
		switch {
		case s.Key == "vcs.revision":
			rev = s.Value[:min(len(s.Value), 12)]
		case s.Key == "vcs.modified" && s.Value == "true":
			dirty = "+dirty"
		}
	}
	if rev != "" {
		return rev + dirty
	}
	return "(devel)"
}

// HostAddress is an address of this host that others can reach: its first
// non-loopback IP, else its name.
func HostAddress() string {
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if ip, ok := a.(*net.IPNet); ok && !ip.IP.IsLoopback() && ip.IP.IsGlobalUnicast() {
				return ip.IP.String()
			}
		}
	}
	host, _ := os.Hostname()
	return host
}

// listenAddress is where the server of the relay provisioned last listens
// (host:port, the host's address for a wildcard): the address this node
// gives its fleet. Nil: no relay has said yet.
var listenAddress atomic.Pointer[string]

// NoteListenAddress records the first TCP listen address of the server
// that ctx provisions a relay for.
func NoteListenAddress(ctx caddy.Context) {
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
			na.Host = HostAddress()
		}
		a := na.JoinHostPort(0)
		listenAddress.Store(&a)
		return
	}
}

// NodeAddress is this node's address: where its relay listens, else its
// host's address.
func NodeAddress() string {
	if a := listenAddress.Load(); a != nil {
		return *a
	}
	return HostAddress()
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

// nodesScript reads the nodes: Redis's time in ms, then each node's id,
// last seen (ms) and info.
var nodesScript = redis.NewScript(`
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

func (c *Client) nodeKeys() []string {
	return []string{c.Key("nodes", "seen"), c.Key("nodes", "info")}
}

// ReportBlocks sets what this node says of the blocks it holds at each
// heartbeat.
func (c *Client) ReportBlocks(f func() []Block) { c.blocks.Store(&f) }

// Heartbeat writes this node's heartbeat every HeartbeatEvery until ctx
// ends. While Redis is away, it is also what finds it back.
func (c *Client) Heartbeat(ctx context.Context) {
	t := time.NewTicker(HeartbeatEvery)
	defer t.Stop()
	for {
		c.Beat()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Beat writes one heartbeat: this node, and the blocks it holds; it
// learns how many relays are up, which sizes the blocks it takes.
func (c *Client) Beat() {
	self := ThisNode()
	self.Address = NodeAddress()
	if f := c.blocks.Load(); f != nil {
		self.Leases = (*f)()
	}
	info, _ := json.Marshal(self)
	var up int64
	err := c.Background("heartbeat", func(ctx context.Context) error {
		var err error
		up, err = heartbeatScript.Run(ctx, c.Redis, c.nodeKeys(), c.Node, info, NodeForgottenAfter.Milliseconds(), NodeGoneAfter.Milliseconds()).Int64()
		return err
	})
	if err == nil && up > 0 {
		c.NodesUp.Store(up)
	}
}

// RelaysUp is the number of relays up in the fleet (0: not known yet).
func (c *Client) RelaysUp() int64 {
	if n := c.NodesPinned.Load(); n > 0 {
		return n
	}
	return c.NodesUp.Load()
}

// Nodes lists the fleet's nodes, sorted by id.
func (c *Client) Nodes() ([]Node, error) {
	var res []any
	err := c.Do("fleet", func(ctx context.Context) error {
		var err error
		res, err = nodesScript.Run(ctx, c.Redis, c.nodeKeys()).Slice()
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(res) == 0 {
		return nil, fmt.Errorf("unexpected answer from Redis")
	}
	now, _ := res[0].(int64)
	out := []Node{}
	for i := 1; i+2 < len(res); i += 3 {
		id, _ := res[i].(string)
		seenStr, _ := res[i+1].(string)
		raw, _ := res[i+2].(string)
		var n Node
		_ = json.Unmarshal([]byte(raw), &n.NodeInfo)
		n.ID = id
		seenF, _ := strconv.ParseFloat(seenStr, 64)
		seen := int64(seenF)
		n.LastSeen = time.UnixMilli(seen).UTC()
		n.State = "up"
		if time.Duration(now-seen)*time.Millisecond > NodeGoneAfter {
			n.State = "gone"
		}
		out = append(out, n)
	}
	slices.SortFunc(out, func(a, b Node) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}
