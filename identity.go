package relay

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/idle"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
)

// User is an identity that a Caddy authentication handler, running before
// the relay, established (basic_auth, or a JWT or OIDC module), and the
// group that serves it. The relay's Identity placeholder says where the
// handler put the identity. A request with an identity needs no relay key.
type User struct {
	// ID is the identity as Identity resolves it (for basic_auth, the user
	// name), or `*` for every identity that has no entry of its own: each
	// of those is held to the entry's limits on its own, while logs and
	// metrics name the entry.
	ID string `json:"id"`

	// Group is the name of the group that serves this identity's requests.
	Group string `json:"group"`

	// KeyOptions are the entry's name, class and limits, as a key's. The
	// default name is `user:` followed by the id.
	KeyOptions
}

// label names a user entry in config errors.
func (u *User) label() string { return "user " + u.ID }

// anyIdentity is the id of the entry that serves every identity without
// an entry of its own.
const anyIdentity = "*"

// userStatePrefix starts the state id of every identity, so that a key's
// name (its state id) never is one.
const userStatePrefix = "user:"

// userStateID is the state id of an identity, as kept.
func userStateID(id string) string { return userStatePrefix + boundedID(id) }

// maxIDLen bounds an identity or an end user's id as the relay keeps it
// (in memory, in Redis); a longer one is kept as its digest.
const maxIDLen = 64

// boundedID is s, or its digest when s is longer than maxIDLen: stable, and
// of bounded length whatever a client sends. A digest starts with
// sha256Prefix and no id kept as it is does: an id that starts so is kept
// as its digest too, whatever its length. Otherwise a client that picks its
// identity (a header, metadata.user_id) could send the digest of another's
// long id as its own and share that one's limits, budget and spend.
//
// An id that a store would change or refuse is kept as its digest too: one
// that is not valid UTF-8 (JSON, which the spend store writes, replaces its
// bytes, so that the identity's spend would come back under another id
// after a restart, or merged with another's) or that has a control
// character (Postgres refuses a NUL in text, and would refuse the ledger's
// whole batch).
func boundedID(s string) string {
	if len(s) <= maxIDLen && !strings.HasPrefix(s, sha256Prefix) && plainID(s) {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	return sha256Prefix + hex.EncodeToString(sum[:16])
}

// plainID reports whether s is valid UTF-8 without an ASCII control
// character.
func plainID(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c == 0x7f {
			return false
		}
	}
	return utf8.ValidString(s)
}

// provisionUsers takes the user entries' state from the process-wide pool.
func (r *Relay) provisionUsers() error {
	r.keysMu.Lock()
	defer r.keysMu.Unlock()
	r.users = make(map[string]*key, len(r.Users))
	for _, cfg := range r.Users {
		k := &key{name: cmp.Or(cfg.Name, userStatePrefix+cfg.ID), id: cfg.ID,
			stateID: userStateID(cfg.ID), group: r.groups[cfg.Group]}
		k.setOptions(&cfg.KeyOptions, r)
		if err := k.checkDegrade(cfg.label()); err != nil {
			return err
		}
		if err := r.takeState(k, k.opts); err != nil {
			return err
		}
		if cfg.ID == anyIdentity {
			r.anyUser = k
		} else {
			r.users[cfg.ID] = k
		}
	}
	return nil
}

// identify is the request's auth step: it finds what the request is served
// as (a key or a user entry), and the state of its principal. When the
// relay's identity placeholder resolves to an identity, that decides: the
// identity's entry, else `user *`, else 401; the relay key is then not
// looked at. Otherwise the relay key decides. Either way the client's
// credentials go no further than this step: no provider, not even one from
// another package, sees them.
func (r *Relay) identify(req *http.Request, in *inbound) *relayError {
	defer stripCredentials(req.Header)
	if id := r.identityOf(req); id != "" {
		k := r.users[id]
		if k == nil {
			k = r.anyUser
		}
		if k == nil {
			return errAuth("the identity this request was authenticated as has no user entry in the relay, and the relay has no user * entry")
		}
		if rerr := k.usable(r.now()); rerr != nil {
			return rerr
		}
		in.who.key = k
		in.who.state, in.who.stateID = k.principal(id, r.now())
		return nil
	}
	if r.Identity != "" && relayKeyOf(req) == "" {
		return errAuth("not authenticated: sign in, or send a relay key as x-api-key or as Authorization: Bearer")
	}
	k, rerr := r.authenticate(req)
	if rerr != nil {
		return rerr
	}
	in.who.key, in.who.state, in.who.stateID = k, k.state, k.stateID
	return nil
}

// identityOf resolves the relay's identity placeholder for req: "" when it
// has none, or when no authentication handler set it.
func (r *Relay) identityOf(req *http.Request) string {
	if r.Identity == "" {
		return ""
	}
	repl, ok := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return ""
	}
	// validation made Identity exactly one placeholder, {http...}: its
	// value is looked up, the template never parsed
	id, _ := repl.GetString(r.Identity[1 : len(r.Identity)-1])
	return id
}

// stripCredentials removes the client's credentials from its request
// headers once they have served: whatever a provider copies from
// Call.Header, they cannot reach an upstream. (Caddy's access log keeps
// its own copy of the headers, taken before any handler ran.)
func stripCredentials(h http.Header) {
	h.Del("Authorization")
	h.Del("X-Api-Key")
	h.Del("Proxy-Authorization")
}

// principal is the state of a request served as k, and its state id: k's
// own, or for user * the identity's own.
func (k *key) principal(identity string, now time.Time) (*keyState, string) {
	if k.id != anyIdentity {
		return k.state, k.stateID
	}
	st := k.state.identity(boundedID(identity), now)
	return st, st.id
}

// identity is the state of one identity of a user * entry, made with the
// entry's limits when it has none (or has been dropped, idle).
func (s *keyState) identity(id string, now time.Time) *keyState {
	return s.idents.Load().Get(id, now, func() *keyState {
		st := newKeyState()
		st.id = userStatePrefix + id
		sp := s.identSpec.Load()
		st.limits.Configure(sp.limits, now)
		st.limits.Share(sp.fleet.limitsOf(), fleet.Tag("u:", id))
		st.spend = identitySpend(st.id, sp)
		return st
	})
}

// configureIdentities pushes the limits of a user * entry into every
// identity it keeps, and into those it will make.
func (s *keyState) configureIdentities(sp stateSpec, now time.Time) {
	s.mu.Lock()
	c := s.idents.Load()
	if c == nil {
		c = idle.NewDropping(maxIdentities, idleAfter, (*keyState).dropIdentity)
		s.idents.Store(c)
	}
	s.identSpec.Store(&sp)
	s.mu.Unlock()
	c.Each(func(id string, st *keyState) {
		st.limits.Configure(sp.limits, now)
		st.limits.Share(sp.fleet.limitsOf(), fleet.Tag("u:", id))
		sp.budgets.Apply(st.spend, sp.fleet.moneyOf())
	})
}

// dropIdentity lets go of the spend account of an identity that user *
// drops: what it spent stays in the spend store (when it spent anything),
// and comes back with the identity.
func (s *keyState) dropIdentity() {
	if s.spend != nil {
		money.Drop(s.spend.ID())
	}
}

// identitySpend is the spend account of one identity of a user * entry,
// held while the identity's state is kept.
func identitySpend(stateID string, sp *stateSpec) *money.Account {
	a, err := money.Open(stateID)
	if err != nil { // the pool's constructor does not fail
		a = money.NewAccount(stateID)
	}
	a.SetPerIdentity()
	sp.budgets.Apply(a, sp.fleet.moneyOf())
	return a
}

// relayKeyOf is the relay key a request sends: x-api-key, else a bearer
// token; "" for none.
func relayKeyOf(req *http.Request) string {
	apiKey, bearer := relayKeysOf(req)
	if apiKey != "" {
		return apiKey
	}
	return bearer
}

// relayKeysOf is what a request sends as x-api-key and as a bearer token
// in Authorization; "" for what it does not send.
func relayKeysOf(req *http.Request) (apiKey, bearer string) {
	apiKey = req.Header.Get("X-Api-Key")
	if auth := req.Header.Get("Authorization"); len(auth) > 7 && strings.EqualFold(auth[:7], "bearer ") {
		bearer = strings.TrimSpace(auth[7:])
	}
	return apiKey, bearer
}

// clientSetsIdentity reports whether the identity placeholder reads a
// value the client sends itself (a header, a query parameter, a cookie):
// anyone could then claim any identity, unless a handler before the relay
// always replaces that value (forward_auth's copy_headers does).
func clientSetsIdentity(placeholder string) bool {
	for _, p := range []string{"{http.request.header.", "{http.request.uri.query.", "{http.request.cookie."} {
		if strings.HasPrefix(placeholder, p) {
			return true
		}
	}
	return false
}

const clientIdentityWarning = "identity reads a value the client sends itself: any client can claim any identity with it, unless a handler before the relay always replaces that value (forward_auth with copy_headers does); prefer {http.auth.user.*}, which only authentication handlers set"

// Bounds of the states made on demand.
const (
	// idleAfter is how long a state goes unused before it may be dropped.
	idleAfter = 10 * time.Minute
	// maxIdentities bounds the identities of one user * entry kept.
	maxIdentities = 10_000
	// maxEndUsers bounds the end users of one key or user entry kept.
	maxEndUsers = 10_000
)
