package relay

import (
	"errors"
	"fmt"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
)

// Tuning holds the timeouts and cooldowns. Set on the relay they apply to
// every channel; set on a channel they override the relay's value for it.
type Tuning struct {
	// FirstByteTimeout bounds, for a streaming request, the wait from
	// sending the request until the upstream's first event arrives. A
	// channel that misses it counts as failed and the request fails over.
	// Default: 30s.
	FirstByteTimeout caddy.Duration `json:"first_byte_timeout,omitempty"`

	// FirstContentTimeout bounds, for a streaming request, how long the
	// relay holds the events before the first content event
	// (content_block_start), from the upstream's response headers. While
	// it holds them nothing has reached the client, so the request may
	// still fail over. At the limit, an upstream that sent an event (a
	// ping counts) in the last half of it is committed and relayed as it
	// comes; one silent for longer is held until its next event, or fails
	// over after this long of silence (a stall). Default: 60s.
	FirstContentTimeout caddy.Duration `json:"first_content_timeout,omitempty"`

	// ResponseTimeout bounds a non-streaming request from sending it until
	// the whole upstream body is read. Default: 10m.
	ResponseTimeout caddy.Duration `json:"response_timeout,omitempty"`

	// StreamIdleTimeout is the longest silence allowed between two events of
	// a stream after the commit point; past it the stream ends with an
	// Anthropic `event: error`. Default: 60s.
	StreamIdleTimeout caddy.Duration `json:"stream_idle_timeout,omitempty"`

	// Cooldown is how long a channel rests after a transient failure (5xx,
	// network error, timeout) or a 529. It doubles with each consecutive
	// transient failure, up to MaxCooldown. Default: 5s.
	Cooldown caddy.Duration `json:"cooldown,omitempty"`

	// MaxCooldown caps every cooldown except AuthCooldown, including the
	// wait a 429's retry-after asks for. Default: 5m.
	MaxCooldown caddy.Duration `json:"max_cooldown,omitempty"`

	// AuthCooldown is how long a channel rests after its credential or
	// account was refused (401, 402, 403, credit balance too low, spend
	// limit reached). Default: 30m.
	AuthCooldown caddy.Duration `json:"auth_cooldown,omitempty"`

	// CapabilityTTL is how long a channel remembers that its upstream
	// refused a model (a 403 about the model: Bedrock's
	// AccessDeniedException, Vertex's PERMISSION_DENIED or
	// FAILED_PRECONDITION, a message naming the model): requests for that
	// model skip the channel meanwhile; other models are not affected.
	// Default: 1h.
	CapabilityTTL caddy.Duration `json:"capability_ttl,omitempty"`

	// Breaker configures the circuit breaker. Each field left unset keeps
	// the relay's value (for a channel) or the default.
	Breaker *Breaker `json:"breaker,omitempty"`
}

// Breaker configures a channel's circuit breaker: over a sliding window it
// counts the attempts that ended in a transient failure (5xx, network error,
// timeout) against those that succeeded, and when the failure ratio is too
// high it opens: the channel takes no traffic for a while, then lets a few
// live requests through (half-open) and closes again if they succeed.
type Breaker struct {
	// Window is the length of the sliding window of counted attempts.
	// Default: 10s.
	Window caddy.Duration `json:"window,omitempty"`

	// FailureRatio is the share of failed attempts in the window, from 0
	// to 1, at which the breaker opens. Default: 0.6.
	FailureRatio float64 `json:"failure_ratio,omitempty"`

	// MinRequests is how many finished attempts the window needs before
	// the ratio counts. Default: 5.
	MinRequests int `json:"min_requests,omitempty"`

	// OpenFor is how long an open breaker keeps the channel out before it
	// turns half-open. Default: 30s.
	OpenFor caddy.Duration `json:"open_for,omitempty"`

	// HalfOpenProbes is how many live requests a half-open breaker lets
	// through at a time; it closes when that many in a row succeed, and
	// opens again on a failure. Default: 1.
	HalfOpenProbes int `json:"half_open_probes,omitempty"`
}

// Probe configures active recovery probes for a channel that is cooling
// down or whose breaker is open.
type Probe struct {
	// Interval is the time between two probes. Default: 10s.
	Interval caddy.Duration `json:"interval,omitempty"`

	// Path is the relayed endpoint the probe calls:
	// /v1/messages/count_tokens (default) or /v1/messages.
	Path string `json:"path,omitempty"`

	// Body is the JSON body of the probe. Default: a one-word
	// count_tokens request for the channel's first model (or
	// claude-haiku-4-5 when it lists none).
	Body string `json:"body,omitempty"`
}

// providerAnthropic is the provider of a channel that names none.
const providerAnthropic = "anthropic"

// configError is a config error that says where: a locator such as
// {"group", "g", "channels", "x"}, by which the Caddyfile adapter finds the
// line to point at.
type configError struct {
	at  []string
	err error
}

func (e *configError) Error() string { return e.err.Error() }
func (e *configError) Unwrap() error { return e.err }

// errAt makes a configError at where.
func errAt(where []string, format string, args ...any) error {
	return &configError{at: where, err: fmt.Errorf(format, args...)}
}

// within puts err inside a thing of the config: its locator gets the
// thing's (where) in front, and its message the thing's name (what), unless
// what is empty.
func within(err error, what string, where ...string) error {
	at := where
	var ce *configError
	if errors.As(err, &ce) {
		at = append(append([]string{}, where...), ce.at...)
	}
	if what != "" {
		err = fmt.Errorf("%s: %w", what, err)
	}
	return &configError{at: at, err: err}
}

// checkLimits checks a key's or a channel's limits, saying which is wrong.
func checkLimits(rate, tokens string, concurrency int) error {
	if _, err := limits.ParseRate(rate); err != nil {
		return errAt([]string{"rate"}, "rate: %v", err)
	}
	if _, err := limits.ParseRate(tokens); err != nil {
		return errAt([]string{"tokens"}, "tokens: %v", err)
	}
	if concurrency < 0 {
		return errAt([]string{"concurrency"}, "concurrency must not be negative")
	}
	return nil
}

// over is t with every option it leaves unset taken from base: the
// settings a channel runs with, under its relay's.
func (t Tuning) over(base Tuning) Tuning {
	for _, f := range []struct{ dst, from *caddy.Duration }{
		{&t.FirstByteTimeout, &base.FirstByteTimeout},
		{&t.FirstContentTimeout, &base.FirstContentTimeout},
		{&t.ResponseTimeout, &base.ResponseTimeout},
		{&t.StreamIdleTimeout, &base.StreamIdleTimeout},
		{&t.Cooldown, &base.Cooldown},
		{&t.MaxCooldown, &base.MaxCooldown},
		{&t.AuthCooldown, &base.AuthCooldown},
		{&t.CapabilityTTL, &base.CapabilityTTL},
	} {
		if *f.dst == 0 {
			*f.dst = *f.from
		}
	}
	if t.Breaker != nil || base.Breaker != nil {
		s := resolveBreaker(t.Breaker, base.Breaker)
		t.Breaker = &Breaker{Window: caddy.Duration(s.Window), FailureRatio: s.Ratio, MinRequests: int(s.MinRequests),
			OpenFor: caddy.Duration(s.OpenFor), HalfOpenProbes: int(s.Probes)}
	}
	return t
}

func (t Tuning) validate() error {
	for _, d := range []struct {
		name string
		v    caddy.Duration
	}{
		{"first_byte_timeout", t.FirstByteTimeout},
		{"first_content_timeout", t.FirstContentTimeout},
		{"response_timeout", t.ResponseTimeout},
		{"stream_idle_timeout", t.StreamIdleTimeout},
		{"cooldown", t.Cooldown},
		{"max_cooldown", t.MaxCooldown},
		{"auth_cooldown", t.AuthCooldown},
		{"capability_ttl", t.CapabilityTTL},
	} {
		if d.v < 0 {
			return errAt([]string{d.name}, "%s must not be negative", d.name)
		}
	}
	if b := t.Breaker; b != nil {
		at := []string{"breaker"}
		switch {
		case b.Window < 0 || b.OpenFor < 0:
			return errAt(at, "breaker: window and open_for must not be negative")
		case b.FailureRatio < 0 || b.FailureRatio > 1:
			return errAt(at, "breaker: failure_ratio must be between 0 and 1")
		case b.MinRequests < 0 || b.HalfOpenProbes < 0:
			return errAt(at, "breaker: min_requests and half_open_probes must not be negative")
		}
	}
	return nil
}

// checkFeatures validates the supports, allow, lacks and strip lines: known
// names, and none on two of them.
