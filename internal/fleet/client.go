package fleet

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"
)

// Client is one relay's connection to its fleet's Redis: the client, the
// timeouts and the breaker every operation goes through, this node's id,
// and the background work of the packages that share state through it.
type Client struct {
	// Redis is the client; operations go through Do or Background.
	Redis redis.UniversalClient
	// Prefix starts every key (see Key).
	Prefix string
	// Timeout bounds an operation on a request's path.
	Timeout time.Duration
	// BackgroundTimeout bounds an operation off the requests' paths.
	BackgroundTimeout time.Duration
	// Deny is on_error deny: a request Redis cannot admit is refused.
	Deny bool
	// Lease is how long a slot or a block stays taken unless renewed.
	Lease time.Duration
	// Node is this process's id in the fleet.
	Node string
	// Cluster is set for a Redis Cluster, where one script cannot touch
	// two things' keys (they hash to different slots).
	Cluster bool

	// NodesUp is the number of relays up in the fleet, as the last
	// heartbeat found (0: not known yet); NodesPinned, when set, is taken
	// instead (tests run several nodes in one process, which has one id).
	NodesUp, NodesPinned atomic.Int64

	breaker *gobreaker.CircuitBreaker[any]
	up      atomic.Bool
	upAt    atomic.Int64 // when Redis last came back (unix ns)
	downAt  atomic.Int64 // when Redis last went away (unix ns)
	logger  atomic.Pointer[zap.Logger]
	closed  atomic.Bool // Close ran: nothing more goes to Redis

	upMu   sync.Mutex
	onUp   []func() // guarded by upMu
	blocks atomic.Pointer[func() []Block]

	work context.Context
	stop context.CancelFunc
	done sync.WaitGroup
}

// New connects to the Redis of s (it does not wait for an answer: the
// first operations find whether it is there).
func New(ctx caddy.Context, s *Config) (*Client, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	password, err := provider.ResolvePlaceholders(s.Password)
	if err != nil {
		return nil, fmt.Errorf("storage redis: password: %w", err)
	}
	c := &Client{
		Prefix:  s.Prefix,
		Timeout: time.Duration(s.Timeout),
		Deny:    s.OnError == "deny",
		Lease:   time.Duration(s.Lease),
		Cluster: s.MasterName == "" && len(s.Address) > 1,
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	c.BackgroundTimeout = max(c.Timeout, min(10*c.Timeout, backgroundTimeoutCap))
	if c.Lease <= 0 {
		c.Lease = DefaultLease
	}
	opts := &redis.UniversalOptions{
		Addrs:      s.Address,
		MasterName: s.MasterName,
		Username:   s.Username,
		Password:   password,
		DB:         s.DB,
		// a request never waits on Redis for longer than the timeout (its
		// operation's context says so: Do), and never twice; what the
		// client itself bounds is the longest an operation may take, one
		// off the requests' paths (Background)
		ContextTimeoutEnabled: true,
		DialTimeout:           c.BackgroundTimeout,
		ReadTimeout:           c.BackgroundTimeout,
		WriteTimeout:          c.BackgroundTimeout,
		PoolTimeout:           c.BackgroundTimeout,
		MaxRetries:            -1,
		// while Redis is away the breaker spaces the attempts; a dial is
		// not retried within one
		DialerRetries: 1,
	}
	if len(opts.Addrs) == 0 {
		opts.Addrs = []string{DefaultAddress}
	}
	if s.TLS != nil {
		if opts.TLSConfig, err = s.TLS.MakeTLSClientConfig(ctx); err != nil {
			return nil, fmt.Errorf("storage redis: tls: %v", err)
		}
	}
	redisLogs.Do(func() { redis.SetLogger(redisLogger{}) })
	c.Redis = redis.NewUniversalClient(opts)
	c.Node = ThisNode().ID
	c.logger.Store(ctx.Logger())
	c.up.Store(true)
	metricUp.Set(1) // before the workers start: the first that fails sets 0, and nothing after it may set 1 again
	c.breaker = gobreaker.NewCircuitBreaker[any](gobreaker.Settings{
		Name:        "redis",
		MaxRequests: 1,
		Timeout:     time.Second, // open: every operation fails fast for a second, then one tries
		ReadyToTrip: func(c gobreaker.Counts) bool { return c.ConsecutiveFailures >= 3 },
		// a request's operation that ran out of its time found Redis slow,
		// not gone: see Do
		IsExcluded: func(err error) bool { return err == errSlow },
	})
	c.work, c.stop = context.WithCancel(context.Background())
	return c, nil
}

// SetLogger sets the logger outages are told to (the newest config's).
func (c *Client) SetLogger(l *zap.Logger) { c.logger.Store(l) }

// Logger is the logger of the newest config that uses the client.
func (c *Client) Logger() *zap.Logger { return c.logger.Load() }

// OnUp adds what runs each time Redis is reachable again after an outage
// (a sync of what was missed meanwhile): each concern that shares state
// adds its own.
func (c *Client) OnUp(f func()) {
	c.upMu.Lock()
	defer c.upMu.Unlock()
	c.onUp = append(c.onUp, f)
}

// Go runs work in the background until Stop.
func (c *Client) Go(work func(context.Context)) {
	c.done.Add(1)
	go func() {
		defer c.done.Done()
		work(c.work)
	}()
}

// Stop ends the background work and waits for it; operations still go to
// Redis until Close.
func (c *Client) Stop() {
	c.stop()
	c.done.Wait()
}

// Close ends the client: nothing more goes to Redis.
func (c *Client) Close() error {
	c.closed.Store(true)
	return c.Redis.Close()
}

// Closed reports whether Close ran.
func (c *Client) Closed() bool { return c.closed.Load() }

// Up reports whether Redis answers (as the operations last found).
func (c *Client) Up() bool { return c.up.Load() }

// SetUp declares Redis up or down, as tests need.
func (c *Client) SetUp(up bool) { c.up.Store(up) }

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

// ErrDown says that Redis did not answer, or that its breaker is open
// after it did not: the relay goes on with its own state.
var ErrDown = errors.New("storage unavailable")

// errSlow is a request's operation that ran out of its time: to the
// breaker, neither a success nor a failure.
var errSlow = errors.New("storage too slow")

// Do runs one Redis operation on a request's path, op naming it in
// metrics, within the timeout and behind the breaker: while Redis is down,
// operations fail at once instead of each costing the timeout. It fails
// with ErrDown.
//
// An operation that runs out of its time fails its request (which goes on
// as on_error says), and is counted in relay_storage_errors_total, but
// neither opens the breaker nor declares an outage: on a machine whose
// CPU is saturated, three answers later than 50ms in a row are common, and
// would otherwise refuse (on_error deny) or serve alone (local) every
// request of the next second. A Redis that went away is found by the
// operations off the requests' paths (Background), which keep running
// (the heartbeat every two seconds) and wait longer, and by any operation
// that fails outright (a refused or reset connection); once it is found
// unreachable, late answers count again.
func (c *Client) Do(op string, fn func(ctx context.Context) error) error {
	return c.run(op, c.Timeout, true, fn)
}

// Background runs one Redis operation off the requests' paths (a
// heartbeat, a renewal, a give-back, spend, health changes), as Do, with
// the longer timeout of those; one that runs out of it counts toward the
// breaker.
func (c *Client) Background(op string, fn func(ctx context.Context) error) error {
	return c.run(op, c.BackgroundTimeout, false, fn)
}

func (c *Client) run(op string, timeout time.Duration, request bool, fn func(ctx context.Context) error) error {
	if c.closed.Load() {
		return ErrDown
	}
	start := time.Now()
	_, err := c.breaker.Execute(func() (any, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		err := fn(ctx)
		if errors.Is(err, redis.Nil) {
			err = nil
		}
		// a request's late answer is no failure while Redis is up (see
		// Do); once it has been found unreachable, it counts again, and
		// three open the breaker, as any three failures do
		if err != nil && request && timedOut(err) && c.up.Load() {
			err = errSlow
		}
		return nil, err
	})
	metricSeconds.WithLabelValues(op).Observe(time.Since(start).Seconds())
	if err != nil {
		metricErrors.WithLabelValues(op).Inc()
		// a late answer on a request's path is no outage (see Do); nor
		// does an operation begun before Redis came back say anything of
		// now: it does not start another outage
		if err != errSlow && start.UnixNano() >= c.upAt.Load() && c.up.CompareAndSwap(true, false) {
			c.downAt.Store(time.Now().UnixNano())
			metricUp.Set(0)
			then := "serving on this relay's own state until it is back"
			if c.Deny {
				then = "answering 503 storage_unavailable until it is back"
			}
			c.logger.Load().Error("storage unreachable: "+then, zap.String("op", op), zap.Error(err))
		}
		return ErrDown
	}
	// nor does one begun before Redis went away end the outage, nor one
	// that answers while the breaker is still open (it began before the
	// breaker opened, and may have waited longer than the requests' time:
	// the operations after it would still be refused, and start another
	// outage). The breaker's probe ends it.
	if c.up.Load() || start.UnixNano() < c.downAt.Load() || c.breaker.State() == gobreaker.StateOpen {
		return nil
	}
	c.upAt.Store(time.Now().UnixNano())
	if c.up.CompareAndSwap(false, true) {
		metricUp.Set(1)
		c.logger.Load().Info("storage reachable again: state is shared by the fleet again")
		c.upMu.Lock()
		up := slices.Clone(c.onUp)
		c.upMu.Unlock()
		for _, f := range up {
			f()
		}
	}
	return nil
}

// Failed counts an operation that failed without going through Do (a
// publish dropped for want of room).
func Failed(op string) { metricErrors.WithLabelValues(op).Inc() }

// timedOut reports whether err is an operation's running out of its time:
// its context's deadline, a connection's read or write deadline
// (IsTimeout), or the wait for a pooled connection.
func timedOut(err error) bool {
	return IsTimeout(err) || errors.Is(err, redis.ErrPoolTimeout)
}

// IsTimeout reports whether err is a network timeout.
func IsTimeout(err error) bool {
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

// LeaseID names a new slot of this node.
func (c *Client) LeaseID() string {
	return c.Node + ":" + strconv.FormatUint(nextLease.Add(1), 36)
}

// nextLease numbers the slots of this process, whatever fleet they are
// of: two configs of one process may share one Redis.
var nextLease atomic.Uint64

// Key is a Redis key of the fleet: the prefix, then the thing's hash tag
// ({k:name} for a key, {c:name} for a channel) so that all of one thing's
// keys sit in one cluster slot and one script may touch them, then what.
func (c *Client) Key(thing, what string) string {
	return c.Prefix + "{" + thing + "}:" + what
}

// Digest shortens a name that may be long into a stable tag.
func Digest(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:8])
}

// Subscribe hands each message published on topic to onMessage, until
// ctx ends, and calls subscribed (when not nil) each time the
// subscription is made, again after Redis was lost.
func (c *Client) Subscribe(ctx context.Context, topic string, subscribed func(), onMessage func(payload string)) {
	ps := c.Redis.Subscribe(ctx, topic)
	stop := context.AfterFunc(ctx, func() { _ = ps.Close() }) // ends a receive under way
	defer stop()
	defer ps.Close()
	for {
		msg, err := ps.ReceiveTimeout(ctx, HeartbeatEvery)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if IsTimeout(err) {
				// quiet: make sure the connection is alive (a failed ping
				// makes the next receive reconnect)
				_ = ps.Ping(ctx)
				continue
			}
			select { // Redis is away: the next receive tries again
			case <-ctx.Done():
				return
			case <-time.After(resubscribeEvery):
			}
			continue
		}
		switch m := msg.(type) {
		case *redis.Subscription:
			if subscribed != nil {
				subscribed()
			}
		case *redis.Message:
			onMessage(m.Payload)
		}
	}
}

// resubscribeEvery paces the subscriber's attempts while Redis is away.
const resubscribeEvery = 250 * time.Millisecond

// BreakerState is the state of the breaker operations go through.
func (c *Client) BreakerState() gobreaker.State { return c.breaker.State() }
