// Package fleet is what relays that share state stand on: the Redis client
// with its timeouts and breaker, the nodes of the fleet and their
// heartbeats, publish and subscribe, and the names of the keys. What is
// shared (limits, spend and holds, health) is kept by the packages of each
// concern on top of it.
package fleet

import (
	"fmt"
	"net"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// Config is a Redis (or Valkey) server, cluster or sentinel set that
// relays share: key and channel limits, channel health, heartbeats.
type Config struct {
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

// Defaults and the pace of the nodes' heartbeats.
const (
	DefaultAddress = "127.0.0.1:6379"
	DefaultPrefix  = "relay:"
	DefaultTimeout = 50 * time.Millisecond
	DefaultLease   = 15 * time.Second
	// backgroundTimeoutCap bounds what the timeout of operations off the
	// requests' paths grows to (ten times the timeout)
	backgroundTimeoutCap = time.Second
	// HeartbeatEvery is how often a node says it is up.
	HeartbeatEvery = 2 * time.Second
	// NodeGoneAfter is how long a node not heard from is still up.
	NodeGoneAfter = 3 * HeartbeatEvery
	// NodeForgottenAfter is how long a node gone is still listed.
	NodeForgottenAfter = time.Hour
)

// Validate says what is wrong with the config, in the Caddyfile's words.
func (s *Config) Validate() error {
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
