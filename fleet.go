package relay

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"
)

// Fleet says where the state that a fleet of relays shares is kept; it is
// `storage` in the JSON config and the Caddyfile.
// Without it, every relay keeps its own state in memory, which needs
// nothing and is right for a single relay.
type Fleet struct {
	// Redis keeps the shared state in Redis or Valkey.
	Redis *FleetRedis `json:"redis,omitempty"`
}

// FleetRedis is a Redis (or Valkey) server, cluster or sentinel set that
// relays share: key and channel limits, channel health, heartbeats.
type FleetRedis struct {
	// Address lists the servers as host:port. One address is a single
	// server; several are a cluster; with MasterName, they are sentinels.
	// Default: 127.0.0.1:6379.
	Address []string `json:"address,omitempty"`

	// MasterName is the name of the master the sentinels at Address watch.
	MasterName string `json:"master_name,omitempty"`

	// Username and Password authenticate to Redis (ACL). Password should be
	// a placeholder such as {env.REDIS_PASSWORD}: it is resolved when the
	// config loads and never shows in GET /config/.
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`

	// DB is the database number (single server and sentinel only).
	DB int `json:"db,omitempty"`

	// TLS, when set, connects with TLS, configured as reverse_proxy's
	// transport configures it (tls_server_name, CA pools, client
	// certificates...). An empty object uses the system's roots.
	TLS *reverseproxy.TLSConfig `json:"tls,omitempty"`

	// Prefix starts every key the relay writes, so several fleets can share
	// one Redis. Default: relay:.
	Prefix string `json:"prefix,omitempty"`

	// Timeout bounds each Redis operation on a request's path; past it the
	// relay goes on with its own state (see OnError). Default: 50ms.
	// Operations off the requests' paths (heartbeats, renewals, give-backs,
	// spend, health changes) may take ten times as long, at least this and
	// at most one second unless this is longer; only those, and operations
	// that fail rather than take too long, find Redis unreachable; after
	// that, any three failures in a row open the breaker.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// OnError is what a request does when Redis cannot answer in time:
	// `local` (default) serves on this relay's own state, so limits are
	// kept per relay until Redis is back; `deny` answers 503 relay_error
	// storage_unavailable.
	OnError string `json:"on_error,omitempty"`

	// Lease is how long a concurrency slot held by a relay stays taken if
	// that relay stops renewing it (it died, or lost Redis): a relay renews
	// its slots every third of it. It also bounds how long a relay admits
	// from a block of a large rate or token limit it took from Redis
	// before it gives back what is left (a tenth of the limit's period,
	// at least 100ms, at most this). Default: 15s.
	Lease caddy.Duration `json:"lease,omitempty"`
}

// Fleet defaults.
const (
	defaultRedisAddress = "127.0.0.1:6379"
	defaultRedisPrefix  = "relay:"
	defaultRedisTimeout = 50 * time.Millisecond
	// backgroundTimeoutCap bounds what the timeout of operations off the
	// requests' paths grows to (ten times the timeout)
	backgroundTimeoutCap = time.Second
	defaultLease         = 15 * time.Second
	heartbeatEvery       = 2 * time.Second
	nodeGoneAfter        = 3 * heartbeatEvery
	nodeForgottenAfter   = time.Hour
)

func (s *FleetRedis) validate() error {
	switch s.OnError {
	case "", "local", "deny":
	default:
		return fmt.Errorf("storage redis: on_error must be local or deny, not %q", s.OnError)
	}
	if s.Timeout < 0 || s.Lease < 0 || s.DB < 0 {
		return fmt.Errorf("storage redis: timeout, lease and db must not be negative")
	}
	for _, a := range s.Address {
		if _, _, err := net.SplitHostPort(a); err != nil {
			return fmt.Errorf("storage redis: address %q is not host:port", a)
		}
	}
	if len(s.Address) > 1 && s.DB != 0 && s.MasterName == "" {
		return fmt.Errorf("storage redis: a cluster (several addresses) has no db")
	}
	return nil
}

// fleets keeps each fleet's Redis connection and background work across
// config reloads, by its config, like channels' transports: a reload that
// keeps the fleet's config keeps its connections, its leases and its heartbeat.
var fleets = caddy.NewUsagePool()

// fleet is this relay's membership of a fleet: its Redis client, its node
// identity, and the background work that keeps the shared state (slot
// leases, heartbeats, health changes from the other nodes).
type fleet struct {
	client  redis.UniversalClient
	prefix  string
	timeout time.Duration
	// backgroundTimeout bounds the operations off the requests' paths
	backgroundTimeout time.Duration
	deny              bool
	lease             time.Duration
	node              string // this process's id in the fleet
	// cluster is set for a Redis Cluster, where one script cannot touch
	// two things' keys (they hash to different slots)
	cluster bool

	breaker *gobreaker.CircuitBreaker[any]
	up      atomic.Bool
	upAt    atomic.Int64 // when Redis last came back (unix ns)
	downAt  atomic.Int64 // when Redis last went away (unix ns)
	logger  atomic.Pointer[zap.Logger]

	leaseMu sync.Mutex
	leases  map[leaseRef]struct{} // slots this node holds, renewed until given back

	// holdLeases are its requests' holds of budgets, renewed until their
	// cost is added to the fleet's spend (guarded by leaseMu)
	holdLeases map[leaseRef]struct{}
	spendMu    sync.Mutex // one spend sync at a time

	// blocks are the sharedLimits of which this node holds a block of a
	// large limit (fleet_leases.go); blocksNew wakes the worker that ends
	// them when their lease runs out
	blocksMu  sync.Mutex
	blocks    map[*sharedLimit]struct{}
	blocksNew chan struct{}
	// nodesUp is the number of relays up in the fleet, as the last
	// heartbeat found (0: not known yet), which sizes the blocks;
	// nodesPinned, when set, is taken instead (tests run several nodes in
	// one process, which has one node id)
	nodesUp, nodesPinned atomic.Int64
	// noLeases takes no blocks: every limit is asked of Redis at every
	// request (for tests and benchmarks that compare)
	noLeases atomic.Bool
	now      func() time.Time // the clock blocks' leases end by

	// slots are concurrency slots freed on this relay and not given back
	// yet: the next admission carries them, or giveBackSlots after
	// slotDelay; slotsNew wakes it
	slotsMu   sync.Mutex
	slots     []leaseRef
	slotsNew  chan struct{}
	slotDelay atomic.Int64 // ns
	// slotEvery is how long a node keeps the slots its requests' peak
	// needed before it gives back the rest (fleet_slots.go), in ns
	slotEvery atomic.Int64

	releases chan release       // given back off the request path
	publish  chan healthChange  // health changes of this node, to publish
	signed   chan signedEntry   // signatures this node learned, to publish (fleet_signatures.go)
	resync   chan struct{}      // asks for a sync of every shared channel's health
	spendNow chan struct{}      // asks for a sync of the spend
	affinity chan affinityWrite // prompt-cache affinity records, to write (affinity_fleet.go)
	closed   atomic.Bool        // Destruct ran: nothing more goes to Redis
	stop     context.CancelFunc // ends the background work
	done     sync.WaitGroup
}

// loadFleet returns the fleet of Redis config s, from the pool; the caller gives
// it back with fleets.Delete(key) when its config ends.
func loadFleet(ctx caddy.Context, s *FleetRedis) (*fleet, string, error) {
	raw, err := json.Marshal(s)
	if err != nil {
		return nil, "", err
	}
	key := string(raw)
	v, _, err := fleets.LoadOrNew(key, func() (caddy.Destructor, error) { return newFleet(ctx, s) })
	if err != nil {
		return nil, "", err
	}
	f := v.(*fleet)
	f.logger.Store(ctx.Logger())
	return f, key, nil
}

func newFleet(ctx caddy.Context, s *FleetRedis) (*fleet, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	password, err := resolveSecret(s.Password)
	if err != nil {
		return nil, fmt.Errorf("storage redis: password: %w", err)
	}
	f := &fleet{
		prefix:    s.Prefix,
		timeout:   time.Duration(s.Timeout),
		deny:      s.OnError == "deny",
		lease:     time.Duration(s.Lease),
		cluster:   s.MasterName == "" && len(s.Address) > 1,
		leases:    map[leaseRef]struct{}{},
		blocks:    map[*sharedLimit]struct{}{},
		blocksNew: make(chan struct{}, 1),
		slotsNew:  make(chan struct{}, 1),
		now:       time.Now,
		releases:  make(chan release, 4096),
		publish:   make(chan healthChange, 1024),
		signed:    make(chan signedEntry, 1024),
		resync:    make(chan struct{}, 1),
		spendNow:  make(chan struct{}, 1),
		affinity:  make(chan affinityWrite, 4096),
	}
	f.holdLeases = map[leaseRef]struct{}{}
	f.slotDelay.Store(int64(defaultSlotDelay))
	if f.prefix == "" {
		f.prefix = defaultRedisPrefix
	}
	if f.timeout <= 0 {
		f.timeout = defaultRedisTimeout
	}
	f.backgroundTimeout = max(f.timeout, min(10*f.timeout, backgroundTimeoutCap))
	if f.lease <= 0 {
		f.lease = defaultLease
	}
	f.slotEvery.Store(int64(min(defaultSlotEvery, f.lease)))
	opts := &redis.UniversalOptions{
		Addrs:      s.Address,
		MasterName: s.MasterName,
		Username:   s.Username,
		Password:   password,
		DB:         s.DB,
		// a request never waits on Redis for longer than the timeout (its
		// operation's context says so: do), and never twice; what the
		// client itself bounds is the longest an operation may take, one
		// off the requests' paths (background)
		ContextTimeoutEnabled: true,
		DialTimeout:           f.backgroundTimeout,
		ReadTimeout:           f.backgroundTimeout,
		WriteTimeout:          f.backgroundTimeout,
		PoolTimeout:           f.backgroundTimeout,
		MaxRetries:            -1,
		// while Redis is away the breaker spaces the attempts; a dial is
		// not retried within one
		DialerRetries: 1,
	}
	if len(opts.Addrs) == 0 {
		opts.Addrs = []string{defaultRedisAddress}
	}
	if s.TLS != nil {
		if opts.TLSConfig, err = s.TLS.MakeTLSClientConfig(ctx); err != nil {
			return nil, fmt.Errorf("storage redis: tls: %v", err)
		}
	}
	redisLogs.Do(func() { redis.SetLogger(redisLogger{}) })
	f.client = redis.NewUniversalClient(opts)
	f.node = thisNode().ID
	f.logger.Store(ctx.Logger())
	f.up.Store(true)
	metricFleetUp.Set(1) // before the workers start: the first that fails sets 0, and nothing after it may set 1 again
	f.breaker = gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: 1,
		Timeout:     time.Second, // open: every operation fails fast for a second, then one tries
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= 3 },
		// a request's operation that ran out of its time found Redis slow,
		// not gone: see do
		IsExcluded: func(err error) bool { return err == errRedisSlow },
	})
	work, stop := context.WithCancel(context.Background())
	f.stop = stop
	for _, run := range []func(context.Context){f.renewLeases, f.giveBack, f.heartbeat, f.publishHealth, f.subscribeHealth, f.publishSignatures, f.subscribeSignatures, f.syncSpend, f.expireBlocks, f.giveBackSlots, f.writeAffinity} {
		f.done.Add(1)
		go func() {
			defer f.done.Done()
			run(work)
		}()
	}
	return f, nil
}

// Destruct implements caddy.Destructor: the last config that used the
// fleet is gone. Spend not yet added is added (with it, the holds of the
// requests that spent it are given back), what the worker had not given
// back yet and the unused part of this node's blocks of large limits are
// given back, slots still held are given back, the node leaves. The holds
// of requests still in flight expire with their lease: their cost is not
// known yet.
func (f *fleet) Destruct() error {
	f.stop()
	f.done.Wait()
	f.flushSpend()
	f.endBlocks(f.now(), true)
	var rest []release
	for len(f.releases) > 0 {
		rest = append(rest, <-f.releases)
	}
	if len(rest) > 0 {
		f.flush(rest)
	}
	f.flushSlots()
	f.closed.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	f.leaseMu.Lock()
	pipe := f.client.Pipeline()
	for l := range f.leases {
		pipe.ZRem(ctx, l.set, l.id)
	}
	f.leaseMu.Unlock()
	_, _ = pipe.Exec(ctx)
	return f.client.Close()
}

// redisLogger passes go-redis's own log lines (a failed dial, a lost
// subscription) to Caddy's log at debug level, instead of its standard
// error in another format: the relay itself logs an outage once, at error
// level. go-redis has one logger per process, so this applies to every
// user of go-redis in the process.
type redisLogger struct{}

func (redisLogger) Printf(_ context.Context, format string, v ...any) {
	caddy.Log().Named("redis").Debug(fmt.Sprintf(format, v...))
}

var redisLogs sync.Once

// errFleetDown says that Redis did not answer, or that its breaker is
// open after it did not: the relay goes on with its own state.
var errFleetDown = errors.New("storage unavailable")

// errRedisSlow is a request's operation that ran out of its time: to the
// breaker, neither a success nor a failure.
var errRedisSlow = errors.New("storage too slow")

// do runs one Redis operation on a request's path, op naming it in
// metrics, within the timeout and behind the breaker: while Redis is down,
// operations fail at once instead of each costing the timeout.
//
// An operation that runs out of its time fails its request (which goes on
// as on_error says), and is counted in relay_storage_errors_total, but
// neither opens the breaker nor declares an outage: on a machine whose
// CPU is saturated, three answers later than 50ms in a row are common, and
// would otherwise refuse (on_error deny) or serve alone (local) every
// request of the next second. A Redis that went away is found by the
// operations off the requests' paths (background), which keep running
// (the heartbeat every two seconds) and wait longer, and by any operation
// that fails outright (a refused or reset connection); once it is found
// unreachable, late answers count again.
func (f *fleet) do(op string, fn func(ctx context.Context) error) error {
	return f.run(op, f.timeout, true, fn)
}

// background runs one Redis operation off the requests' paths (a
// heartbeat, a renewal, a give-back, spend, health changes), as do, with
// the longer timeout of those; one that runs out of it counts toward the
// breaker.
func (f *fleet) background(op string, fn func(ctx context.Context) error) error {
	return f.run(op, f.backgroundTimeout, false, fn)
}

func (f *fleet) run(op string, timeout time.Duration, request bool, fn func(ctx context.Context) error) error {
	if f.closed.Load() {
		return errFleetDown
	}
	start := time.Now()
	_, err := f.breaker.Execute(func() (any, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		err := fn(ctx)
		if errors.Is(err, redis.Nil) {
			err = nil
		}
		// a request's late answer is no failure while Redis is up (see
		// do); once it has been found unreachable, it counts again, and
		// three open the breaker, as any three failures do
		if err != nil && request && timedOut(err) && f.up.Load() {
			err = errRedisSlow
		}
		return nil, err
	})
	metricFleetSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if err != nil {
		metricFleetErrors.WithLabelValues(op).Inc()
		// a late answer on a request's path is no outage (see do); nor
		// does an operation begun before Redis came back say anything of
		// now: it does not start another outage
		if err != errRedisSlow && start.UnixNano() >= f.upAt.Load() && f.up.CompareAndSwap(true, false) {
			f.downAt.Store(time.Now().UnixNano())
			metricFleetUp.Set(0)
			then := "serving on this relay's own state until it is back"
			if f.deny {
				then = "answering 503 storage_unavailable until it is back"
			}
			f.logger.Load().Error("storage unreachable: "+then, zap.String("op", op), zap.Error(err))
		}
		return errFleetDown
	}
	// nor does one begun before Redis went away end the outage, nor one
	// that answers while the breaker is still open (it began before the
	// breaker opened, and may have waited longer than the requests' time:
	// the operations after it would still be refused, and start another
	// outage). The breaker's probe ends it.
	if f.up.Load() || start.UnixNano() < f.downAt.Load() || f.breaker.State() == gobreaker.StateOpen {
		return nil
	}
	f.upAt.Store(time.Now().UnixNano())
	if f.up.CompareAndSwap(false, true) {
		metricFleetUp.Set(1)
		f.logger.Load().Info("storage reachable again: state is shared by the fleet again")
		f.resyncSoon()
	}
	return nil
}

// timedOut reports whether err is an operation's running out of its time:
// its context's deadline, a connection's read or write deadline
// (isTimeout), or the wait for a pooled connection.
func timedOut(err error) bool {
	return isTimeout(err) || errors.Is(err, redis.ErrPoolTimeout)
}

// thisNode is this process as a node of a fleet: its id (its host and a
// random part, so two relays on one host are two nodes), the module's
// version, and an address of its host.
var thisNode = sync.OnceValue(func() nodeInfo {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return nodeInfo{ID: host + "-" + hex.EncodeToString(b[:]), Address: hostAddress(), Version: relayVersion(), Started: time.Now().UTC()}
})

// relayVersion is the module's version as built in.
func relayVersion() string {
	bi, _ := debug.ReadBuildInfo()
	return moduleVersion(bi)
}

// moduleVersion is the relay module's version in bi: its version as a
// dependency (built with xcaddy), else the main module's version when the
// go command stamped one, else the commit it was built from (+dirty when
// changed), else (devel), as under go run and go test.
func moduleVersion(bi *debug.BuildInfo) string {
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

// hostAddress is an address of this host that others can reach: its first
// non-loopback IP, else its name.
func hostAddress() string {
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

// leaseID names a new slot of this node.
func (f *fleet) leaseID() string {
	return f.node + ":" + strconv.FormatUint(nextLease.Add(1), 36)
}

// nextLease numbers the slots of this process, whatever fleet they are
// of: two configs of one process may share one Redis.
var nextLease atomic.Uint64

// key is a Redis key of the fleet: the prefix, then the thing's hash tag
// ({k:name} for a key, {c:name} for a channel) so that all of one thing's
// keys sit in one cluster slot and one script may touch them, then what.
func (f *fleet) key(thing, what string) string {
	return f.prefix + "{" + thing + "}:" + what
}

// digest shortens a name that may be long into a stable tag.
func digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:8])
}

// Interface guards
var _ caddy.Destructor = (*fleet)(nil)

// joinFleet connects the relay to its fleet (the `storage` config), when
// it has one.
func (r *Relay) joinFleet(ctx caddy.Context) error {
	noteListenAddress(ctx)
	if r.Fleet == nil || r.Fleet.Redis == nil {
		return nil
	}
	s := r.Fleet.Redis
	if p := s.Password; p != "" && !strings.Contains(p, "{") {
		r.logger.Warn("storage redis: the password is written in the config, so GET /config/ shows it; use a placeholder such as {env.REDIS_PASSWORD}")
	}
	if err := registerFleetMetrics(ctx.GetMetricsRegistry()); err != nil {
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
