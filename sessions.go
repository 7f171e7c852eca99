package relay

import (
	"cmp"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/idle"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
)

// Sessions. An agent such as Claude Code runs for hours, request after
// request, in one session: it sends X-Claude-Code-Session-Id, and the
// session again at the end of metadata.user_id
// (`user_<hash>_account_<id>_session_<uuid>`). A key, a user entry or a
// group may hold each such session to a budget of its own (a runaway agent
// stops at it, the key's budget is left for the rest of the day), a rate,
// and a loop guard: the request whose conversation ends with the same
// tool call and the same tool result as the n-1 before it in the session
// is refused, since an agent that keeps getting the same answer to the
// same call is stuck.
//
// A session is its principal's (the key, the user entry or the identity):
// two keys that send the same session id have two sessions. Its state is
// kept in its group, in a bounded idle cache of its principal's (so that
// one principal's session ids never push out another's), by the session
// id, and dropped when idle; its budget is a spend account
// (internal/money) that its requests hold against as against any budget
// (holds.go), shared in a fleet through Redis as the others are, and never
// stored, exported as a metric or named by the client's id: the id shown
// is a digest.

// SessionLimits are the limits of each agent session of a key, a user
// entry or a group.
type SessionLimits struct {
	// SessionBudget caps what one session may spend, as
	// `<amount>usd/<duration>` such as `5usd/4h`: its spend counts in
	// windows of the duration, and renews with each. Windows lie on a grid
	// fixed in UTC, the same on every relay of a fleet: a duration that
	// divides a day starts them at midnight UTC and every multiple after
	// it (24h is the calendar day), 168h is the week from Monday. A
	// session's request holds its worst case against it as against the
	// key's budget; past it: 429 rate_limit_error, code
	// session_budget_exceeded, x-should-retry: false, with a retry-after to
	// the window's end.
	SessionBudget string `json:"session_budget,omitempty"`

	// SessionRate limits the requests of one session, as `N/period`
	// (period s, m, h, d or a duration): `60/m`. Past it: 429
	// rate_limit_error, code session_rate_limited, x-should-retry: false,
	// with the retry-after it takes.
	SessionRate string `json:"session_rate,omitempty"`

	// LoopGuard, n, refuses the request of a session whose conversation
	// ends with the same tool call (name and input) and the same tool
	// result as the requests before it, for the n-th time in a row: 429
	// rate_limit_error, code session_loop, x-should-retry: false. A request
	// that ends otherwise (another result, a new prompt) is served and
	// starts the count again. An SDK's retry of a request
	// (x-stainless-retry-count above 0) does not count. At least 2; 0: off.
	LoopGuard int `json:"loop_guard,omitempty"`
}

// sessionRules are parsed SessionLimits: a key's own, over its group's.
type sessionRules struct {
	budgetUSD float64       // 0: no session_budget
	window    time.Duration // the budget's
	rate      limits.Spec   // session_rate; zero: none
	rateSpec  string
	loopGuard int // 0: off
}

// parseSessionBudget reads `<amount>usd/<duration>`.
func parseSessionBudget(s string) (float64, time.Duration, error) {
	amount, window, ok := strings.Cut(strings.ToLower(strings.TrimSpace(s)), "/")
	n, err := strconv.ParseFloat(strings.TrimSuffix(amount, "usd"), 64)
	if !ok || err != nil || !strings.HasSuffix(amount, "usd") || !(n > 0 && n <= 1e12) {
		return 0, 0, fmt.Errorf("session_budget %q: want <amount>usd/<duration>, such as 5usd/4h", s)
	}
	d, err := caddy.ParseDuration(window)
	if err != nil || d < time.Minute || d > 366*24*time.Hour {
		return 0, 0, fmt.Errorf("session_budget %q: the window must be a duration from 1m to 366d, such as 4h", s)
	}
	return n, d, nil
}

// validate checks the session limits.
func (o *SessionLimits) validate() error {
	if o.SessionBudget != "" {
		if _, _, err := parseSessionBudget(o.SessionBudget); err != nil {
			return errAt([]string{"session_budget"}, "%v", err)
		}
	}
	if _, err := limits.ParseRate(o.SessionRate); err != nil {
		return errAt([]string{"session_rate"}, "session_rate: %v", err)
	}
	if o.LoopGuard < 0 || o.LoopGuard == 1 {
		return errAt([]string{"loop_guard"}, "loop_guard must be 2 or more (the times in a row the same tool call and result may come), or 0 for none")
	}
	return nil
}

// under is the rules of o, each limit it leaves unset taken from rs (a
// group's; nil: none); nil when no limit is set. o is validated.
func (rs *sessionRules) under(o *SessionLimits) *sessionRules {
	out := sessionRules{}
	if rs != nil {
		out = *rs
	}
	if o.SessionBudget != "" {
		out.budgetUSD, out.window, _ = parseSessionBudget(o.SessionBudget)
	}
	if o.SessionRate != "" {
		out.rate, _ = limits.Parse(o.SessionRate, "", 0)
		out.rateSpec = o.SessionRate
	}
	if o.LoopGuard > 0 {
		out.loopGuard = o.LoopGuard
	}
	if out == (sessionRules{}) {
		return nil
	}
	if rs != nil && out == *rs {
		return rs // shared, so a session sees its rules unchanged
	}
	return &out
}

// session is one agent session's state.
type session struct {
	id    string // a digest of the client's session id: what is shown
	key   string // the name of the key or user entry it is served as
	group string

	// started is when this relay first saw it: its principal's usage
	// lists sessions by it, the newest first
	started time.Time

	mu        sync.Mutex
	rules     *sessionRules   // what it was last configured with
	spend     *money.Account  // session_budget; nil: none
	limits    *limits.Limiter // session_rate; nil: none
	fleet     *member         // where its loop guard counts, in a fleet; nil: here
	tag       string          // where the fleet keeps it
	loopLast  uint64          // the digest of the last (tool call, tool result) pair its conversation ended with
	loopCount int             // in a row
	loopHits  int             // requests the loop guard refused
	requests  int64           // admitted
	spent     money.NanoUSD   // what its requests cost on this relay
	lastSeen  time.Time
}

// Settled reports whether dropping the session forgives nothing: no
// request holds against its budget, and its rate limit is full.
func (s *session) Settled(now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return (s.spend == nil || s.spend.Idle()) && (s.limits == nil || s.limits.Settled(now))
}

// drop lets go of the session's spend account when its cache drops it
// (under the cache's lock): a session's spend is never stored.
func (s *session) drop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.spend != nil {
		money.Drop(s.spend.ID())
		s.spend = nil
	}
}

// principalSessions are the sessions of one principal in a group.
type principalSessions struct {
	c    *idle.Cache[*session]
	gone atomic.Bool // its group's cache dropped it
}

// Settled reports whether dropping the principal's sessions forgives
// nothing.
func (p *principalSessions) Settled(now time.Time) bool {
	ok := true
	p.c.Each(func(_ string, s *session) { ok = ok && s.Settled(now) })
	return ok
}

// drop lets go of every session of the principal.
func (p *principalSessions) drop() {
	p.gone.Store(true)
	p.c.Purge()
}

// Bounds of the sessions kept.
const (
	// maxSessions bounds the sessions one principal keeps in a group on a
	// relay: more than a person or an agent fleet runs within
	// sessionIdle, few enough that the principals a group may keep
	// (maxSessionPrincipals, as many as user * keeps identities) bound
	// what a group's made-up session ids can hold
	maxSessions = 1_000
	// maxSessionPrincipals bounds the principals with sessions one group
	// keeps on a relay.
	maxSessionPrincipals = maxIdentities
	// maxGroupSessions bounds the sessions one group keeps on a relay, all
	// principals together: about 1.3 KB each with every session limit,
	// plus about 1.8 KB for each principal with sessions, so that a group
	// keeps at most about 70 MB however its principals spread them
	// (TestAGroupsSessionsFitIn100MB measures it). A principal alone
	// cannot fill it (maxSessions is far below it).
	maxGroupSessions = 40_000
	// sessionIdle is how long a session goes unused before it may be
	// dropped: Claude Code's prompt cache lasts 5 minutes, and a person
	// may read for longer before the next prompt.
	sessionIdle = 30 * time.Minute
)

// sessionSpendPrefix starts the ids of sessions' spend accounts.
const sessionSpendPrefix = "session:"

// sessionDigest is how a session id is shown and kept (the status page,
// GET /relay/sessions, the usage ledger): the first 16 hex digits of its
// sha256, which a developer can compute from their own id; "" for none.
func sessionDigest(sid string) string {
	if sid == "" {
		return ""
	}
	return fleet.Digest(sid)
}

// session is the state of the session sid of the principal stateID,
// made when it has none, configured with rules.
func (r *Relay) session(in *inbound, sid string, rules *sessionRules, now time.Time) *session {
	gs := in.who.key.group.state
	c := gs.sessions.Load()
	if c == nil {
		gs.mu.Lock()
		if c = gs.sessions.Load(); c == nil {
			c = idle.NewDropping(maxSessionPrincipals, sessionIdle, (*principalSessions).drop)
			gs.sessions.Store(c)
		}
		gs.mu.Unlock()
	}
	ps := c.Get(in.who.stateID, now, func() *principalSessions {
		return &principalSessions{c: idle.NewDropping(maxSessions, sessionIdle, func(s *session) {
			s.drop()
			gs.sessionsKept.Add(-1)
		})}
	})
	// the principal's own cache: the session id alone tells its sessions
	// apart; the id the fleet and the spend store know it by, principal
	// included, is made only when its rules are pushed
	bsid := boundedID(sid)
	made := false
	s := ps.c.Get(bsid, now, func() *session {
		made = true
		gs.sessionsKept.Add(1)
		return &session{id: sessionDigest(sid), key: in.who.key.name, group: in.who.key.group.name, started: now}
	})
	if made {
		if ps.gone.Load() { // its principal was dropped meanwhile: nothing keeps it
			ps.c.Purge()
		}
		trimSessions(gs, c)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rules != rules {
		r.configureSession(s, in.who.stateID+"\x00"+bsid, rules, now)
	}
	return s
}

// trimSessions drops sessions until the group keeps at most
// maxGroupSessions: the least recently used of the least recently used
// principal's (a principal is used with each of its sessions, so none of
// its sessions was used since the others' principals were), and a
// principal left with none. It runs after a session was made, under no
// lock of a principal's, so that two principals that make room at once
// never wait for each other; a group may keep more than its bound by the
// sessions being made at that moment.
func trimSessions(gs *groupState, c *idle.Cache[*principalSessions]) {
	for range 16 { // a bound on the work of one request
		if gs.sessionsKept.Load() <= maxGroupSessions {
			return
		}
		id, ps, ok := c.Oldest()
		if !ok {
			return
		}
		if !ps.c.DropOldest() {
			c.Remove(id, ps)
		}
	}
}

// configureSession pushes rules into s: its budget's account and its rate
// limiter, made or dropped as the rules say. It runs under s.mu.
func (r *Relay) configureSession(s *session, id string, rules *sessionRules, now time.Time) {
	s.rules = rules
	s.fleet, s.tag = r.fleet, "x:"+fleet.Digest(id)
	if rules.budgetUSD > 0 {
		if s.spend == nil {
			aid := sessionSpendPrefix + fleet.Digest(id)
			a, err := money.Open(aid)
			if err != nil { // the pool's constructor does not fail
				a = money.NewAccount(aid)
			}
			s.spend = a
		}
		var caps [money.NumPeriods]float64
		caps[money.PeriodDay] = rules.budgetUSD
		money.BudgetSpec{Scope: money.OfSession, Caps: caps, Window: rules.window, Label: s.id,
			Logger: r.logger, Now: func() time.Time { return r.now() }}.Apply(s.spend, r.fleet.moneyOf())
	} else if s.spend != nil {
		money.Drop(s.spend.ID())
		s.spend = nil
	}
	if rules.rate != (limits.Spec{}) {
		if s.limits == nil {
			s.limits = new(limits.Limiter)
		}
		s.limits.Configure(rules.rate, now)
		s.limits.Share(r.fleet.limitsOf(), s.tag)
	} else {
		s.limits = nil
	}
}

// admitSession holds a message of an agent session to its session's
// limits: the loop guard, then session_rate; its session_budget is one
// more of the holds planHolds plans. A request of no session, or of a key
// whose limits have none, pays nothing.
func (r *Relay) admitSession(in *inbound) *relayError {
	rules := in.who.key.sessions
	if rules == nil || in.route != routeMessages {
		return nil
	}
	sid := in.agentSession()
	if sid == "" {
		return nil
	}
	now := r.now()
	s := r.session(in, sid, rules, now)
	in.grant.session = s
	rc := in.ask.header.Get("X-Stainless-Retry-Count")
	retry := rc != "" && rc != "0" // an SDK's retry is the same request again, not a new turn
	s.mu.Lock()
	s.lastSeen = now
	switch {
	case in.ask.loop == 0:
		s.loopLast, s.loopCount = 0, 0
	case in.ask.loop != s.loopLast:
		s.loopLast, s.loopCount = in.ask.loop, 1
	case !retry:
		s.loopCount++
	}
	f, tag, lim := s.fleet, s.tag, s.limits
	s.mu.Unlock()
	if f != nil && rules.loopGuard > 0 {
		if run, ok := f.loopRun(tag, in.ask.loop, retry); ok { // the session's requests reach every relay
			s.mu.Lock()
			s.loopCount = run
			s.mu.Unlock()
		}
	}
	s.mu.Lock()
	looping := rules.loopGuard > 0 && s.loopCount >= rules.loopGuard
	if looping {
		s.loopHits++
	}
	s.mu.Unlock()
	if looping {
		metricSessionRefusals.WithLabelValues(s.group, sessionLoop).Inc()
		return errSessionLoop(in.who.key.describe(), rules.loopGuard)
	}
	if lim != nil {
		g, scope, wait := lim.Take(now, -1)
		switch scope {
		case limits.ScopeNone:
			in.grant.sessionGrant, in.grant.sessionLimits = g, lim
		case limits.ScopeFleetDown:
			return errStorageUnavailable()
		default:
			metricSessionRefusals.WithLabelValues(s.group, sessionRate).Inc()
			return errSessionRate(in.who.key.describe(), rules.rateSpec, wait)
		}
	}
	s.mu.Lock()
	s.requests++
	s.mu.Unlock()
	return nil
}

// sessionEnded gives back what the request's session admitted and adds
// its cost to the session's.
func (r *Relay) sessionEnded(in *inbound, cost float64) {
	s := in.grant.session
	if in.grant.sessionLimits != nil {
		in.grant.sessionLimits.Done(r.now(), in.grant.sessionGrant, 0)
		in.grant.sessionLimits = nil
	}
	if cost > 0 {
		s.mu.Lock()
		s.spent += money.ToNano(cost)
		s.mu.Unlock()
	}
}

// budgetAccount is the spend account of the session's budget; nil: none.
func (s *session) budgetAccount() *money.Account {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.spend
}

// agentSession is the request's agent session: Claude Code's
// X-Claude-Code-Session-Id, else the session part of metadata.user_id
// (`..._session_<id>`, or session_id of its JSON form); "" for none.
func (in *inbound) agentSession() string {
	if h := in.ask.header.Get("X-Claude-Code-Session-Id"); h != "" {
		return h
	}
	if u := in.ask.userID; u != "" {
		if i := strings.LastIndex(u, "_session_"); i >= 0 && i+len("_session_") < len(u) {
			return u[i+len("_session_"):]
		}
		if strings.HasPrefix(u, "{") {
			return jsonSessionID(u)
		}
	}
	return ""
}

// Reasons of relay_session_refusals_total.
const (
	sessionBudget = "budget"
	sessionRate   = "rate"
	sessionLoop   = "loop"
)

// window is how a session budget's window is said in messages: 5h, 30m.
func windowString(d time.Duration) string {
	s := d.String()
	s = strings.TrimSuffix(s, "0s")
	s = strings.TrimSuffix(s, "0m")
	return cmp.Or(s, d.String())
}
