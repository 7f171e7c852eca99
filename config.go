package relay

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
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

// validateConfig checks what can be checked without resolving secrets. The
// Caddyfile adapter runs it too, so `caddy adapt` reports these errors.
func (r *Relay) validateConfig() error {
	if r.MaxBodySize < 0 || r.MaxResponseSize < 0 || r.MaxUploadSize < 0 || r.ReadBodyTimeout < 0 || r.DecodeMemory < 0 {
		return fmt.Errorf("max_body_size, max_response_size, max_upload_size, read_body_timeout and decode_memory must not be negative")
	}
	if err := r.Tuning.validate(); err != nil {
		return err
	}
	if r.Ledger != nil {
		if err := r.Ledger.validate(); err != nil {
			return errAt([]string{"ledger"}, "%v", err)
		}
	}
	switch r.UpstreamRatelimitHeaders {
	case "", ratelimitReplace, ratelimitPass:
	default:
		return errAt([]string{"upstream_ratelimit_headers"}, "upstream_ratelimit_headers must be replace or pass, not %q", r.UpstreamRatelimitHeaders)
	}
	channels := make(map[string]*Channel, len(r.Channels))
	for i, ch := range r.Channels {
		if ch == nil || ch.Name == "" {
			return fmt.Errorf("channel #%d has no name", i+1)
		}
		if _, dup := channels[ch.Name]; dup {
			return errAt([]string{"channel", ch.Name}, "channel %q is defined twice", ch.Name)
		}
		channels[ch.Name] = ch
		if err := ch.validate(); err != nil {
			return within(err, fmt.Sprintf("channel %q", ch.Name), "channel", ch.Name)
		}
	}
	groups := make(map[string]bool, len(r.Groups))
	for i, g := range r.Groups {
		if g == nil || g.Name == "" {
			return fmt.Errorf("group #%d has no name", i+1)
		}
		if groups[g.Name] {
			return errAt([]string{"group", g.Name}, "group %q is defined twice", g.Name)
		}
		groups[g.Name] = true
		if err := g.validate(channels); err != nil {
			return within(err, "", "group", g.Name)
		}
	}
	for model, p := range r.Pricing {
		if !validModelName(model) {
			return errAt([]string{"pricing", model}, "pricing: %q is not a model name", model)
		}
		if err := p.Validate(); err != nil {
			return errAt([]string{"pricing", model}, "pricing %q: %v", model, err)
		}
	}
	if len(r.Keys) == 0 && len(r.Users) == 0 && r.KeysFile == "" {
		return fmt.Errorf("no key is configured: every request would be refused")
	}
	names := make(map[string]string, len(r.Keys)+len(r.Users)) // name -> what has it
	for i, k := range r.Keys {
		key := []string{"key", "#" + strconv.Itoa(i+1)}
		if err := k.check(i, groups); err != nil {
			return within(err, "", key...)
		}
		if k.Name != "" {
			if was, dup := names[k.Name]; dup {
				return errAt(append(key, "name"), "%s and key #%d have the same name %q", was, i+1, k.Name)
			}
			names[k.Name] = "key #" + strconv.Itoa(i+1)
		}
	}
	return r.validateUsers(groups, names)
}

// check checks the key at i of the config or of the keys file, but for the
// names it shares with the others. Where an error is, is relative to the
// key.
func (k *Key) check(i int, groups map[string]bool) error {
	if k == nil || k.Secret == "" {
		return errAt(nil, "key #%d has no secret", i+1)
	}
	if k.Group == "" {
		return errAt(nil, "%s names no group", k.label(i))
	}
	if !groups[k.Group] {
		return errAt([]string{k.Group}, "%s names unknown group %q", k.label(i), k.Group)
	}
	if hexDigest, ok := strings.CutPrefix(k.Secret, sha256Prefix); ok {
		if _, ok := decodeDigest(hexDigest); !ok {
			return errAt(nil, "%s: sha256: must be followed by 64 hex digits", k.label(i))
		}
	}
	if err := k.KeyOptions.validate(); err != nil {
		return within(err, k.label(i))
	}
	if strings.HasPrefix(k.Name, userStatePrefix) {
		return errAt([]string{"name"}, "%s: a key's name may not start with %q, which names user entries", k.label(i), userStatePrefix)
	}
	for _, prefix := range [...]string{money.GroupPrefix, money.ChannelPrefix, sessionSpendPrefix} {
		if strings.HasPrefix(k.Name, prefix) {
			return errAt([]string{"name"}, "%s: a key's name may not start with %q, which names the spend of groups and channels", k.label(i), prefix)
		}
	}
	return nil
}

// validateUsers checks the identity placeholder and the user entries;
// names are the names of the keys, which theirs may not take.
func (r *Relay) validateUsers(groups map[string]bool, names map[string]string) error {
	switch {
	case r.Identity != "" && !requestPlaceholder(r.Identity):
		// anything else could resolve to an identity for a request no
		// handler authenticated, which would then need no key
		return errAt([]string{"identity"}, "identity must be one placeholder of the request that an authentication handler sets, such as {http.auth.user.id}, not %q", r.Identity)
	case r.Identity != "" && len(r.Users) == 0:
		return errAt([]string{"identity"}, "identity is set but no user entry is: every authenticated request would be refused (add user <id> <group>, or user * <group>)")
	case r.Identity == "" && len(r.Users) > 0:
		return errAt([]string{"user", "#1"}, "user entries need identity <placeholder>, such as identity {http.auth.user.id}, to know who the client is")
	}
	ids := make(map[string]bool, len(r.Users))
	for i, u := range r.Users {
		at := []string{"user", "#" + strconv.Itoa(i+1)}
		if u == nil || u.ID == "" {
			return errAt(at, "user #%d has no id", i+1)
		}
		label := u.label()
		if ids[u.ID] {
			return errAt(at, "%s is given twice", label)
		}
		ids[u.ID] = true
		if u.Group == "" {
			return errAt(at, "%s names no group", label)
		}
		if !groups[u.Group] {
			return errAt(append(at, u.Group), "%s names unknown group %q", label, u.Group)
		}
		if err := u.KeyOptions.validate(); err != nil {
			return within(err, label, at...)
		}
		name := cmp.Or(u.Name, userStatePrefix+u.ID)
		if was, dup := names[name]; dup {
			return errAt(append(at, "name"), "%s and %s have the same name %q", was, label, name)
		}
		names[name] = label
	}
	return nil
}

// requestPlaceholder reports whether s is exactly one placeholder of the
// request ({http.*}), which resolves empty when nothing set it.
func requestPlaceholder(s string) bool {
	name, ok := strings.CutPrefix(s, "{")
	name, closed := strings.CutSuffix(name, "}")
	return ok && closed && strings.HasPrefix(name, "http.") && !strings.ContainsAny(name, "{}")
}

// validate checks a key's or a user entry's options, saying which is
// wrong.
func (o *KeyOptions) validate() error {
	if _, ok := priorityByName(o.Priority); !ok {
		return errAt([]string{"priority"}, "priority must be realtime, normal or batch, not %q", o.Priority)
	}
	if err := checkLimits(o.Rate, o.Tokens, o.Concurrency); err != nil {
		return err
	}
	if _, err := limits.ParseRate(o.UserRate); err != nil {
		return errAt([]string{"user_rate"}, "user_rate: %v", err)
	}
	if _, err := limits.ParseRate(o.UserTokens); err != nil {
		return errAt([]string{"user_tokens"}, "user_tokens: %v", err)
	}
	if _, err := money.ParseBudgets(o.Budgets); err != nil {
		return errAt([]string{"budget"}, "%v", err)
	}
	if o.BudgetWarn < 0 || o.BudgetWarn > 1 {
		return errAt([]string{"budget_warn"}, "budget_warn must be a share between 0 and 1 (or 0%% to 100%%)")
	}
	if err := checkDegrade(o.BudgetDegrade); err != nil {
		return errAt([]string{"budget_degrade"}, "%v", err)
	}
	if _, err := parseExpires(o.Expires); err != nil {
		return errAt([]string{"expires"}, "expires: %v", err)
	}
	return o.SessionLimits.validate()
}

// validate checks a group against the channels of its config.
func (g *Group) validate(channels map[string]*Channel) error {
	if len(g.Channels) == 0 {
		return fmt.Errorf("group %q lists no channels", g.Name)
	}
	seen := make(map[string]bool, len(g.Channels))
	for _, name := range g.Channels {
		if channels[name] == nil {
			return errAt([]string{"channels", name}, "group %q names unknown channel %q", g.Name, name)
		}
		if seen[name] {
			return errAt([]string{"channels", name}, "group %q lists channel %q twice", g.Name, name)
		}
		seen[name] = true
	}
	if g.Retries != nil && *g.Retries < 0 {
		return errAt([]string{"retries"}, "group %q: retries must not be negative", g.Name)
	}
	if g.RetryBudget != nil && (*g.RetryBudget < 0 || *g.RetryBudget > 1) {
		return errAt([]string{"retry_budget"}, "group %q: retry_budget must be between 0 and 1 (0%% to 100%%)", g.Name)
	}
	if g.RetryBudgetFloor != nil && *g.RetryBudgetFloor < 0 {
		return errAt([]string{"retry_budget"}, "group %q: retry_budget_floor must not be negative", g.Name)
	}
	if _, err := money.ParseBudgets(g.Budgets); err != nil {
		return errAt([]string{"budget"}, "group %q: %v", g.Name, err)
	}
	if g.BudgetWarn < 0 || g.BudgetWarn > 1 {
		return errAt([]string{"budget_warn"}, "group %q: budget_warn must be a share between 0 and 1 (or 0%% to 100%%)", g.Name)
	}
	if err := g.SessionLimits.validate(); err != nil {
		return within(err, "group "+strconv.Quote(g.Name))
	}
	if err := checkDegrade(g.BudgetDegrade); err != nil {
		return errAt([]string{"budget_degrade"}, "group %q: %v", g.Name, err)
	}
	if g.WaitForRecovery < 0 {
		return errAt([]string{"wait_for_recovery"}, "group %q: wait_for_recovery must not be negative", g.Name)
	}
	switch g.ThinkingFailover {
	case "", thinkingFailoverStrip:
	default:
		return errAt([]string{"thinking_failover"}, "group %q: thinking_failover is %q or unset, not %q", g.Name, thinkingFailoverStrip, g.ThinkingFailover)
	}
	switch g.Policy {
	case "", policyWeighted, policyAdaptive, policySticky:
	default:
		return errAt([]string{"policy"}, "group %q: unknown policy %q (weighted, adaptive, sticky)", g.Name, g.Policy)
	}
	for name, share := range g.Splits {
		if !seen[name] {
			return errAt([]string{"split", name}, "group %q: split names %q, which is not one of its channels", g.Name, name)
		}
		if share <= 0 || share > 1 {
			return errAt([]string{"split", name}, "group %q: split %q must be a share above 0%% and at most 100%%", g.Name, name)
		}
	}
	for model, fbs := range g.Fallbacks {
		if !validModelName(model) || len(fbs) == 0 {
			return errAt([]string{"fallback", model}, "group %q: fallback takes a model and the models that may serve it", g.Name)
		}
		for _, fb := range fbs {
			if !validModelName(fb) || fb == model {
				return errAt([]string{"fallback", model}, "group %q: fallback for %q: %q is not another model", g.Name, model, fb)
			}
		}
	}
	for class, d := range g.MaxWait {
		if _, ok := priorityByName(class); !ok || class == "" {
			return errAt([]string{"max_wait", class}, "group %q: max_wait: unknown class %q (realtime, normal, batch)", g.Name, class)
		}
		if d <= 0 {
			return errAt([]string{"max_wait", class}, "group %q: max_wait %s must be positive", g.Name, class)
		}
	}
	return nil
}

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
		t.Breaker = &Breaker{Window: caddy.Duration(s.window), FailureRatio: s.ratio, MinRequests: int(s.minRequests),
			OpenFor: caddy.Duration(s.openFor), HalfOpenProbes: int(s.probes)}
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
func (ch *Channel) checkFeatures() error {
	seen := map[string]string{}
	for _, l := range []struct {
		opt   string
		names []string
	}{{"supports", ch.Supports}, {"allow", ch.Allow}, {"lacks", ch.Lacks}, {"strip", ch.Strip}} {
		for _, name := range l.names {
			if err := checkFeatureNames(l.opt, []string{name}); err != nil {
				return &configError{at: []string{l.opt, name}, err: err}
			}
			if prev, ok := seen[name]; ok && prev != l.opt && !(prev == "supports" && l.opt == "allow") {
				return errAt([]string{l.opt, name}, "%s: %q is on the %s line too: a channel supports, lacks or strips a feature", l.opt, name, prev)
			}
			seen[name] = l.opt
		}
	}
	return nil
}

// validate checks the channel's own options; its provider checks its own.
func (ch *Channel) validate() error {
	if _, err := parseModels(ch.Models); err != nil {
		return &configError{at: []string{"models"}, err: err}
	}
	for _, m := range ch.ModelClasses {
		if err := m.validate(); err != nil {
			return &configError{at: []string{"model_class", m.Match}, err: err}
		}
	}
	if ch.Priority < 0 {
		return errAt([]string{"priority"}, "priority must not be negative")
	}
	if ch.Weight < 0 || ch.Weight > maxWeight {
		return errAt([]string{"weight"}, "weight must be between 0 and %d", maxWeight)
	}
	if err := ch.checkFeatures(); err != nil {
		return err
	}
	if d := ch.SignatureDomain; d != "" && !validDomainName(d) {
		return errAt([]string{"signature_domain"}, "signature_domain %q: letters, digits and - _ . : / @ only, at most %d characters", d, maxDomainLen)
	}
	if err := checkLimits(ch.Rate, ch.Tokens, ch.Concurrency); err != nil {
		return err
	}
	if _, err := money.ParseBudgets(ch.SpendCaps); err != nil {
		return errAt([]string{"spend_cap"}, "spend_cap: %v", err)
	}
	if f := ch.PriceFactor; f != nil && (!(*f > 0) || math.IsInf(*f, 0)) {
		return errAt([]string{"price_factor"}, "price_factor must be a number above 0, the channel's price over the list price (0.8 for 80%%), not %v", *f)
	}
	if p := ch.Probe; p != nil {
		probe := []string{"probe"}
		if p.Interval < 0 {
			return errAt(probe, "probe: interval must not be negative")
		}
		if p.Path != "" && routeByPath(p.Path) == 0 {
			return errAt(probe, "probe: path must be /v1/messages or /v1/messages/count_tokens, not %q", p.Path)
		}
		if p.Body != "" && !json.Valid([]byte(p.Body)) {
			return errAt(probe, "probe: body is not valid JSON")
		}
	}
	return ch.Tuning.validate()
}

// maxWeight bounds a channel's weight, so the weights of a group can never
// add up past what a pick can draw from.
const maxWeight = 1_000_000

// parseModels reads `name` and `name=upstream_name` entries into a map from
// the name clients send to the name the upstream wants. nil means every
// model.
func parseModels(entries []string) (map[string]string, error) {
	if len(entries) == 0 {
		return nil, nil
	}
	m := make(map[string]string, len(entries))
	for _, e := range entries {
		name, upstream, mapped := strings.Cut(e, "=")
		if !mapped {
			upstream = name
		}
		if modelIDProblem(name) != "" || modelIDProblem(upstream) != "" {
			return nil, fmt.Errorf("models: malformed entry %q: want name or name=upstream_name, without spaces, quotes or a second '='", e)
		}
		if _, dup := m[name]; dup {
			return nil, fmt.Errorf("models: %q is listed twice", name)
		}
		m[name] = upstream
	}
	return m, nil
}

// validModelName accepts the characters model ids use across providers
// (letters, digits and -._:@/), so a name can be spliced into JSON as is.
func validModelName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case c == '-' || c == '.' || c == '_' || c == ':' || c == '@' || c == '/':
		default:
			return false
		}
	}
	return true
}
