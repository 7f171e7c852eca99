// Package relay is a Caddy HTTP handler that puts many upstream Claude
// providers behind one Anthropic-compatible endpoint: a client holds one
// relay key, the key belongs to a group, and the group's channels (one
// upstream credential each) serve its requests with failover before the
// first byte.
package relay

import (
	"context"
	"crypto/sha256"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Relay{})
}

// Relay is the `relay` HTTP handler. It serves POST /v1/messages (streaming
// or not) and POST /v1/messages/count_tokens by relaying them to a channel
// of the key's group, and answers GET /v1/models itself.
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

	// MaxResponseSize is the largest non-streaming upstream answer the relay
	// reads, in bytes; a larger one fails the attempt as a broken answer.
	// Streams are forwarded event by event and bounded per event only.
	// Default: 64 MiB.
	MaxResponseSize int64 `json:"max_response_size,omitempty"`

	// Tuning holds the default timeouts and cooldowns of every channel.
	Tuning

	// Keys are the relay keys clients authenticate with.
	Keys []*Key `json:"keys,omitempty"`

	// Channels are the upstream credentials.
	Channels []*Channel `json:"channels,omitempty"`

	// Groups are sets of channels; each key is served by one group.
	Groups []*Group `json:"groups,omitempty"`

	// Pricing sets the price of models, in US dollars per million tokens,
	// by the model name clients send (a dated snapshot such as
	// claude-sonnet-4-5-20250929 takes the price of claude-sonnet-4-5). It
	// overrides the built-in list prices of the current Claude models.
	Pricing map[string]Price `json:"pricing,omitempty"`

	groups             map[string]*group
	keys               map[[sha256.Size]byte]*key
	acquired           []*channel // channelStates entries this instance holds
	acquiredGroups     []string   // groupStates entries this instance holds
	acquiredKeys       []string   // keyStates entries this instance holds
	acquiredTransports []string   // transports entries this instance holds
	logger             *zap.Logger
	prices             pricebook
	modelNames         map[string]bool // every model a channel lists, for metric labels
	rand               randIntN
	now                func() time.Time
}

const (
	defaultMaxBodySize     = 32 << 20
	defaultMaxResponseSize = 64 << 20
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
	r.logger = ctx.Logger()
	r.rand = defaultRand
	r.now = time.Now
	if r.MaxBodySize == 0 {
		r.MaxBodySize = defaultMaxBodySize
	}
	if r.MaxResponseSize == 0 {
		r.MaxResponseSize = defaultMaxResponseSize
	}
	if r.ReadBodyTimeout == 0 {
		r.ReadBodyTimeout = caddy.Duration(defaultReadBodyTimeout)
	}
	if err := r.validateConfig(); err != nil {
		return err
	}
	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return err
	}
	r.prices = newPricebook(r.Pricing)
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
	if err := r.provisionKeys(); err != nil {
		return err
	}

	// push this config's settings into the channels' surviving state, and
	// start their probes
	for _, cfg := range r.Channels {
		ch := channels[cfg.Name]
		owner := channelOwner{relay: r, provider: ch.providerName(), groups: r.groupsOf(cfg.Name)}
		for _, g := range owner.groups {
			owner.queues = append(owner.queues, &r.groups[g].state.queue)
		}
		ch.health.configure(ch.breaker, ch.limits, owner)
		if ch.probe != nil {
			go r.runProbes(ctx, ch)
		}
	}
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

// Cleanup releases the health states this instance took. On a reload the
// new config has taken its own references first, so surviving channels keep
// their state.
func (r *Relay) Cleanup() error {
	for _, ch := range r.acquired {
		ch.health.release(r)
		_, _ = channelStates.Delete(ch.name)
	}
	for _, name := range r.acquiredGroups {
		_, _ = groupStates.Delete(name)
	}
	for _, name := range r.acquiredKeys {
		_, _ = keyStates.Delete(name)
	}
	for _, k := range r.acquiredTransports {
		_, _ = transports.Delete(k)
	}
	r.acquired, r.acquiredGroups, r.acquiredKeys, r.acquiredTransports = nil, nil, nil, nil
	return nil
}

// ServeHTTP implements caddyhttp.MiddlewareHandler. The relay is terminal:
// it answers every request and never calls next. The steps run in one
// direction: route, auth, body, inspect, then select and attempt until an
// answer reaches the client.
func (r *Relay) ServeHTTP(w http.ResponseWriter, req *http.Request, _ caddyhttp.Handler) error {
	in := &inbound{id: newRequestID(), start: time.Now(), rawQuery: req.URL.RawQuery, header: req.Header}
	in.chain = in.chainBuf[:0]
	if repl, ok := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Map(in.placeholder)
	}
	defer r.account(in)
	w.Header().Set("X-Relay-Request-Id", in.id)

	var rerr *relayError
	if in.route, rerr = routeOf(req); rerr != nil {
		in.reply(w, rerr)
		return nil
	}
	if in.key, rerr = r.authenticate(req); rerr != nil {
		in.reply(w, rerr)
		return nil
	}
	if in.route == routeModels || in.route == routeModel {
		serveModels(w, req, in)
		return nil
	}
	// the key's slot is taken before the body is read, so a key's slow
	// clients wait for their turn instead of holding memory
	if rerr = r.admitKey(in); rerr != nil {
		in.reply(w, rerr)
		return nil
	}
	defer func() { in.key.limits.done(r.now(), in.estimate, in.billed()) }()
	buf, rerr := r.readBody(w, req)
	if rerr != nil {
		in.reply(w, rerr)
		return nil
	}
	in.bodyBuf, in.body = buf, buf.Bytes()
	defer in.releaseBody()
	if rerr = in.inspect(); rerr != nil {
		in.reply(w, rerr)
		return nil
	}
	if rerr = r.chargeKeyTokens(in); rerr != nil {
		in.reply(w, rerr)
		return nil
	}
	r.relay(w, req, in)
	return nil
}

// admitKey holds a request to its key's concurrency and request rate,
// which need nothing of its body.
func (r *Relay) admitKey(in *inbound) *relayError {
	scope, wait := in.key.limits.takeSlot(r.now())
	if scope == scopeNone {
		return nil
	}
	return keyLimited(in, scope, wait)
}

// chargeKeyTokens holds an admitted request to its key's token limit: it
// is charged an estimate from its body now, corrected when it ends.
func (r *Relay) chargeKeyTokens(in *inbound) *relayError {
	if in.route != routeMessages {
		return nil
	}
	estimate := estimateTokens(in.body)
	scope, wait := in.key.limits.chargeTokens(r.now(), estimate)
	if scope == scopeNone {
		in.estimate = estimate
		return nil
	}
	return keyLimited(in, scope, wait)
}

// keyLimited counts and answers a request a limit of its key refused.
func keyLimited(in *inbound, scope limitScope, wait time.Duration) *relayError {
	metricRateLimited.WithLabelValues(in.key.name, string(scope)).Inc()
	return errKeyLimited(in.key.name, scope, wait)
}

// relay selects a channel and attempts the request on it until one answer
// reaches the client, failing over to untried channels on retryable
// outcomes, within the group's retries and retry budget.
func (r *Relay) relay(w http.ResponseWriter, req *http.Request, in *inbound) {
	g := in.key.group
	g.state.budget.request(r.now())
	var triedBuf [4]*channel
	sel := selection{model: in.model, caps: in.caps, tried: triedBuf[:0], rand: r.rand}
	if g.policy == policySticky || len(g.splits) > 0 {
		sel.session = in.sessionID()
	}
	var last attemptResult
	var notLive *relayError // why the requested model could not be served, when a fallback was tried
	var recoveryDeadline time.Time
	q := &queued{r: r, g: g, in: in}
	defer q.leave()
	for n := 1; ; {
		sel.now = r.now()
		// a newcomer does not overtake the queued requests of its class or better
		if n == 1 && q.w == nil && g.maxQueue > 0 && g.state.queue.ahead(in.key.prio) {
			if rerr := q.wait(req.Context(), time.Time{}); rerr != nil {
				in.reply(w, rerr)
				return
			}
			continue
		}
		ch, rerr := g.pick(&sel)
		if ch == nil && (rerr == nil || rerr.code == "no_healthy_channel") {
			// no channel of this model is live: a similar model may serve
			if next := g.fallbacks[in.model]; in.fallbacks < len(next) {
				if notLive == nil {
					notLive = rerr
				}
				metricFallbacks.WithLabelValues(g.name, r.modelLabel(sel.model), r.modelLabel(next[in.fallbacks])).Inc()
				in.target, sel.model = next[in.fallbacks], next[in.fallbacks]
				in.fallbacks++
				continue
			}
		}
		if ch == nil {
			if n > 1 { // every channel it could use is tried, cooling or busy
				r.writeLast(w, in, last, n-1)
				return
			}
			if notLive != nil && rerr != nil && rerr.code != codeBusy {
				rerr = notLive // the fallbacks could not serve either: say why the model could not
			}
			if rerr = r.await(req.Context(), q, rerr, sel.now, &recoveryDeadline); rerr != nil {
				in.reply(w, rerr)
				return
			}
			continue
		}
		if n > 1 && !g.state.budget.allowRetry(sel.now, g.budgetRatio, g.budgetFloor) {
			r.logger.Debug("retry budget exhausted", zap.String("group", g.name), zap.String("request_id", in.id))
			r.writeLast(w, in, last, n-1)
			return
		}
		t, busy := ch.health.admit(sel.now, in.estimate)
		if t == nil {
			if !busy { // its half-open breaker is busy with other probes
				sel.skipped = append(sel.skipped, ch)
			}
			continue // busy: another request took its last slot; pick again
		}
		q.leave()
		sel.tried = append(sel.tried, ch)
		in.attempts = n
		if n > 1 {
			metricFailovers.WithLabelValues(g.name).Inc()
		}
		res := r.try(w, req, in, ch, n, t)
		if res.done || res.verdict.outcome == outcomeCanceled {
			// answered, or the client is gone: nobody is left to fail over
			// for, and a departure spends no retry budget
			return
		}
		last = res
		if n > g.retries {
			r.writeLast(w, in, last, n)
			return
		}
		if res.verdict.outcome == outcomeOverloaded {
			sel.avoidHost = ch.host
		}
		n++
	}
}

// await decides what a request whose first pick found no channel does:
// wait in the queue when every channel is busy, wait for a recovery when
// every channel cools and the group allows it, or answer with why. A nil
// error means: pick again.
func (r *Relay) await(ctx context.Context, q *queued, why *relayError, now time.Time, recoveryDeadline *time.Time) *relayError {
	switch {
	case why.code == codeBusy:
		var freeAt time.Time // zero: only a finishing attempt will tell
		if why.retryAfter > 0 {
			freeAt = now.Add(why.retryAfter)
		}
		return q.wait(ctx, freeAt)
	case why.code == "no_healthy_channel" && q.g.waitMax > 0:
		if recoveryDeadline.IsZero() {
			*recoveryDeadline = now.Add(q.g.waitMax)
		}
		if r.waitForRecovery(ctx, why.retryAfter, *recoveryDeadline) {
			return nil
		}
	}
	return why
}

// recoveryPoll bounds one wait for a recovering channel, so that a channel
// brought back early (by a probe or the admin API) is noticed soon.
const recoveryPoll = 100 * time.Millisecond

// waitForRecovery waits until the first channel should have recovered (at
// most until deadline, and at most recoveryPoll at a time) and reports
// whether the request should look again.
func (r *Relay) waitForRecovery(ctx context.Context, recovery time.Duration, deadline time.Time) bool {
	left := deadline.Sub(r.now())
	if left <= 0 {
		return false
	}
	d := min(left, recoveryPoll)
	if recovery > 0 {
		d = min(d, recovery)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// writeLast answers with the last failed attempt when no further attempt is
// possible: the upstream's own answer unchanged, or the relay's error when
// there was none. x-should-retry: false tells the SDKs not to multiply the
// relay's retries with their own.
func (r *Relay) writeLast(w http.ResponseWriter, in *inbound, last attemptResult, attempts int) {
	h := w.Header()
	relayHeaders(h, in, last.channel, attempts, last.verdict.outcome.retryable())
	if last.status == 0 {
		in.reply(w, errUpstreamFailed(last.verdict, attempts > 1))
		return
	}
	in.status, in.answered = last.status, last.channel
	copyResponseHeaders(h, last.header)
	if attempts > 1 {
		h.Set("X-Should-Retry", "false")
	}
	h.Set("Content-Length", strconv.Itoa(len(last.body)))
	w.WriteHeader(last.status)
	_, _ = w.Write(last.body)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Relay)(nil)
	_ caddy.CleanerUpper          = (*Relay)(nil)
	_ caddyhttp.MiddlewareHandler = (*Relay)(nil)
)
