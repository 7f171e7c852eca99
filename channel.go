package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"reflect"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/upstreamconn"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// channel is a provisioned Channel: everything a request needs, resolved
// once at load time.
type channel struct {
	name       string
	provider   provider.Provider
	genAIName  string // gen_ai.provider.name of its spans (trace.go)
	rt         http.RoundTripper
	host       string            // upstream host, to prefer another one after a 529
	models     map[string]string // client name -> upstream name; nil serves all
	modelNames []string          // the client names, in config order
	priority   int
	weight     int
	features   features.Channel
	health     *channelHealth

	firstByte    time.Duration
	firstContent time.Duration
	response     time.Duration
	streamIdle   time.Duration
	cooldown     health.CooldownPolicy
	breaker      health.BreakerSettings
	limits       limits.Spec
	probe        *probe         // nil: no active probes
	priceFactor  float64        // its price over the list price
	spend        *money.Account // what was spent on it, and its spend caps; nil: no cap
	// forwardTraceparent: its upstream requests carry the attempt's
	// traceparent (trace.go)
	forwardTraceparent bool
	domain             string // its signature domain (thinking.go)

	// model classes (channel_classes.go): the class of each model it
	// lists, by the client's name; its model_class lines; the price rows
	// that are classes of their own; the names its classes may have
	classes    map[string]string
	classRules []ModelClass
	classRows  []string
	classNames []string

	metrics channelMetrics // children of its hot metrics (account_metrics.go)
}

// Defaults of the timeouts and cooldowns.
const (
	defaultFirstByteTimeout    = 30 * time.Second
	defaultFirstContentTimeout = 60 * time.Second
	defaultResponseTimeout     = 10 * time.Minute
	defaultStreamIdleTimeout   = 60 * time.Second
	defaultCooldown            = 5 * time.Second
	defaultMaxCooldown         = 5 * time.Minute
	defaultAuthCooldown        = 30 * time.Minute
	defaultCapabilityTTL       = time.Hour
)

// serves reports whether the channel serves model.
func (ch *channel) serves(model string) bool {
	if ch.models == nil {
		return true
	}
	_, ok := ch.models[model]
	return ok
}

// upstreamModel is the name the channel's upstream knows model by.
func (ch *channel) upstreamModel(model string) string {
	if up, ok := ch.models[model]; ok {
		return up
	}
	return model
}

// provisionChannel builds the runtime channel for cfg. Its health state is
// taken from channelStates; the caller releases it in Cleanup.
func (r *Relay) provisionChannel(ctx caddy.Context, cfg *Channel) (*channel, error) {
	ch := &channel{
		name:     cfg.Name,
		priority: max(cfg.Priority, 1),
		weight:   cfg.Weight,
	}
	ch.priceFactor, ch.forwardTraceparent = 1, cfg.ForwardTraceparent
	if cfg.PriceFactor != nil {
		ch.priceFactor = *cfg.PriceFactor // validated already
	}
	if ch.weight == 0 {
		ch.weight = 1
	}
	ch.models, _ = parseModels(cfg.Models) // validated already
	ch.modelNames = channelModels(cfg)
	ch.provisionClasses(cfg.ModelClasses, r.classRows)
	t := cfg.Tuning
	ch.firstByte = pickDuration(t.FirstByteTimeout, r.FirstByteTimeout, defaultFirstByteTimeout)
	ch.firstContent = pickDuration(t.FirstContentTimeout, r.FirstContentTimeout, defaultFirstContentTimeout)
	ch.response = pickDuration(t.ResponseTimeout, r.ResponseTimeout, defaultResponseTimeout)
	ch.streamIdle = pickDuration(t.StreamIdleTimeout, r.StreamIdleTimeout, defaultStreamIdleTimeout)
	ch.cooldown = health.CooldownPolicy{
		Base:       pickDuration(t.Cooldown, r.Cooldown, defaultCooldown),
		Max:        pickDuration(t.MaxCooldown, r.MaxCooldown, defaultMaxCooldown),
		Auth:       pickDuration(t.AuthCooldown, r.AuthCooldown, defaultAuthCooldown),
		Capability: pickDuration(t.CapabilityTTL, r.CapabilityTTL, defaultCapabilityTTL),
	}
	ch.breaker = resolveBreaker(t.Breaker, r.Breaker)

	if err := r.loadProvider(ctx, cfg, ch); err != nil {
		return nil, err
	}
	ch.features = features.NewChannel(ch.provider, append(cfg.Allow, cfg.Supports...), cfg.Lacks, cfg.Strip)
	ch.domain = signatureDomain(cfg, ch)

	if cfg.Probe != nil {
		ch.probe = newProbe(cfg)
	}

	st, _, err := channelStates.LoadOrNew(cfg.Name, func() (caddy.Destructor, error) {
		return newChannelHealth(cfg.Name), nil
	})
	if err != nil {
		return nil, err
	}
	ch.health = st.(*channelHealth)
	r.held.addChannel(ch)
	if ch.spend, err = r.channelSpend(cfg); err != nil {
		return nil, err
	}
	lim, _ := limits.Parse(cfg.Rate, cfg.Tokens, cfg.Concurrency) // validated already
	ch.limits = lim
	return ch, nil
}

// providerName is the name of the channel's provider, as `provider` gives
// it.
func (ch *channel) providerName() string { return moduleName(ch.provider) }

// moduleName is the name of p's module, as `provider` gives it.
func moduleName(p provider.Provider) string {
	if m, ok := p.(caddy.Module); ok {
		return m.CaddyModule().ID.Name()
	}
	return ""
}

// loadProvider loads the channel's provider module and its transport: the
// channel's `transport`, or the provider's own for one that answers
// in-process.
func (r *Relay) loadProvider(ctx caddy.Context, cfg *Channel, ch *channel) error {
	if cfg.UpstreamRaw == nil {
		cfg.UpstreamRaw = json.RawMessage(`{"provider":"` + providerAnthropic + `"}`)
	}
	mod, err := provider.WithChannel(ctx, cfg.Name).LoadModule(cfg, "UpstreamRaw")
	if err != nil {
		return fmt.Errorf("provider: %v", err)
	}
	p, ok := mod.(provider.Provider)
	if !ok {
		return fmt.Errorf("provider: module %T does not implement provider.Provider", mod)
	}
	ch.provider = p
	ch.genAIName = genAIName(p)
	if t, ok := p.(provider.Transporter); ok {
		if cfg.TransportRaw != nil {
			return fmt.Errorf("its provider answers in-process and takes no transport")
		}
		ch.rt, ch.host = t.Transport(), "in-process "+cfg.Name
		return nil
	}
	u, err := url.Parse(p.BaseURL())
	if err != nil {
		return fmt.Errorf("provider: base URL: %v", err)
	}
	ch.host = u.Host
	ch.rt, err = r.loadTransport(ctx, cfg, u.Scheme == "https")
	return err
}

// resolveBreaker merges the channel's and the relay's breaker blocks field
// by field over the defaults.
func resolveBreaker(channel, relay *Breaker) health.BreakerSettings {
	s := health.DefaultBreaker
	for _, b := range []*Breaker{relay, channel} {
		if b == nil {
			continue
		}
		if b.Window > 0 {
			s.Window = time.Duration(b.Window)
		}
		if b.FailureRatio > 0 {
			s.Ratio = b.FailureRatio
		}
		if b.MinRequests > 0 {
			s.MinRequests = uint32(b.MinRequests)
		}
		if b.OpenFor > 0 {
			s.OpenFor = time.Duration(b.OpenFor)
		}
		if b.HalfOpenProbes > 0 {
			s.Probes = uint32(b.HalfOpenProbes)
		}
	}
	return s
}

// transports keeps channels' HTTP transports across config reloads, by
// channel name and transport config, so a reload that leaves a channel's
// transport as it was keeps its warm upstream connections (and their TLS
// sessions) instead of dialing anew.
var transports = caddy.NewUsagePool()

// pooledTransport is a transport of the pool; the last config to release
// it closes its idle connections.
type pooledTransport struct{ *reverseproxy.HTTPTransport }

// Destruct implements caddy.Destructor.
func (t pooledTransport) Destruct() error { return t.Cleanup() }

// defaultIdleConnsPerHost is how many idle connections a channel's
// transport keeps to its upstream when its transport block does not say
// (keepalive_idle_conns_per_host). Caddy's reverse_proxy keeps 32, for a
// site's backends; a channel is one upstream that every client of the
// relay shares, and under more concurrent requests than it keeps, each
// answer would close a connection that the next request dials again (a
// TCP and TLS handshake to the provider). Idle connections still close
// after the transport's idle timeout (2 minutes by default).
const defaultIdleConnsPerHost = 1024

// defaultWriteBufferSize is the write buffer of a channel's upstream
// connections when its transport block does not say (write_buffer_size).
// net/http's default is 4 KiB: a Messages request of a few KB more went
// out in two writes, the full buffer and then the rest, each a system call
// and a segment the upstream wakes for. 16 KiB sends a request of up to
// about 16 KB, headers and body, in one. Larger bodies still take two
// writes (the buffer, then the rest in one copy), as they did. The buffer
// lives as long as its connection: an idle HTTP/1.1 stream holds 12 KiB
// more; an HTTP/2 upstream multiplexes its streams over a few connections.
const defaultWriteBufferSize = 16 << 10

// loadTransport returns the channel's HTTP transport: its `transport`
// block, or Caddy's HTTP transport with its defaults (TLS on for https
// URLs). A transport that depends on nothing but its own settings comes
// from the pool; one with sub-modules tied to a config (a network proxy, CA
// pools, client certificate automation) is loaded with the config, which
// cleans it up.
func (r *Relay) loadTransport(ctx caddy.Context, cfg *Channel, https bool) (http.RoundTripper, error) {
	raw := cfg.TransportRaw
	if raw == nil {
		raw = json.RawMessage(`{"protocol":"http"}`)
		if https {
			raw = json.RawMessage(`{"protocol":"http","tls":{}}`)
		}
	}
	// a transport the pool holds already is not decoded again: a reload of
	// a big config would decode every channel's only to drop it
	key := cfg.Name + "\x00" + string(raw)
	var t *reverseproxy.HTTPTransport
	_, pooled := transports.References(key)
	if !pooled {
		t = poolableTransport(raw)
	}
	if pooled || t != nil {
		v, _, err := transports.LoadOrNew(key, func() (caddy.Destructor, error) {
			if t == nil { // the pool's was released since: the same raw decodes the same
				t = poolableTransport(raw)
			}
			if t.KeepAlive == nil {
				t.KeepAlive = new(reverseproxy.KeepAlive)
			}
			if t.KeepAlive.MaxIdleConnsPerHost == 0 {
				t.KeepAlive.MaxIdleConnsPerHost = defaultIdleConnsPerHost
			}
			if t.WriteBufferSize == 0 {
				t.WriteBufferSize = defaultWriteBufferSize
			}
			if err := t.Provision(transportContext()); err != nil {
				return nil, err
			}
			upstreamconn.PooledCopies(t.Transport)
			return pooledTransport{t}, nil
		})
		if err != nil {
			return nil, fmt.Errorf("transport: %v", err)
		}
		r.held.addTransport(key)
		return v.(pooledTransport).HTTPTransport, nil
	}
	cfg.TransportRaw = raw
	mod, err := ctx.LoadModule(cfg, "TransportRaw")
	if err != nil {
		return nil, fmt.Errorf("transport: %v", err)
	}
	rt, ok := mod.(http.RoundTripper)
	if !ok {
		return nil, fmt.Errorf("transport: module %T is not an HTTP round tripper", mod)
	}
	if ht, ok := mod.(*reverseproxy.HTTPTransport); ok {
		upstreamconn.PooledCopies(ht.Transport)
	}
	return rt, nil
}

// transportContext is what the pooled transports are provisioned with: a
// context of no config. Caddy's transport keeps the context it is
// provisioned with in its dialer, and a pooled transport outlives the config
// that made it, so the config's own context would keep that whole config
// (its keys, channels and state) in memory for as long as the transport
// lives. The settings that need the config's context (its logger) are not
// pooled; see poolableTransport.
var transportContext = sync.OnceValue(func() caddy.Context {
	ctx, _ := caddy.NewContext(caddy.Context{Context: context.Background()})
	return ctx
})

// poolableTransport decodes an http transport config that has no
// config-bound sub-modules, and no setting whose connections log through the
// config's logger (proxy_protocol, read_timeout, write_timeout); nil
// otherwise.
func poolableTransport(raw json.RawMessage) *reverseproxy.HTTPTransport {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil || string(fields["protocol"]) != `"http"` {
		return nil
	}
	for _, f := range []string{"network_proxy", "forward_proxy_url", "proxy_protocol", "read_timeout", "write_timeout"} {
		if fields[f] != nil {
			return nil
		}
	}
	if tlsRaw := fields["tls"]; tlsRaw != nil {
		var tlsFields map[string]json.RawMessage
		if json.Unmarshal(tlsRaw, &tlsFields) != nil || tlsFields["ca"] != nil || tlsFields["client_certificate_automate"] != nil {
			return nil
		}
	}
	delete(fields, "protocol")
	rest, err := json.Marshal(fields)
	if err != nil {
		return nil
	}
	t := new(reverseproxy.HTTPTransport)
	if caddy.StrictUnmarshalJSON(rest, t) != nil {
		return nil // loading it as a module reports the error
	}
	return t
}

// pickDuration returns the first of the channel's value, the relay's value
// and the default that is set.
func pickDuration(channel, relay caddy.Duration, def time.Duration) time.Duration {
	switch {
	case channel > 0:
		return time.Duration(channel)
	case relay > 0:
		return time.Duration(relay)
	}
	return def
}

// isPlaceholder reports whether s is made of a Caddy placeholder, which
// Provision resolves, rather than the secret itself: the test a provider's
// secrets get (provider.IsPlaceholder), given to the relay's own.
func isPlaceholder(s string) bool { return provider.IsPlaceholder(s) }

// resolveSecret resolves the global placeholders ({env.*}, {file.*}) in s
// as a provider's secrets are (provider.ResolvePlaceholders): a fresh
// replacer, an error for an empty result, naming no value.
func resolveSecret(s string) (string, error) { return provider.ResolvePlaceholders(s) }

// Channel is one upstream credential: a provider, its address and key, the
// models it serves and how much traffic it gets.
type Channel struct {
	// Name identifies the channel in groups, logs, metrics and headers. It
	// is also the key of its health state, which survives config reloads.
	Name string `json:"name"`

	// UpstreamRaw is the channel's provider: the module that speaks its
	// upstream's wire, named by `provider` (anthropic, bedrock, vertex,
	// mock, or one compiled in from another repository), with its own
	// options beside it: {"provider": "bedrock", "region": "us-east-1"}.
	// Default: {"provider": "anthropic"}, which needs an api_key.
	UpstreamRaw json.RawMessage `json:"upstream,omitempty" caddy:"namespace=http.handlers.relay.providers inline_key=provider"`

	// Models lists the models the channel serves, each as the name clients
	// send, optionally mapped to the upstream's name: `name=upstream_name`.
	// Empty means the channel serves every model, unmapped.
	Models []string `json:"models,omitempty"`

	// ModelClasses name the model classes of the upstream's models, the
	// first whose match fits winning: a 429, a 529 or a spent
	// anthropic-ratelimit-* quota cools the channel for the class of the
	// model that answered, and it keeps serving the others. A model no
	// entry names is of the family its id names (opus, sonnet, haiku), or
	// of the price row it is a snapshot of, or (listed in Models) a class
	// of its own; on a channel without Models, any other model is of the
	// class `other`.
	ModelClasses []ModelClass `json:"model_classes,omitempty"`

	// Priority is the channel's tier: requests go to the best (lowest)
	// tier that has a live channel. Default: 1.
	Priority int `json:"priority,omitempty"`

	// Weight is the channel's share of traffic within its tier, relative to
	// the weights of the others, from 0 to 1000000. Default: 1.
	Weight int `json:"weight,omitempty"`

	// Supports lists features this channel's upstream supports beyond what
	// its provider's wire does by default (the feature table): body fields
	// (service_tier, inference_geo and speed are opt-in), server tools,
	// long_context, or anthropic-beta values. A request goes only to
	// channels that support every feature it carries.
	Supports []string `json:"supports,omitempty"`

	// Allow is an older spelling of Supports, kept working.
	Allow []string `json:"allow,omitempty"`

	// Lacks lists features this channel's upstream does not support
	// although its provider's wire does (a reseller without web search, an
	// account without the 1M context).
	Lacks []string `json:"lacks,omitempty"`

	// Strip lists features this channel takes by removing them from the
	// request: body fields, server tools (their entries of `tools`) and
	// anthropic-beta values; `unsupported_betas` removes every beta the
	// channel lacks. A channel that must strip something from a request is
	// picked only when no channel can serve it whole. Nothing a client sent
	// is ever removed otherwise.
	Strip []string `json:"strip,omitempty"`

	// SignatureDomain names the accounts whose signed thinking blocks this
	// channel's upstream accepts: Claude signs the thinking blocks of an
	// answer for the account that made it, and another account's upstream
	// refuses them ("Invalid signature in thinking block"). A conversation
	// that carries signed thinking goes to channels of the domain that
	// signed it (see the group's ThinkingFailover). Default: the channel's
	// provider and its credential's account as the provider tells it (an
	// Anthropic key's digest, a Bedrock region and credential, a Vertex
	// project), so channels with the same credential share one; give
	// channels of one organisation (several keys of it) the same name to
	// let their conversations move between them. Letters, digits and
	// - _ . : / @, at most 128 characters.
	SignatureDomain string `json:"signature_domain,omitempty"`

	// TransportRaw configures the HTTP transport exactly as reverse_proxy's
	// `transport http { ... }` does (timeouts, keepalive, TLS, versions...).
	// Default: Caddy's HTTP transport with its defaults, with TLS when the
	// provider's URL is https.
	TransportRaw json.RawMessage `json:"transport,omitempty" caddy:"namespace=http.reverse_proxy.transport inline_key=protocol"`

	// Rate, Tokens and Concurrency mirror the provider's quota for this
	// credential (`500/m`, `400000/m`, `64`). A channel at a limit is busy,
	// not unhealthy: the selector skips it without cooling it down, and when
	// every channel of a request is busy the request waits in its group's
	// queue.
	Rate        string `json:"rate,omitempty"`
	Tokens      string `json:"tokens,omitempty"`
	Concurrency int    `json:"concurrency,omitempty"`

	// PriceFactor is what this channel's tokens cost relative to the list
	// price (the `pricing` block or the built-in list): a reseller that
	// charges 80% of it is 0.8. A request's cost, in relay_cost_usd_total,
	// the log line's cost_usd and what a key is charged, is its list cost
	// times the factor of the channel that served it. It must be above 0.
	// Default: 1.
	PriceFactor *float64 `json:"price_factor,omitempty"`

	// SpendCaps cap what the relay spends on this channel, each as
	// `<amount>usd/<period>` with period day, week or month (calendar
	// periods in UTC) or total (never renews), at most one per period. A
	// request's cost on the channel is what its keys are charged for it
	// (price_factor applied). A channel whose cap is spent leaves selection
	// (state `capped`) until the period ends, and requests go to the next
	// channel; a request holds its worst case against the cap of the
	// channel it is sent to, so requests in flight together cannot pass it.
	SpendCaps []string `json:"spend_caps,omitempty"`

	// Probe, when set, probes the channel while it is cooling down or its
	// breaker is open, and puts it back into rotation as soon as a probe
	// succeeds. Probes are not client traffic: they count in no request
	// counter.
	Probe *Probe `json:"probe,omitempty"`

	// ForwardTraceparent sends the W3C `traceparent` of each attempt's
	// span to the upstream, so that an upstream that traces (a gateway of
	// your own, a self-hosted model server) continues the trace under the
	// attempt that called it: the trace id is the request's (the client's,
	// when it sent one), the parent span id is the relay's attempt span.
	// For a request the sampler dropped, the trace id goes unsampled under
	// a span id the relay makes for the attempt. The client's `tracestate`
	// is never sent. It needs Caddy's `tracing` directive; without it the
	// relay has no trace, and no trace context reaches the upstream:
	// neither the client's traceparent nor its tracestate. Default: off.
	ForwardTraceparent bool `json:"forward_traceparent,omitempty"`

	Tuning
}

// legacyChannel holds the provider fields a channel had before providers
// were modules, when they sat on the channel itself. A config that still
// has them (an autosave.json, a saved POST /load) loads as before: they
// move into "upstream".
type legacyChannel struct {
	Provider         string          `json:"provider,omitempty"`
	URL              string          `json:"url,omitempty"`
	APIKey           string          `json:"api_key,omitempty"`
	Auth             string          `json:"auth,omitempty"`
	Region           string          `json:"region,omitempty"`
	AccessKeyID      string          `json:"access_key_id,omitempty"`
	SecretAccessKey  string          `json:"secret_access_key,omitempty"`
	SessionToken     string          `json:"session_token,omitempty"`
	Project          string          `json:"project,omitempty"`
	CredentialsFile  string          `json:"credentials_file,omitempty"`
	AnthropicVersion string          `json:"anthropic_version,omitempty"`
	Betas            []string        `json:"betas,omitempty"`
	StripFields      []string        `json:"strip_fields,omitempty"`
	Latency          *caddy.Duration `json:"latency,omitempty"`
	ReplyTokens      *int            `json:"reply_tokens,omitempty"`
	FailRate         *float64        `json:"fail_rate,omitempty"`
}

// UnmarshalJSON reads a channel, strictly, in its current shape or with
// the provider fields of earlier versions beside its own (legacyChannel).
func (ch *Channel) UnmarshalJSON(b []byte) error {
	type current Channel // without this method
	var both struct {
		current
		legacyChannel
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&both); err != nil {
		return err
	}
	*ch = Channel(both.current)
	if reflect.ValueOf(both.legacyChannel).IsZero() {
		return nil // the usual case: no field of an earlier version
	}
	legacy, err := json.Marshal(both.legacyChannel)
	if err != nil || string(legacy) == "{}" {
		return err
	}
	if ch.UpstreamRaw != nil {
		return fmt.Errorf("channel %q: provider fields go inside \"upstream\", not beside it", ch.Name)
	}
	if both.Provider == "" {
		// the provider's name leads, as an inline key does
		legacy = append([]byte(`{"provider":"`+providerAnthropic+`",`), legacy[1:]...)
	}
	ch.UpstreamRaw = legacy
	return nil
}
