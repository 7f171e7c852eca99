package relay

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

// channel is a provisioned Channel: everything a request needs, resolved
// once at load time.
type channel struct {
	name       string
	provider   provider
	rt         http.RoundTripper
	host       string // upstream host, to prefer another one after a 529
	urls       [routeCount]string
	apiKey     string // resolved secret; never logged, never in the config
	bearer     bool
	models     map[string]string // client name -> upstream name; nil serves all
	modelNames []string          // the client names, in config order
	priority   int
	weight     int
	allow      capability
	health     *channelHealth

	firstByte    time.Duration
	firstContent time.Duration
	response     time.Duration
	streamIdle   time.Duration
	cooldown     cooldownPolicy
	breaker      breakerSettings
	limits       limits
	probe        *probe // nil: no active probes
}

// Defaults of DESIGN.md.
const (
	defaultFirstByteTimeout    = 30 * time.Second
	defaultFirstContentTimeout = 60 * time.Second
	defaultResponseTimeout     = 10 * time.Minute
	defaultStreamIdleTimeout   = 60 * time.Second
	defaultCooldown            = 5 * time.Second
	defaultMaxCooldown         = 5 * time.Minute
	defaultAuthCooldown        = 30 * time.Minute
	defaultCapabilityTTL       = time.Hour
	defaultAnthropicURL        = "https://api.anthropic.com"
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
		bearer:   cfg.Auth == "bearer",
		priority: max(cfg.Priority, 1),
		weight:   cfg.Weight,
	}
	if ch.weight == 0 {
		ch.weight = 1
	}
	ch.models, _ = parseModels(cfg.Models) // validated already
	ch.modelNames = channelModels(cfg)
	for _, a := range cfg.Allow {
		ch.allow |= capabilityByName(a)
	}
	t := cfg.Tuning
	ch.firstByte = pickDuration(t.FirstByteTimeout, r.FirstByteTimeout, defaultFirstByteTimeout)
	ch.firstContent = pickDuration(t.FirstContentTimeout, r.FirstContentTimeout, defaultFirstContentTimeout)
	ch.response = pickDuration(t.ResponseTimeout, r.ResponseTimeout, defaultResponseTimeout)
	ch.streamIdle = pickDuration(t.StreamIdleTimeout, r.StreamIdleTimeout, defaultStreamIdleTimeout)
	ch.cooldown = cooldownPolicy{
		base:       pickDuration(t.Cooldown, r.Cooldown, defaultCooldown),
		max:        pickDuration(t.MaxCooldown, r.MaxCooldown, defaultMaxCooldown),
		auth:       pickDuration(t.AuthCooldown, r.AuthCooldown, defaultAuthCooldown),
		capability: pickDuration(t.CapabilityTTL, r.CapabilityTTL, defaultCapabilityTTL),
	}
	ch.breaker = resolveBreaker(t.Breaker, r.Breaker)

	var err error
	switch cfg.Provider {
	case providerMock:
		ch.rt, ch.provider = newMockTransport(cfg), anthropicProvider{}
		err = ch.setBase("http://" + cfg.Name + ".mock.invalid")
	case providerBedrock:
		err = r.provisionBedrock(ctx, cfg, ch)
	case providerVertex:
		err = r.provisionVertex(ctx, cfg, ch)
	default:
		err = r.provisionAnthropic(ctx, cfg, ch)
	}
	if err != nil {
		return nil, err
	}

	if cfg.Probe != nil {
		ch.probe = newProbe(cfg)
	}

	st, _, err := channelStates.LoadOrNew(cfg.Name, func() (caddy.Destructor, error) {
		return new(channelHealth), nil
	})
	if err != nil {
		return nil, err
	}
	ch.health = st.(*channelHealth)
	r.acquired = append(r.acquired, ch)
	lim, _ := parseLimits(cfg.Rate, cfg.Tokens, cfg.Concurrency) // validated already
	ch.limits = lim
	return ch, nil
}

// provisionAnthropic sets up a channel to Anthropic's API or an
// Anthropic-compatible endpoint.
func (r *Relay) provisionAnthropic(ctx caddy.Context, cfg *Channel, ch *channel) error {
	base := cmp.Or(cfg.URL, defaultAnthropicURL)
	key, err := r.channelSecret(cfg, "api_key", cfg.APIKey)
	if err != nil {
		return err
	}
	ch.apiKey = key
	if ch.rt, err = r.loadTransport(ctx, cfg, strings.HasPrefix(base, "https://")); err != nil {
		return err
	}
	ch.provider = anthropicProvider{}
	return ch.setBase(base)
}

// setBase sets the channel's upstream URLs for the relayed routes and its
// host, from the base URL.
func (ch *channel) setBase(base string) error {
	u, err := url.Parse(strings.TrimSuffix(base, "/"))
	if err != nil {
		return fmt.Errorf("url: %v", err)
	}
	ch.host = u.Host
	for rt := route(1); rt < routeCount; rt++ {
		if p := rt.upstreamPath(); p != "" {
			ch.urls[rt] = u.String() + p
		}
	}
	return nil
}

// channelSecret resolves one of a channel's secrets (field names it in
// errors) and warns when it is written in the config itself.
func (r *Relay) channelSecret(cfg *Channel, field, value string) (string, error) {
	v, err := resolveSecret(value)
	if err != nil {
		return "", fmt.Errorf("%s: %w", field, err)
	}
	if !isPlaceholder(value) {
		r.logger.Warn("a channel secret is written in the config; use a placeholder such as {env.NAME} to keep it out of GET /config/ and autosave.json",
			zap.String("channel", cfg.Name), zap.String("field", field))
	}
	return v, nil
}

// resolveBreaker merges the channel's and the relay's breaker blocks field
// by field over the defaults.
func resolveBreaker(channel, relay *Breaker) breakerSettings {
	s := defaultBreaker
	for _, b := range []*Breaker{relay, channel} {
		if b == nil {
			continue
		}
		if b.Window > 0 {
			s.window = time.Duration(b.Window)
		}
		if b.FailureRatio > 0 {
			s.ratio = b.FailureRatio
		}
		if b.MinRequests > 0 {
			s.minRequests = uint32(b.MinRequests)
		}
		if b.OpenFor > 0 {
			s.openFor = time.Duration(b.OpenFor)
		}
		if b.HalfOpenProbes > 0 {
			s.probes = uint32(b.HalfOpenProbes)
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
	if t := poolableTransport(raw); t != nil {
		key := cfg.Name + "\x00" + string(raw)
		v, _, err := transports.LoadOrNew(key, func() (caddy.Destructor, error) {
			if err := t.Provision(ctx); err != nil {
				return nil, err
			}
			return pooledTransport{t}, nil
		})
		if err != nil {
			return nil, fmt.Errorf("transport: %v", err)
		}
		r.acquiredTransports = append(r.acquiredTransports, key)
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
	return rt, nil
}

// poolableTransport decodes an http transport config that has no
// config-bound sub-modules; nil otherwise.
func poolableTransport(raw json.RawMessage) *reverseproxy.HTTPTransport {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil || string(fields["protocol"]) != `"http"` {
		return nil
	}
	if fields["network_proxy"] != nil || fields["forward_proxy_url"] != nil {
		return nil
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
// Provision resolves, rather than the secret itself.
func isPlaceholder(s string) bool {
	return strings.HasPrefix(s, "{") && strings.HasSuffix(s, "}")
}

// resolveSecret resolves the global placeholders ({env.*}, {file.*}) in s
// with a fresh replacer, so request placeholders can never leak in. An empty
// result is an error: a channel or key without its secret is unusable. The
// error names the placeholder, never a value.
func resolveSecret(s string) (string, error) {
	v, err := caddy.NewReplacer().ReplaceOrErr(s, true, true)
	if err != nil {
		return "", err
	}
	return v, nil
}

// Channel is one upstream credential: a provider, its address and key, the
// models it serves and how much traffic it gets.
type Channel struct {
	// Name identifies the channel in groups, logs, metrics and headers. It
	// is also the key of its health state, which survives config reloads.
	Name string `json:"name"`

	// Provider is the upstream kind: `anthropic` (Anthropic's API or any
	// Anthropic-compatible endpoint), `bedrock` (AWS Bedrock's InvokeModel),
	// `vertex` (Google Vertex AI) or `mock` (answered in-process, for trying
	// the relay without credentials). Default: anthropic.
	Provider string `json:"provider,omitempty"`

	// URL is the upstream's base URL; the request path (/v1/messages...) is
	// appended to its path. Default for anthropic: https://api.anthropic.com;
	// for bedrock and vertex the region's endpoint (set it to reach another
	// endpoint, such as a VPC one or a test server).
	URL string `json:"url,omitempty"`

	// APIKey is the channel's credential, usually a placeholder such as
	// `{env.ANTHROPIC_API_KEY}` resolved when the config loads. Required for
	// anthropic channels; for bedrock, a Bedrock API key sent as a bearer
	// token instead of SigV4 credentials.
	APIKey string `json:"api_key,omitempty"`

	// Region is the cloud region of a bedrock channel (us-east-1...) or of
	// a vertex channel (us-east5..., or global, us, eu).
	Region string `json:"region,omitempty"`

	// AccessKeyID, SecretAccessKey and SessionToken are a bedrock channel's
	// AWS credentials, usually placeholders. Without them (and without an
	// api_key), the AWS default credential chain is used: environment,
	// shared config files, container and instance roles.
	AccessKeyID     string `json:"access_key_id,omitempty"`
	SecretAccessKey string `json:"secret_access_key,omitempty"`
	SessionToken    string `json:"session_token,omitempty"`

	// Project is a vertex channel's Google Cloud project.
	Project string `json:"project,omitempty"`

	// CredentialsFile is the path of a vertex channel's service-account key
	// file. Default: Google's application default credentials.
	CredentialsFile string `json:"credentials_file,omitempty"`

	// AnthropicVersion is the `anthropic_version` a bedrock or vertex
	// channel puts in the body when the request has none. Default:
	// bedrock-2023-05-31 or vertex-2023-10-16.
	AnthropicVersion string `json:"anthropic_version,omitempty"`

	// Betas is the allow-list of anthropic-beta flags a bedrock or vertex
	// channel forwards (bedrock moves them into the body as anthropic_beta;
	// vertex keeps the header); others are dropped, since both reject a
	// request with a flag they do not know. `*` forwards every flag.
	// Default: for bedrock, the flags known to work there (README.md); for
	// vertex, every flag.
	Betas []string `json:"betas,omitempty"`

	// StripFields lists top-level body fields a bedrock or vertex channel
	// removes, since the cloud rejects fields it does not know. Default: for
	// bedrock service_tier, inference_geo, speed, container, mcp_servers and
	// a top-level cache_control; for vertex service_tier, inference_geo and
	// speed.
	StripFields []string `json:"strip_fields,omitempty"`

	// Auth is how the credential is sent: `x-api-key` (default) or `bearer`
	// (Authorization: Bearer), for resellers that want a bearer token.
	Auth string `json:"auth,omitempty"`

	// Models lists the models the channel serves, each as the name clients
	// send, optionally mapped to the upstream's name: `name=upstream_name`.
	// Empty means the channel serves every model, unmapped.
	Models []string `json:"models,omitempty"`

	// Priority is the channel's tier: requests go to the best (lowest)
	// tier that has a live channel. Default: 1.
	Priority int `json:"priority,omitempty"`

	// Weight is the channel's share of traffic within its tier, relative to
	// the weights of the others. Default: 1.
	Weight int `json:"weight,omitempty"`

	// Allow lists the request fields this channel accepts among
	// `service_tier`, `inference_geo` and `speed`. A request carrying one of
	// them only goes to channels that allow it.
	Allow []string `json:"allow,omitempty"`

	// TransportRaw configures the HTTP transport exactly as reverse_proxy's
	// `transport http { ... }` does (timeouts, keepalive, TLS, versions...).
	// Default: Caddy's HTTP transport with its defaults, with TLS for https
	// URLs.
	TransportRaw json.RawMessage `json:"transport,omitempty" caddy:"namespace=http.reverse_proxy.transport inline_key=protocol"`

	// Latency is, for a mock channel, how long it waits before answering.
	Latency caddy.Duration `json:"latency,omitempty"`

	// ReplyTokens is, for a mock channel, the length of its reply in
	// tokens (`tokens <n>` in the Caddyfile). Default: 16.
	ReplyTokens int `json:"reply_tokens,omitempty"`

	// FailRate is, for a mock channel, the fraction of requests (0 to 1)
	// answered with a 529 overloaded_error.
	FailRate float64 `json:"fail_rate,omitempty"`

	// Rate, Tokens and Concurrency mirror the provider's quota for this
	// credential (`500/m`, `400000/m`, `64`). A channel at a limit is busy,
	// not unhealthy: the selector skips it without cooling it down, and when
	// every channel of a request is busy the request waits in its group's
	// queue.
	Rate        string `json:"rate,omitempty"`
	Tokens      string `json:"tokens,omitempty"`
	Concurrency int    `json:"concurrency,omitempty"`

	// Probe, when set, probes the channel while it is cooling down or its
	// breaker is open, and puts it back into rotation as soon as a probe
	// succeeds. Probes are not client traffic: they count in no request
	// counter.
	Probe *Probe `json:"probe,omitempty"`

	Tuning
}
