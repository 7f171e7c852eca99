// Package relay is a Caddy HTTP handler that puts many upstream Claude
// providers behind one Anthropic-compatible endpoint: a client holds one
// relay key (or signs in through a Caddy authentication handler), the key
// belongs to a group, and the group's channels (one upstream credential
// each) serve its requests with failover before the first byte, within
// the key's, the group's and the channels' limits and budgets.
//
// The package is flat, one concept per file, as Caddy's reverseproxy is
// (docs/architecture.md draws it): a request runs one way through
// ServeHTTP (route, auth, body, inspect, admit, then the one attempt loop
// of failover.go for every route, then its account) and leaves through one
// recorder. What each kind of upstream speaks is a provider, a Caddy module
// of its own package on the seam the package provider exports; the
// built-in ones are under providers/ and are compiled in by relay.go's
// imports.
// Fleet mode (shared state in Redis) is the fleet*.go files; pure wire
// code is under internal/.
package relay

import (
	"cmp"
	"crypto/sha256"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/affinity"
	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/owners"
	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"

	// The built-in providers, each a module of its own package that uses
	// only the provider package, as one from another repository does.
	// Importing the relay compiles them in: `xcaddy build --with
	// github.com/caddy-relay/relay` gets them all.
	_ "github.com/caddy-relay/relay/providers/anthropic"
	_ "github.com/caddy-relay/relay/providers/bedrock"
	_ "github.com/caddy-relay/relay/providers/mock"
	_ "github.com/caddy-relay/relay/providers/openai"
	_ "github.com/caddy-relay/relay/providers/vertex"
)

func init() {
	caddy.RegisterModule(Relay{})
}

// Relay is the `relay` HTTP handler. It serves POST /v1/messages (streaming
// or not) and POST /v1/messages/count_tokens by relaying them to a channel
// of the key's group, POST /v1/chat/completions by translating it to a
// message, the Message Batches and Files APIs on the channels that serve
// them, and answers GET /v1/models itself.
type Relay struct {
	// MaxBodySize is the largest request body accepted, in bytes; larger
	// ones get a 413 request_too_large. Default: 32 MiB, Anthropic's own
	// limit.
	MaxBodySize int64 `json:"max_body_size,omitempty"`

	// ReadBodyTimeout bounds the time a client takes to send its request
	// body, from the end of its headers. A client that sends more slowly
	// gets a 408 timeout_error, and its key's concurrency slot (taken before
	// the body is read) is free again. Default: 30s.
	ReadBodyTimeout caddy.Duration `json:"read_body_timeout,omitempty"`

	// DecodeMemory bounds the memory that decoding request bodies may hold
	// at once on this node, in bytes. Before the relay reads a body's JSON
	// (and translates a Chat Completions body), it reserves what that
	// decoding may allocate, estimated from the body's size and the members
	// of its objects (a body that is mostly one object of very many members
	// costs up to about 20 times its size), and gives it back when done. A
	// request that finds no room waits for it, for as long as its client
	// does; one whose decoding alone would take more than DecodeMemory gets
	// a 413 request_too_large. The relay handlers of a node that set the
	// same value share one budget. Default: 256 MiB.
	DecodeMemory int64 `json:"decode_memory,omitempty"`

	// MaxResponseSize is the largest non-streaming upstream answer the relay
	// reads, in bytes; a larger one fails the attempt as a broken answer.
	// Streams are forwarded event by event and bounded per event only.
	// Default: 64 MiB.
	MaxResponseSize int64 `json:"max_response_size,omitempty"`

	// MaxUploadSize is the largest file a client may upload through the
	// Files API, in bytes; a larger one gets a 413 request_too_large.
	// Uploads stream to the upstream without being held in memory, so they
	// fail over to another channel only before their first byte is sent.
	// Default: 500 MB, Anthropic's own limit.
	MaxUploadSize int64 `json:"max_upload_size,omitempty"`

	// ResourceSecret keys the MAC of the batch and file ids the relay
	// gives clients (an id names the channel that holds the item, and
	// cannot be forged or used from another group). Use a placeholder
	// such as {env.RELAY_RESOURCE_SECRET}. Without it, the relay generates
	// a secret once and keeps it in Caddy's storage, or, in fleet mode, in
	// Redis, so every relay of a fleet reads the others' ids. Changing it
	// makes every id given before unknown.
	ResourceSecret string `json:"resource_secret,omitempty"`

	// DedupWindow is how long after its answer a request that may be
	// retried (it carries x-stainless-retry-count or idempotency-key)
	// answers its retries: a retry (x-stainless-retry-count 1 or more, or
	// an idempotency-key) from the same key with the same request, while
	// the first attempt is in flight or within this window, is answered
	// from it, and the upstream is called once. Per node. 0 turns this
	// off. Default: 60s.
	DedupWindow *caddy.Duration `json:"dedup_window,omitempty"`

	// DedupGrace is how long the upstream attempt of a request that may be
	// retried goes on after its client leaves, so the SDK's retry can
	// attach to it; its cost is the key's. Default: 5s.
	DedupGrace caddy.Duration `json:"dedup_grace,omitempty"`

	// SettleGrace is how long the relay reads on from an upstream after
	// the client left, for the usage the end of the answer reports: a
	// stream's client that left after part of the content, or a
	// non-streaming request's client that left before the answer. Nothing
	// more reaches the client. Without that usage in time, the output of a
	// stream is estimated from the content the client was sent. The time
	// counts from the client's leaving, and overlaps dedup_grace. 0: do not
	// read on (the output is estimated at once). Default: 2s.
	SettleGrace *caddy.Duration `json:"settle_grace,omitempty"`

	// HoldFloor is the least, in US dollars, that the input of a request
	// with a budget or a spend cap holds when the request pulls input from
	// outside its body (a file_id, a URL source, a container upload, an
	// MCP server, a server tool's results), which the relay cannot count
	// before the upstream does. The hold never exceeds what is left of the
	// tightest budget that applies, so such a request still fits, and
	// others wait for it to settle. Default: the model's context window
	// (200,000 tokens; 1,000,000 with the context-1m beta or a [1m]
	// variant) at its input price.
	HoldFloor *float64 `json:"hold_floor,omitempty"`

	// Tuning holds the default timeouts and cooldowns of every channel.
	Tuning

	// Keys are the relay keys clients authenticate with.
	Keys []*Key `json:"keys,omitempty"`

	// KeysFile is a file of more relay keys, read whenever the config
	// loads: a JSON array of objects of the same form as Keys, or one such
	// object after another (one a line). It keeps a large number of keys out
	// of Caddy's config, which Caddy re-encodes at every load and serves at
	// GET /config/. A reload reads it again (`caddy reload --force` when only
	// the file changed); a file that fails to read fails the load, so the
	// running config stays. Placeholders such as {env.KEYS} are resolved.
	KeysFile string `json:"keys_file,omitempty"`

	// Identity is the placeholder that a Caddy authentication handler
	// running before the relay sets to who the client is, such as
	// `{http.auth.user.id}` (basic_auth and most auth modules): one
	// placeholder of the request (`{http.*}`), nothing around it. When it
	// resolves to a non-empty value, the user entry of that identity (else
	// the `*` entry, else a 401) serves the request, and the client's relay
	// key is neither needed nor looked at; when it resolves empty, the
	// request needs a relay key.
	Identity string `json:"identity,omitempty"`

	// Users are the identities Identity may resolve to, each served by a
	// group as a key is; the id `*` serves every other identity.
	Users []*User `json:"users,omitempty"`

	// Channels are the upstream credentials.
	Channels []*Channel `json:"channels,omitempty"`

	// Groups are sets of channels; each key is served by one group.
	Groups []*Group `json:"groups,omitempty"`

	// Fleet, when set, keeps the state a fleet of relays shares (limits,
	// channel health, heartbeats) in Redis, so that several relays behind
	// one load balancer act as one. Without it, the relay keeps its state
	// in memory and needs nothing.
	Fleet *Fleet `json:"storage,omitempty"`

	// Ledger, when set, records every request of a key or an identity (its
	// tokens, cost, status, ...) in a database, for GET /relay/usage and
	// for finance's own SQL: SQLite on this machine, or PostgreSQL for a
	// fleet. Without it, no such record is kept.
	Ledger *ledger.Config `json:"ledger,omitempty"`

	// UpstreamRatelimitHeaders says what clients learn of rate limits.
	// `replace` (the default): no upstream's anthropic-ratelimit-* header
	// reaches a client (they describe the upstream organisation, which the
	// relay's tenants share), and every answer to a key's request carries
	// anthropic-ratelimit-requests-* and -tokens-* (limit, remaining, reset)
	// of that key's own `rate` and `tokens` limits, for those it has.
	// `pass`: the upstream's headers reach the client unchanged, and the
	// relay adds none. Either way the relay reads the upstream's to stop
	// before an upstream's limit.
	UpstreamRatelimitHeaders string `json:"upstream_ratelimit_headers,omitempty"`

	// Pricing sets the price of models, in US dollars per million tokens,
	// by the model name clients send (a dated snapshot such as
	// claude-sonnet-4-5-20250929 takes the price of claude-sonnet-4-5). It
	// overrides the built-in list prices of the current Claude models.
	Pricing map[string]Price `json:"pricing,omitempty"`

	groups        map[string]*group
	keys          map[[sha256.Size]byte]*key
	fileKeys      []fileKey       // read from KeysFile, until they are provisioned
	declaredAs    string          // the handler's name in its config's declarations
	keysMu        *sync.Mutex     // guards taking keys' state after provisioning, and held
	held          held            // what it took from the process-wide pools, given back by Cleanup
	decode        *decodeBudget   // the node's budget for decoding request bodies (decode.go)
	users         map[string]*key // user entries by id, but user *
	anyUser       *key            // user *; nil: none
	fleet         *member         // the fleet this relay shares state with; nil: none
	ledger        *ledger.Writer  // where each request's row goes; nil: none
	logger        *zap.Logger
	prices        money.Pricebook
	estimates     money.Estimates    // what an unpriced model costs where money is counted
	classRows     []string           // the price rows that are model classes of their own
	modelNames    map[string]bool    // every model a channel lists, for metric labels
	passRatelimit bool               // upstream_ratelimit_headers pass
	secret        *resourceid.Secret // keys the MAC of batch and file ids
	owners        *owners.Store      // which group made each batch and file
	storage       certmagic.Storage  // Caddy's storage; nil in a unit test's context
	dedupWindow   time.Duration      // 0: retries are not attached
	dedupGrace    time.Duration
	settleGrace   time.Duration                           // 0: an attempt whose client left ends at once
	graceTimer    func(time.Duration, func()) *time.Timer // time.AfterFunc; a test's, to end the grace itself
	rand          randIntN
	now           func() time.Time
	affinity      *affinity.Seed // keys the digests of prompt prefixes (affinity.go)
}

const (
	defaultMaxBodySize     = 32 << 20
	defaultMaxResponseSize = 64 << 20
	defaultMaxUploadSize   = 500_000_000
	defaultReadBodyTimeout = 30 * time.Second
	defaultRetries         = 2
)

// CaddyModule returns the Caddy module information.
func (Relay) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay",
		New: func() caddy.Module { return new(Relay) },
	}
}

// Provision resolves secrets, loads transports and takes the channels'
// health state from the process-wide pool.
func (r *Relay) Provision(ctx caddy.Context) error {
	r.keysMu = new(sync.Mutex)
	r.logger = ctx.Logger()
	r.rand = defaultRand
	r.now = time.Now
	if r.MaxBodySize == 0 {
		r.MaxBodySize = defaultMaxBodySize
	}
	if r.MaxResponseSize == 0 {
		r.MaxResponseSize = defaultMaxResponseSize
	}
	if r.MaxUploadSize == 0 {
		r.MaxUploadSize = defaultMaxUploadSize
	}
	if r.ReadBodyTimeout == 0 {
		r.ReadBodyTimeout = caddy.Duration(defaultReadBodyTimeout)
	}
	if r.DecodeMemory == 0 {
		r.DecodeMemory = defaultDecodeMemory
	}
	r.dedupWindow, r.dedupGrace = defaultDedupWindow, cmp.Or(time.Duration(r.DedupGrace), defaultDedupGrace)
	if r.DedupWindow != nil {
		r.dedupWindow = max(time.Duration(*r.DedupWindow), 0)
	}
	r.settleGrace, r.graceTimer = defaultSettleGrace, time.AfterFunc
	if r.SettleGrace != nil {
		r.settleGrace = max(time.Duration(*r.SettleGrace), 0)
	}
	if err := r.validateConfig(); err != nil {
		return err
	}
	r.passRatelimit = r.UpstreamRatelimitHeaders == ratelimitPass
	if err := r.readKeysFile(); err != nil {
		return err
	}
	if err := r.declare(ctx); err != nil {
		return err
	}
	r.warnAccessLog(ctx)
	if clientSetsIdentity(r.Identity) {
		r.logger.Warn(clientIdentityWarning, zap.String("identity", r.Identity))
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return err
	}
	if err := r.joinFleet(ctx); err != nil {
		return err
	}
	if err := r.openLedger(ctx); err != nil {
		return err
	}
	r.storage = configStorage(ctx)
	secret, err := resourceid.NewSecret(r.ResourceSecret, r.fleetClient(), r.storage, r.logger)
	if err != nil {
		return fmt.Errorf("resource_secret: %w", err)
	}
	r.secret = secret
	r.affinity = new(affinity.Seed)
	r.owners = owners.New(r.fleetClient(), r.storage, func() time.Time { return r.now() })
	money.UseStore(configStorage(ctx), r.logger)
	r.held.addSpendStore()
	r.takeDecodeBudget()
	r.prices = money.NewPricebook(r.Pricing, anthropicName)
	r.estimates = r.prices.Estimates(familyOf)
	r.classRows = classRows(r.prices)
	r.modelNames = map[string]bool{}
	for _, cfg := range r.Channels {
		for _, m := range channelModels(cfg) {
			r.modelNames[m] = true
		}
	}

	channels := make(map[string]*channel, len(r.Channels))
	for _, cfg := range r.Channels {
		ch, err := r.provisionChannel(ctx, cfg)
		if err != nil {
			return fmt.Errorf("channel %q: %w", cfg.Name, err)
		}
		channels[cfg.Name] = ch
	}
	if err := r.provisionGroups(channels); err != nil {
		return err
	}
	fileDecls, err := r.provisionKeys()
	if err != nil {
		return err
	}
	if err := r.declareFileKeys(ctx, fileDecls); err != nil {
		return err
	}
	if err := r.provisionUsers(); err != nil {
		return err
	}
	r.warnUnpriced()
	provisionedKeys.add(r)

	// push this config's settings into the channels' surviving state, and
	// start their probes
	groupsOf := r.groupsOf()
	for _, cfg := range r.Channels {
		ch := channels[cfg.Name]
		owner := channelOwner{relay: r, provider: ch.providerName(), groups: groupsOf[cfg.Name], classes: ch.classNames}
		for _, g := range owner.groups {
			owner.queues = append(owner.queues, &r.groups[g].state.queue)
		}
		ch.health.configure(ch.breaker, ch.limits, owner, r.now())
		ch.health.share(r.fleet)
		ch.health.spend.Store(ch.spend)
		if ch.probe != nil {
			go r.runProbes(ctx, ch)
		}
	}
	r.logReady()
	return nil
}

// channelModels lists the client-side model names a channel declares.
func channelModels(cfg *Channel) []string {
	out := make([]string, 0, len(cfg.Models))
	for _, e := range cfg.Models {
		name, _, _ := strings.Cut(e, "=")
		out = append(out, name)
	}
	return out
}

// Cleanup gives back what this instance took from the process-wide pools
// (held.go). On a reload the new config has taken its own references
// first, so surviving channels, groups and keys keep their state.
func (r *Relay) Cleanup() error {
	provisionedKeys.remove(r)
	if r.keysMu != nil {
		r.keysMu.Lock()
		defer r.keysMu.Unlock()
	}
	r.held.release(r)
	r.fleet = nil
	return nil
}

// ServeHTTP implements caddyhttp.MiddlewareHandler. The relay is terminal:
// it answers every request and never calls next. The steps run in one
// direction (route, auth, admit, body, inspect, then select and attempt
// until an answer reaches the client); a request that gets no upstream
// answer committed leaves by one exit, answer.
func (r *Relay) ServeHTTP(w http.ResponseWriter, req *http.Request, _ caddyhttp.Handler) error {
	in := &inbound{id: newRequestID(), start: time.Now(), ask: asked{rawQuery: req.URL.RawQuery, header: req.Header}}
	in.end.begin(in.chainBuf[:0])
	in.tr, req = startSpans(req) // nil without Caddy's tracing (trace.go)
	if repl, ok := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Map(in.placeholder)
	}
	defer r.account(in)
	w = in.rec.install(w, in) // under the Chat Completions writer: it sees what the client gets
	if req.URL.Path == PathChatCompletions {
		in.ask.chat = new(chat)
		cw := newChatWriter(w, in)
		defer cw.finish()
		w = cw
	}
	w.Header().Set("X-Relay-Request-Id", in.id)
	if f := r.serve(w, req, in); f != nil {
		r.answer(w, in, f)
	}
	return nil
}

// serve runs the request path. It returns nil when the client has its
// answer (or is gone), else what to answer.
func (r *Relay) serve(w http.ResponseWriter, req *http.Request, in *inbound) *failure {
	var rerr *relayError
	if in.route, rerr = routeOf(req); rerr != nil {
		return refused(rerr)
	}
	if rerr = r.identify(req, in); rerr != nil {
		return refused(rerr)
	}
	if in.route == routeModels || in.route == routeModel {
		return refused(serveModels(w, req, in))
	}
	if in.route == routeUsage { // the principal's own usage: no upstream, no limit spent
		return refused(r.serveUsage(w, req, in))
	}
	if in.route == routeResource {
		return r.serveResource(w, req, in)
	}
	// the key's slot is taken before the body is read, so a key's slow
	// clients wait for their turn instead of holding memory
	if rerr = r.admitKey(in, req.ContentLength); rerr != nil {
		return refused(rerr)
	}
	defer func() { in.who.state.limits.Done(r.now(), in.grant.keyGrant, in.billed()) }()
	buf, rerr := r.readBody(w, req)
	if rerr != nil {
		return refused(rerr)
	}
	in.bodyBuf, in.ask.body = buf, buf.Bytes()
	defer in.releaseBody()
	if rerr = r.decodeBody(req.Context(), in); rerr != nil {
		return refused(rerr)
	}
	if mayReferenceFiles(in.ask.body) { // it may use uploaded files: only their channel has them
		if rerr = r.pinToFiles(req.Context(), in); rerr != nil {
			return refused(rerr)
		}
	}
	r.chargeKeyTokens(in)
	if rerr = r.admitEndUser(in); rerr != nil {
		return refused(rerr)
	}
	defer func() { // admitted here, or along with its first channel
		if in.grant.endUser != nil {
			in.grant.endUser.Done(r.now(), in.grant.endUserGrant, in.billed())
		}
	}()
	if rerr = r.admitSession(in); rerr != nil {
		return refused(rerr)
	}
	r.degrade(in) // by the tightest budget, the session's among them
	if rerr = r.planHolds(in); rerr != nil {
		return refused(rerr)
	}
	return r.share(w, req, in)
}

// failure is the answer of a request that did not commit an upstream
// answer: the relay's own error, or the last attempt's when attempts ran
// out.
type failure struct {
	err      *relayError   // the relay's answer; nil: the last attempt's
	last     attemptResult // the last attempt, when there was one
	attempts int
}

// refused is the failure of a request the relay answers itself; nil for
// none.
func refused(e *relayError) *failure {
	if e == nil {
		return nil
	}
	return &failure{err: e}
}

// answer is the one exit of a request that did not commit: it writes the
// relay's error, or the last upstream answer unchanged (or, when that
// attempt got none, the relay's 502/504 saying why). After attempts,
// x-relay-attempts says how many. The upstream's x-should-retry reaches
// the client as the upstream sent it, after failovers too: a client such
// as Claude Code decides from it whether a short overload is worth
// another try, and only the relay's own refusals that no retry can cure
// say false.
func (r *Relay) answer(w http.ResponseWriter, in *inbound, f *failure) {
	h := w.Header()
	last := f.last
	if f.attempts > 0 {
		relayHeaders(h, in, last.channel, f.attempts, last.verdict.outcome.Retryable())
		if f.err == nil && last.status == 0 {
			f.err = errUpstreamFailed(last.verdict)
		}
	}
	if f.err != nil {
		in.end.failed(cmp.Or(f.err.cause, causeClient), cmp.Or(f.err.code, f.err.typ))
		r.ratelimitHeaders(h, in)
		f.err.write(w, in.id)
		return
	}
	cause := causeUpstream
	if last.verdict.outcome == outcomeClientError {
		cause = causeClient
	}
	in.end.upstreamAnswered(last.channel, cause)
	copyResponseHeaders(h, last.header, r.passRatelimit)
	r.ratelimitHeaders(h, in)
	h.Set("Content-Length", strconv.Itoa(len(last.body)))
	w.WriteHeader(last.status)
	_, _ = w.Write(last.body)
}

// admitKey holds a request to its key's limits (its identity's, for
// user *) before its body is read:
// concurrency, request rate, and a token limit in debt. A message is
// charged the tokens its Content-Length suggests (none when it has none:
// chargeKeyTokens charges them once the body is read). In a fleet, limits
// that Redis keeps are gated here and admitted with the request's first
// channel, in its one round trip to the store.
func (r *Relay) admitKey(in *inbound, contentLength int64) *relayError {
	estimate := int64(-1) // other routes are not held to the token limit
	if in.route == routeMessages {
		if rerr := r.withinBudget(in, 0); rerr != nil {
			return rerr
		}
		estimate = 0
		if contentLength > 0 {
			estimate = contentLength/4 + 1
		}
	}
	g, scope, wait := in.who.state.limits.Enter(r.now(), estimate) // in a fleet, admitted with its first channel (admit.go)
	switch scope {
	case limits.ScopeNone:
		in.grant.keyGrant, in.grant.keyAsked = g, !g.Pending
		return nil
	case limits.ScopeFleetDown:
		return errStorageUnavailable()
	}
	in.grant.keyGrant, in.grant.keyAsked = g, true // what it has left, for the 429's headers
	metricRateLimited.WithLabelValues(in.who.key.name, string(scope)).Inc()
	return errKeyLimited(in.who.key.describe(), scope, wait)
}

// withinBudget refuses a request whose principal's budget is spent, or
// would be by estimate (USD).
func (r *Relay) withinBudget(in *inbound, estimate float64) *relayError {
	a := in.who.state.spend
	e, over := a.Check(r.now(), estimate)
	if !over {
		return nil
	}
	metricRateLimited.WithLabelValues(in.who.key.name, "budget").Inc()
	return errBudgetExceeded(a.Who(), e.Period, e.Cap, e.Spent, e.Wait, e.Estimate)
}

// chargeKeyTokens brings a message's charge against its key's token limit
// to the estimate from its body, corrected when it ends.
func (r *Relay) chargeKeyTokens(in *inbound) {
	if in.route != routeMessages {
		return
	}
	in.ask.estimate = estimateTokens(in.ask.body)
	in.who.state.limits.Charge(r.now(), &in.grant.keyGrant, in.ask.estimate-in.grant.keyGrant.Charged)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Relay)(nil)
	_ caddy.CleanerUpper          = (*Relay)(nil)
	_ caddyhttp.MiddlewareHandler = (*Relay)(nil)
)
