package relay

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/idle"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// Key is a relay key: the secret a client sends as x-api-key or as a bearer
// token, and the group that serves it.
type Key struct {
	// Secret is the key itself, or `sha256:<64 hex digits>` of it, or a
	// placeholder such as `{env.KEY_SUPPORT}` or `{file./run/secrets/key}`
	// that is resolved when the config loads. A placeholder keeps the secret
	// out of the config and out of `GET /config/`; the Caddyfile adapter
	// turns a literal secret into its sha256 form for the same reason.
	Secret string `json:"secret"`

	// Group is the name of the group that serves this key's requests.
	Group string `json:"group"`

	// KeyOptions are the key's name, class and limits. A user entry takes
	// the same ones.
	KeyOptions
}

// KeyOptions are the options of a key, which a user entry (see User)
// takes too: a name, a class and limits.
type KeyOptions struct {
	// Name identifies the key in logs and metrics, never the secret. Its
	// limits are kept by name across config reloads. Default: `key-`
	// followed by the first 16 hex digits of the secret's sha256; for a
	// user entry, `user:` followed by its id (`user:*` for every other
	// identity). A key's name may not start with `user:`.
	Name string `json:"name,omitempty"`

	// Priority is the key's class when its group's channels are all busy
	// and requests queue: `realtime`, `normal` (default) or `batch`. A freed
	// slot goes to the oldest request of the best class.
	Priority string `json:"priority,omitempty"`

	// Rate limits the key's requests, as `N/period` (period s, m, h, d or a
	// duration): `600/m`. Past it: 429 rate_limit_error, code
	// key_rate_limited, with the retry-after it takes. A call to
	// GET /v1/relay/usage counts as a request.
	Rate string `json:"rate,omitempty"`

	// Tokens limits the key's tokens (input, cache writes and output) as
	// `N/period`. A request is charged an estimate when admitted and its
	// real usage when it ends; a key in debt is refused until its bucket
	// refills.
	Tokens string `json:"tokens,omitempty"`

	// Concurrency limits the key's requests in flight.
	Concurrency int `json:"concurrency,omitempty"`

	// UserRate limits the requests of each end user of the key, told apart
	// by the `metadata.user_id` of the request body, as `N/period`. Past
	// it: 429 rate_limit_error, code user_rate_limited. A request without
	// metadata.user_id is not held to it.
	UserRate string `json:"user_rate,omitempty"`

	// UserTokens limits the tokens (input, cache writes and output) of
	// each end user of the key, by `metadata.user_id`, as `N/period`,
	// charged as Tokens is.
	UserTokens string `json:"user_tokens,omitempty"`

	// Budgets cap what the key may spend, each as `<amount>usd/<period>`
	// with period day, week or month (calendar periods in UTC, weeks from
	// Monday), or total: all the key ever spends, a budget that never
	// renews (raise it, or reset the key's spend with POST
	// /relay/keys/<name>/spend/reset on the admin API); at most one per
	// period. Spend is the relay's own accounting of
	// what each answer cost. While a message runs it holds its worst case
	// (its input estimate and max_tokens at the dearest prices it may be
	// served at) against the budget, and when it ends the hold becomes its
	// cost: a request whose hold does not fit beside what was spent gets
	// 429 rate_limit_error, code budget_exceeded, with a retry-after to the
	// period's end (none for total); one that holds in flight stand in
	// front of waits in the queue for them to settle, up to its class's
	// max_wait. A batch holds the worst case of all its requests until its
	// results are read.
	Budgets []string `json:"budgets,omitempty"`

	// BudgetWarn is the share of a budget at which the relay logs a
	// warning, once per period. Default: 0.8.
	BudgetWarn float64 `json:"budget_warn,omitempty"`

	// BudgetDegrade serves the key's messages more cheaply as the tightest
	// budget that applies to them (the key's, its group's or the session's
	// session_budget; what was spent and what requests in flight hold)
	// nears its end: from each
	// step's percent on, on the cheapest channels of the live tier
	// (cheaper) or as another model (model). Steps add up: past 80%
	// cheaper and 95% model claude-haiku-4-5, a message is served as
	// claude-haiku-4-5 on the cheapest channels. A spent budget still
	// refuses (429 budget_exceeded). Default: the group's steps.
	BudgetDegrade []BudgetDegrade `json:"budget_degrade,omitempty"`

	// Expires is when the key stops working, as an RFC 3339 time such as
	// `2027-01-31T00:00:00Z`. From then on its requests get a 401
	// authentication_error with code key_expired. Default: never.
	Expires string `json:"expires,omitempty"`

	// Disabled turns the key off without removing it: its requests get a
	// 401 authentication_error with code key_disabled, and its limits are
	// kept for when it is enabled again.
	Disabled bool `json:"disabled,omitempty"`

	// SessionLimits hold each agent session of the key (Claude Code's
	// session) to a budget, a rate and a loop guard of its own. Each one
	// the key leaves unset is its group's.
	SessionLimits
}

// label names a key in errors without revealing its secret.
func (k *Key) label(i int) string {
	if k.Name != "" {
		return fmt.Sprintf("key %q", k.Name)
	}
	return fmt.Sprintf("key #%d", i+1)
}

const sha256Prefix = "sha256:"

// key is a provisioned key or user entry: what a request is served as.
type key struct {
	name     string // in logs and metrics: the entry's, never a secret, never the identity a user * entry served
	id       string // a user entry's id, anyIdentity for user *; "" for a relay key
	stateID  string // its state's: the name of a key, user:<id> for a user entry
	group    *group
	prio     priority
	opts     *KeyOptions // as configured: its limits are pushed into its state when it is taken
	active   atomic.Bool // its state is taken (state and limits are set): at its first request, or at provisioning
	disabled bool
	endUsers bool            // it has user_rate or user_tokens
	sessions *sessionRules   // its session limits and its group's; nil: none
	degrade  []degradeRule   // its budget_degrade steps, by share; nil: its group's
	state    *keyState       // kept across reloads by stateID
	limits   *limits.Limiter // state.limits; nil for user *, whose identities each have their own
	expires  time.Time       // zero: never
	relay    *Relay          // the handler that provisioned it: its clock, and whose Cleanup removes it from provisionedKeys
}

// kind is kindKey or kindUser.
func (k *key) kind() string {
	if k.id == "" {
		return kindKey
	}
	return kindUser
}

// Kinds of key: a relay key, or a user entry (an identity a Caddy
// authentication handler established).
const (
	kindKey  = "key"
	kindUser = "user"
)

// keyState is what a key or a user entry keeps across config reloads, in
// keyStates by its state id: its limits, its end users' limits and, for
// user *, each identity's own state (of the same type). It is where state
// per principal belongs.
type keyState struct {
	limits *limits.Limiter
	spend  *money.Account // what the principal spent, and its budgets
	id     string         // an identity of user *: its state id (key.stateID for the others)

	mu          sync.Mutex                                  // guards the making of the caches
	idents      atomic.Pointer[idle.Cache[*keyState]]       // user * only: each identity's state, by identity
	identSpec   atomic.Pointer[stateSpec]                   // what a new identity's limits are
	endUsers    atomic.Pointer[idle.Cache[*limits.Limiter]] // by state id and user_id; nil: no end user limits
	endUserSpec atomic.Pointer[stateSpec]
}

// stateSpec is the limits a kept state is pushed, and the fleet that
// shares them.
type stateSpec struct {
	limits  limits.Spec
	fleet   *member
	budgets money.BudgetSpec // user * only: each identity's budgets
}

func newKeyState() *keyState { return &keyState{limits: new(limits.Limiter)} }

// Settled reports whether forgetting the state forgives nothing: a new one
// would be the same. A request still holding against its budgets keeps it.
func (s *keyState) Settled(now time.Time) bool {
	return s.limits.Settled(now) && (s.spend == nil || s.spend.Idle())
}

// Destruct implements caddy.Destructor.
func (*keyState) Destruct() error { return nil }

// setOptions sets what k's options say, but for its state: at
// provisioning, before any request can read them.
func (k *key) setOptions(opts *KeyOptions, r *Relay) {
	k.opts, k.relay = opts, r
	k.prio, _ = priorityByName(opts.Priority)
	k.expires, _ = parseExpires(opts.Expires) // validated already
	k.disabled = opts.Disabled
	k.endUsers = opts.UserRate != "" || opts.UserTokens != ""
	k.sessions = k.group.sessions.under(&opts.SessionLimits)
	k.degrade = degradeRules(opts.BudgetDegrade)
}

// takeState takes k's state from the process-wide pool, by its state id,
// and pushes the options' limits into it (for user *, into every
// identity's). It runs under r.keysMu.
func (r *Relay) takeState(k *key, opts *KeyOptions) error {
	lim, _ := limits.Parse(opts.Rate, opts.Tokens, opts.Concurrency) // validated already
	endUserLimits, _ := limits.Parse(opts.UserRate, opts.UserTokens, 0)
	st, _, err := keyStates.LoadOrNew(k.stateID, func() (caddy.Destructor, error) { return newKeyState(), nil })
	if err != nil {
		return err
	}
	r.held.addKey(k.stateID)
	k.state = st.(*keyState)
	now := r.now()
	caps, _ := money.ParseBudgets(opts.Budgets) // validated already
	budgets := money.BudgetSpec{Caps: caps, Warn: opts.BudgetWarn, Label: k.name, Logger: r.logger, Now: func() time.Time { return r.now() }}
	if k.id == anyIdentity {
		k.state.configureIdentities(stateSpec{limits: lim, fleet: r.fleet, budgets: budgets}, now)
	} else {
		k.limits = k.state.limits
		k.limits.Configure(lim, now)
		k.limits.Share(r.fleet.limitsOf(), k.fleetTag())
		if k.state.spend, err = money.Open(k.stateID); err != nil {
			return err
		}
		r.held.addSpend(k.stateID)
		budgets.Apply(k.state.spend, r.fleet.moneyOf())
	}
	k.state.configureEndUsers(stateSpec{limits: endUserLimits, fleet: r.fleet}, now)
	k.active.Store(true)
	return nil
}

// activate takes the state of a key that has none yet, at its first
// request: a key costs its record only until it serves one, so a config of
// many keys loads quickly and small. Keys whose state was taken already, by
// the config before a reload, take it at provisioning (see provisionKeys),
// so a reload never hands a key a fresh quota.
func (r *Relay) activate(k *key) {
	r.keysMu.Lock()
	defer r.keysMu.Unlock()
	if k.active.Load() {
		return
	}
	_ = r.takeState(k, k.opts) // the pool's constructors do not fail
	if r.held.released {
		// a request of an unloaded config: the key keeps the state, which
		// no longer belongs to the pool (the config that follows takes its
		// own)
		_, _ = keyStates.Delete(k.stateID)
		money.Drop(k.stateID)
	}
}

// fleetTag is where a fleet keeps k's limits.
func (k *key) fleetTag() string {
	if k.kind() == kindUser {
		return fleet.Tag("u:", boundedID(k.id))
	}
	return fleet.Tag("k:", k.name)
}

// describe names k in error messages: never a secret.
func (k *key) describe() string {
	switch {
	case k.kind() == kindKey:
		return "key " + strconv.Quote(k.name)
	case k.id == anyIdentity:
		return "this identity (user *)"
	}
	return "user " + strconv.Quote(k.id)

}

// usable refuses a key that is disabled, or expired at now. The message
// names the key, never its secret.
func (k *key) usable(now time.Time) *relayError {
	switch {
	case k.disabled:
		return errKeyDisabled(k.name)
	case !k.expires.IsZero() && !now.Before(k.expires):
		return errKeyExpired(k.name, k.expires)
	}
	return nil
}

// authenticate finds the relay key of a request. Keys are looked up by the
// sha256 of what the client sent, so no comparison ever runs over the
// secret itself and the time taken says nothing about how close a guess was.
//
// A client may send both x-api-key and Authorization: Bearer (Claude Code
// does when a developer has both ANTHROPIC_API_KEY and
// ANTHROPIC_AUTH_TOKEN set, one of them often stale): the request is the
// key's that either names, and a usable key wins over a disabled or
// expired one. Two different usable keys are refused, since the relay
// cannot tell whose bill the request is.
func (r *Relay) authenticate(req *http.Request) (*key, *relayError) {
	apiKey, bearer := relayKeysOf(req)
	if apiKey == "" && bearer == "" {
		return nil, errAuth("missing relay key: send it as x-api-key or as Authorization: Bearer")
	}
	k := r.lookupKey(apiKey)
	if bearer != "" && bearer != apiKey {
		switch b := r.lookupKey(bearer); {
		case b == nil:
		case k == nil:
			k = b
		case k.refusal(r.now) != nil:
			k = b // a stale x-api-key beside a usable bearer token
		case b.refusal(r.now) == nil:
			return nil, errAuth("x-api-key and Authorization: Bearer carry two different relay keys; send one of them")
		}
	}
	if k == nil {
		return nil, errAuth("invalid relay key")
	}
	if rerr := k.refusal(r.now); rerr != nil {
		return nil, rerr
	}
	if !k.active.Load() {
		r.activate(k)
	}
	return k, nil
}

// refusal is usable for a key a request named: the clock is read only
// for a key that can refuse, one disabled or with an expiry.
func (k *key) refusal(now func() time.Time) *relayError {
	if !k.disabled && k.expires.IsZero() {
		return nil
	}
	return k.usable(now())
}

// lookupKey is the key whose secret is secret; nil for none.
func (r *Relay) lookupKey(secret string) *key {
	if secret == "" {
		return nil
	}
	var buf [96]byte // a secret of usual length is hashed without an allocation
	return r.keys[sha256.Sum256(append(buf[:0], secret...))]
}

// provisionKeys resolves the keys' secrets, of the config and of the keys
// file, into the digests they are looked up by. A key takes its state from
// the process-wide pool here if the config before this one had taken it,
// or if it has budgets (its spend is read, and in a fleet shared); the
// others take it at their first request (see activate).
func (r *Relay) provisionKeys() ([]fileKeyDecl, error) {
	r.keysMu.Lock()
	defer r.keysMu.Unlock()
	r.keys = make(map[[sha256.Size]byte]*key, len(r.Keys)+len(r.fileKeys))
	weakInFile, firstWeak := 0, "" // a file's weak keys are told once
	add := func(cfg *Key, i, line int) (string, error) {
		label := func() string {
			if line > 0 {
				return fmt.Sprintf("keys_file, line %d: %s", line, cfg.label(i))
			}
			return cfg.label(i)
		}
		digest, weak, err := keyDigest(cfg.Secret)
		if err != nil {
			return "", fmt.Errorf("%s: %w", label(), err)
		}
		if weak && line == 0 {
			r.logger.Warn(weakKeyWarning, zap.String("key", label()))
		} else if weak {
			if weakInFile == 0 {
				firstWeak = label()
			}
			weakInFile++
		}
		if _, dup := r.keys[digest]; dup {
			return "", fmt.Errorf("%s has the same secret as an earlier key", label())
		}
		name := keyName(cfg, digest)
		k := &key{name: name, stateID: name, group: r.groups[cfg.Group]}
		k.setOptions(&cfg.KeyOptions, r)
		if err := k.checkDegrade(label()); err != nil {
			return "", err
		}
		if n, _ := keyStates.References(k.stateID); n > 0 || len(cfg.Budgets) > 0 {
			if err := r.takeState(k, k.opts); err != nil {
				return "", err
			}
		}
		r.keys[digest] = k
		return name, nil
	}
	for i, cfg := range r.Keys {
		if literalSecret(cfg.Secret) {
			r.logger.Warn(literalKeyWarning, zap.String("key", cfg.label(i)))
		}
		if _, err := add(cfg, i, 0); err != nil {
			return nil, err
		}
	}
	decls := make([]fileKeyDecl, len(r.fileKeys))
	for i, fk := range r.fileKeys {
		name, err := add(fk.Key, i, fk.line)
		if err != nil {
			return nil, err
		}
		decls[i] = fileKeyDecl{name: name, sum: fk.sum}
		fk.Secret = "" // its digest is the map's key: the file's secrets are not kept
	}
	r.fileKeys = nil
	if weakInFile > 0 {
		r.logger.Warn(weakKeyWarning, zap.String("key", firstWeak), zap.Int("weak_keys_in_keys_file", weakInFile))
	}
	return decls, nil
}

// parseExpires reads a key's expiry; "" is never (the zero time).
func parseExpires(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is not an RFC 3339 time such as 2027-01-31T00:00:00Z", s)
	}
	return t, nil
}

// literalSecret reports whether a key's secret is written in the config as
// it is: neither its sha256 nor a placeholder. The Caddyfile adapter never
// leaves one, so such a key came in as JSON (POST /load, the config API),
// and GET /config/ and every saved copy of the config show it.
func literalSecret(secret string) bool {
	return !strings.HasPrefix(secret, sha256Prefix) && !strings.Contains(secret, "{")
}

const literalKeyWarning = "a relay key's secret is written in the config as it is, so GET /config/ and every saved copy of the config show it; " +
	"give its sha256 instead (\"secret\": \"sha256:<64 hex digits>\", from: printf %s \"$KEY\" | sha256sum) or a placeholder such as {env.NAME} or {file./path}"

// keyDigest resolves a key's secret and returns the sha256 it is looked up
// by, and whether the secret is weak (see weakKey); `sha256:<hex>` gives the
// digest directly, which cannot be judged.
func keyDigest(secret string) (d [sha256.Size]byte, weak bool, err error) {
	if hexDigest, ok := strings.CutPrefix(secret, sha256Prefix); ok {
		d, ok := decodeDigest(hexDigest)
		if !ok {
			return d, false, fmt.Errorf("sha256: must be followed by 64 hex digits")
		}
		return d, false, nil
	}
	v, err := resolveSecret(secret)
	if err != nil {
		return d, false, err
	}
	return sha256.Sum256([]byte(v)), weakKey(v), nil
}

// decodeDigest reads 64 hex digits, without allocating: a keys file has
// many.
func decodeDigest(hexDigest string) (d [sha256.Size]byte, ok bool) {
	var buf [2 * sha256.Size]byte
	if len(hexDigest) != len(buf) {
		return d, false
	}
	copy(buf[:], hexDigest)
	_, err := hex.Decode(d[:], buf[:])
	return d, err == nil
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

// keyStates holds each key's and user entry's state by its state id (a
// key's name, user:<id>), process-wide, so that a reload does not hand a
// key a fresh quota.
var keyStates = caddy.NewUsagePool()

// provisionedKeys holds every provisioned relay handler, for their keys:
// GET /relay/keys belongs to no handler and lists them from here. A
// handler is added once it has provisioned its keys and removed in its
// Cleanup, so during a reload a name is held by the old config and the new
// one at once, and the newest wins.
var provisionedKeys = &keyRegistry{}

// keyRegistry is the type of provisionedKeys.
type keyRegistry struct {
	mu     sync.Mutex
	relays []*Relay // oldest first
}

func (g *keyRegistry) add(r *Relay) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.relays = append(g.relays, r)
}

// remove forgets r's keys.
func (g *keyRegistry) remove(r *Relay) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.relays = slices.DeleteFunc(g.relays, func(x *Relay) bool { return x == r })
}

// current returns the newest key of each kind and name, in no order.
func (g *keyRegistry) current() []*key {
	g.mu.Lock()
	relays := slices.Clone(g.relays)
	g.mu.Unlock()
	var out []*key
	type id struct {
		user bool
		name string
	}
	seen := map[id]bool{} // the status page asks each second: no string made a key
	take := func(k *key) {
		if id := (id{k.id != "", k.name}); !seen[id] {
			seen[id] = true
			out = append(out, k)
		}
	}
	for _, r := range slices.Backward(relays) {
		for _, k := range r.keys {
			take(k)
		}
		for _, k := range r.users {
			take(k)
		}
		if r.anyUser != nil {
			take(r.anyUser)
		}
	}
	return out
}
