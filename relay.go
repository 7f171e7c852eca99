// Package relay is a Caddy HTTP handler that puts many upstream Claude
// providers behind one Anthropic-compatible endpoint: a client holds one
// relay key, the key belongs to a group, and the group's channels (one
// upstream credential each) serve its requests with failover before the
// first byte.
package relay

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
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

// group is a provisioned Group.
type group struct {
	name        string
	channels    []*channel
	retries     int
	expose      bool
	models      []string    // models listed by its channels, for GET /v1/models
	state       *groupState // retry budget and queue, kept across reloads
	budgetRatio float64
	budgetFloor float64 // retries per second
	waitMax     time.Duration
	maxQueue    int
	maxWait     [priorityCount]time.Duration
	policy      string
	splits      []groupSplit
	fallbacks   map[string][]string // model -> the models that may serve it
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
		owner := channelOwner{relay: r, provider: cmp.Or(cfg.Provider, providerAnthropic), groups: r.groupsOf(cfg.Name)}
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

// provisionGroups builds the groups and takes their state (retry budget,
// queue) from the process-wide pool.
func (r *Relay) provisionGroups(channels map[string]*channel) error {
	r.groups = make(map[string]*group, len(r.Groups))
	for _, cfg := range r.Groups {
		g := &group{name: cfg.Name, retries: defaultRetries, expose: cfg.ExposeChannel,
			budgetRatio: defaultRetryBudget, budgetFloor: defaultRetryBudgetFloor, waitMax: time.Duration(cfg.WaitForRecovery),
			maxQueue: defaultMaxQueue, maxWait: defaultMaxWait, policy: cmp.Or(cfg.Policy, policyWeighted), fallbacks: cfg.Fallbacks}
		for name, share := range cfg.Splits {
			g.splits = append(g.splits, groupSplit{ch: channels[name], share: share})
		}
		slices.SortFunc(g.splits, func(a, b groupSplit) int { return strings.Compare(a.ch.name, b.ch.name) })
		if cfg.Retries != nil {
			g.retries = *cfg.Retries
		}
		if cfg.RetryBudget != nil {
			g.budgetRatio = *cfg.RetryBudget
		}
		if cfg.RetryBudgetFloor != nil {
			g.budgetFloor = *cfg.RetryBudgetFloor
		}
		if cfg.MaxQueue != 0 {
			g.maxQueue = max(cfg.MaxQueue, 0)
		}
		for class, d := range cfg.MaxWait {
			p, _ := priorityByName(class)
			g.maxWait[p] = time.Duration(d)
		}
		st, _, err := groupStates.LoadOrNew(cfg.Name, func() (caddy.Destructor, error) { return new(groupState), nil })
		if err != nil {
			return err
		}
		r.acquiredGroups = append(r.acquiredGroups, cfg.Name)
		g.state = st.(*groupState)
		for _, name := range cfg.Channels {
			ch := channels[name]
			g.channels = append(g.channels, ch)
			for _, m := range ch.modelNames {
				if !slices.Contains(g.models, m) {
					g.models = append(g.models, m)
				}
			}
		}
		r.groups[cfg.Name] = g
	}
	return nil
}

// provisionKeys resolves the keys' secrets into the digests they are looked
// up by, and takes their limiters from the process-wide pool.
func (r *Relay) provisionKeys() error {
	r.keys = make(map[[sha256.Size]byte]*key, len(r.Keys))
	for i, cfg := range r.Keys {
		digest, weak, err := keyDigest(cfg.Secret)
		if err != nil {
			return fmt.Errorf("%s: %w", cfg.label(i), err)
		}
		if weak {
			r.logger.Warn(weakKeyWarning, zap.String("key", cfg.label(i)))
		}
		if _, dup := r.keys[digest]; dup {
			return fmt.Errorf("%s has the same secret as an earlier key", cfg.label(i))
		}
		k := &key{name: cfg.Name, group: r.groups[cfg.Group]}
		if k.name == "" {
			k.name = "key-" + hex.EncodeToString(digest[:8])
		}
		k.prio, _ = priorityByName(cfg.Priority)
		lim, _ := parseLimits(cfg.Rate, cfg.Tokens, cfg.Concurrency) // validated already
		st, _, err := keyStates.LoadOrNew(k.name, func() (caddy.Destructor, error) { return new(limiter), nil })
		if err != nil {
			return err
		}
		r.acquiredKeys = append(r.acquiredKeys, k.name)
		k.limits = st.(*limiter)
		k.limits.configure(lim, time.Now())
		r.keys[digest] = k
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

// keyDigest resolves a key's secret and returns the sha256 it is looked up
// by, and whether the secret is weak (see weakKey); `sha256:<hex>` gives the
// digest directly, which cannot be judged.
func keyDigest(secret string) (d [sha256.Size]byte, weak bool, err error) {
	if hexDigest, ok := strings.CutPrefix(secret, sha256Prefix); ok {
		b, err := hex.DecodeString(hexDigest)
		if err != nil || len(b) != sha256.Size {
			return d, false, fmt.Errorf("sha256: must be followed by 64 hex digits")
		}
		copy(d[:], b)
		return d, false, nil
	}
	v, err := resolveSecret(secret)
	if err != nil {
		return d, false, err
	}
	return sha256.Sum256([]byte(v)), weakKey(v), nil
}

// weakKey reports whether a key secret is guessable: shorter than 20
// characters, or made of fewer than 10 different ones. Keys are looked up by
// their unsalted sha256, which GET /config/ may show and the default key
// name partly does, and the relay does not throttle failed guesses.
func weakKey(secret string) bool {
	if len(secret) < 20 {
		return true
	}
	var seen [256]bool
	distinct := 0
	for i := 0; i < len(secret); i++ {
		if !seen[secret[i]] {
			seen[secret[i]] = true
			distinct++
		}
	}
	return distinct < 10
}

const weakKeyWarning = "a relay key is weak (under 20 characters, or fewer than 10 different ones): it can be guessed; use a long random key such as the output of: openssl rand -hex 24"

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

// attemptResult is how one attempt ended. When done, the client has its
// answer (or is gone); otherwise the relay may try another channel, and
// status, header and body hold the upstream's answer for the client in case
// this attempt stays the last one (status 0: there was no answer).
type attemptResult struct {
	verdict   verdict
	done      bool
	channel   *channel
	firstByte time.Duration // until the upstream's response headers
	status    int
	header    http.Header
	body      []byte
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

// queued is a request's place in its group's queue, once it has one.
type queued struct {
	r  *Relay
	g  *group
	in *inbound
	w  *waiter
}

// wait queues the request (when not queued yet) and waits for its turn,
// the time a busy channel frees up (freeAt; zero when unknown), or its
// class's max_wait. A non-nil error is the answer: the queue is full or
// disabled, the wait ran out, or the client left.
func (q *queued) wait(ctx context.Context, freeAt time.Time) *relayError {
	g, in, now := q.g, q.in, q.r.now()
	retryIn := time.Duration(0)
	if !freeAt.IsZero() {
		retryIn = freeAt.Sub(now)
	}
	refuse := func(msg string) *relayError {
		metricRateLimited.WithLabelValues(in.key.name, string(scopeQueue)).Inc()
		return errQueue(msg, retryIn)
	}
	if q.w == nil {
		if g.maxQueue <= 0 {
			return refuse("every channel of group " + strconv.Quote(g.name) + " is at its limit")
		}
		w, ok := g.state.queue.enqueue(in.key.prio, g.maxQueue, now)
		if !ok {
			return refuse("every channel of group " + strconv.Quote(g.name) + " is at its limit and its queue is full")
		}
		q.w = w
		metricQueueDepth.WithLabelValues(g.name, in.key.prio.String()).Inc()
	}
	deadline := q.w.since.Add(g.maxWait[in.key.prio])
	if _, err := g.state.queue.wait(ctx, q.w, freeAt, deadline, q.r.now); err != nil {
		if err == errQueueTimeout {
			return refuse("waited " + g.maxWait[in.key.prio].String() + " (max_wait of class " + in.key.prio.String() + ") for a channel of group " + strconv.Quote(g.name))
		}
		return &relayError{status: statusClientClosed, typ: "api_error", msg: "client left while queued"}
	}
	return nil
}

// leave takes the request out of the queue, if it is in it.
func (q *queued) leave() {
	if q.w == nil {
		return
	}
	q.g.state.queue.leave(q.w)
	p := q.in.key.prio.String()
	metricQueueDepth.WithLabelValues(q.g.name, p).Dec()
	metricQueueWait.WithLabelValues(q.g.name, p).Observe(q.r.now().Sub(q.w.since).Seconds())
	q.w = nil
}

// try runs one admitted attempt and records its verdict in the channel's
// health. The ticket is released on every path, a panic included.
func (r *Relay) try(w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int, t *ticket) attemptResult {
	defer t.release()
	start := time.Now()
	res := r.attempt(w, req, in, ch, n)
	v := res.verdict
	in.chain = append(in.chain, attemptRecord{channel: ch.name, outcome: v.outcome, duration: time.Since(start)})
	metricAttempts.WithLabelValues(ch.name, v.outcome.String()).Inc()
	if res.firstByte > 0 {
		metricFirstByte.WithLabelValues(ch.name).Observe(res.firstByte.Seconds())
	}
	var tokens int64
	if in.answered == ch {
		tokens = in.billed()
	}
	if cooled := t.finish(v, ch.cooldown, r.now(), res.firstByte, tokens); cooled > 0 {
		r.logger.Warn("channel cooling down",
			zap.String("channel", ch.name),
			zap.String("outcome", v.outcome.String()),
			zap.String("reason", v.reason),
			zap.Duration("cooldown", cooled),
			zap.String("request_id", in.id))
	}
	return res
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

// maxErrorBody bounds how much of an upstream error body is read.
const maxErrorBody = 1 << 20

// attempt sends the request to ch once and, when the answer proves itself,
// commits it to the client.
func (r *Relay) attempt(w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int) attemptResult {
	ctx, cancel := context.WithCancelCause(req.Context())
	defer cancel(nil)
	in.usage = usage{} // only the answer that reaches the client counts
	fail := func(err error) attemptResult {
		return attemptResult{verdict: classifyError(ctx, req.Context(), err), channel: ch}
	}

	upReq, err := ch.provider.newRequest(ctx, ch, in)
	if err != nil {
		return fail(err)
	}
	dl := &deadline{cancel: cancel}
	if in.stream {
		dl.start(stageFirstByte, ch.firstByte)
	} else {
		dl.start(stageResponse, ch.response)
	}
	defer dl.stop()

	sent := time.Now()
	resp, err := ch.rt.RoundTrip(upReq)
	if err != nil {
		return fail(err)
	}
	firstByteTime := time.Since(sent) // before a provider reads an error body
	defer resp.Body.Close()
	if resp, err = ch.provider.response(resp, in); err != nil {
		return fail(err)
	}
	defer resp.Body.Close() // the provider may have replaced it
	ch.health.observeQuota(resp.Header, r.now(), ch.cooldown.max)

	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		if err != nil {
			return fail(err)
		}
		v := classifyStatus(resp.StatusCode, resp.Header, body, r.now())
		if refusesModel(resp.StatusCode, body, providerRefusedModel(resp), ch.upstreamModel(in.target)) {
			v.outcome, v.reason, v.model = outcomeModelRefused, "model refused", in.target
		}
		res := attemptResult{verdict: v, channel: ch, firstByte: firstByteTime, status: resp.StatusCode, header: resp.Header, body: body}
		if !v.outcome.retryable() {
			r.writeLast(w, in, res, n)
			res.done = true
		}
		return res
	}

	if isEventStream(resp.Header) {
		// until the first event, both its limit (from sending) and the first
		// content limit (from these headers) run; the tighter one applies
		dl.headers = time.Now()
		if left := ch.firstByte - firstByteTime; left < ch.firstContent {
			dl.arm(stageFirstByte, left)
		} else {
			dl.arm(stageFirstContent, ch.firstContent)
		}
		s := &streamAttempt{r: r, w: w, in: in, ch: ch, n: n, ctx: ctx, clientCtx: req.Context(), deadline: dl, resp: resp}
		res := s.run()
		res.firstByte = firstByteTime
		return res
	}

	buf := bodyPool.Get().(*bytes.Buffer)
	defer releaseBody(buf)
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, r.MaxResponseSize+1)); err != nil {
		return fail(err)
	}
	if int64(buf.Len()) > r.MaxResponseSize {
		return fail(errResponseTooLarge)
	}
	dl.stop()
	in.usage.fromMessage(buf.Bytes())
	in.committed(ch, resp.StatusCode)
	r.commitHeaders(w, in, ch, n, resp)
	w.Header().Set("Content-Length", strconv.Itoa(buf.Len()))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(buf.Bytes())
	return attemptResult{verdict: verdict{outcome: outcomeSuccess, reason: "status " + strconv.Itoa(resp.StatusCode)}, done: true, firstByte: firstByteTime}
}

// stage is a part of an attempt with its own time limit.
type stage uint32

const (
	stageResponse     stage = iota // non-streaming: until the whole body
	stageFirstByte                 // streaming: until the first event
	stageFirstContent              // streaming: from the headers until the first content event
	stageIdle                      // streaming, after the commit point: between two events
)

var stageCauses = [...]error{errResponseTimeout, errFirstByteTimeout, errFirstContentTimeout, errStreamIdle}

// deadline cancels an attempt when its current stage runs out of time:
// one timer per attempt, re-armed at each stage with the cause it will
// cancel with.
type deadline struct {
	timer   *time.Timer
	stage   atomic.Uint32
	cancel  context.CancelCauseFunc
	headers time.Time // when a stream's response headers arrived
}

func (d *deadline) start(s stage, limit time.Duration) {
	d.stage.Store(uint32(s))
	d.timer = time.AfterFunc(limit, d.fire)
}

func (d *deadline) fire() { d.cancel(stageCauses[d.stage.Load()]) }

// arm starts stage s with limit left.
func (d *deadline) arm(s stage, limit time.Duration) {
	d.stage.Store(uint32(s))
	d.timer.Reset(max(limit, 0))
}

func (d *deadline) stop() { d.timer.Stop() }

// commitHeaders sets the response headers of a committed answer: the
// upstream's (without hop-by-hop ones) and the relay's own.
func (r *Relay) commitHeaders(w http.ResponseWriter, in *inbound, ch *channel, n int, resp *http.Response) {
	h := w.Header()
	copyResponseHeaders(h, resp.Header)
	h.Del("Content-Length")
	relayHeaders(h, in, ch, n, false)
}

// relayHeaders sets the relay's own response headers: the channel that
// answered (with expose_channel), the attempts when there were several (or
// when they ran out), and the model that served, when a fallback did.
func relayHeaders(h http.Header, in *inbound, ch *channel, attempts int, ranOut bool) {
	if in.key.group.expose && ch != nil {
		h.Set("X-Relay-Channel", ch.name)
	}
	if attempts > 1 || ranOut {
		h.Set("X-Relay-Attempts", strconv.Itoa(attempts))
	}
	if in.target != in.model {
		h.Set("X-Relay-Model", in.target)
	}
}

func isEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	return strings.HasPrefix(strings.ToLower(strings.TrimSpace(ct)), "text/event-stream")
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Relay)(nil)
	_ caddy.CleanerUpper          = (*Relay)(nil)
	_ caddyhttp.MiddlewareHandler = (*Relay)(nil)
)
