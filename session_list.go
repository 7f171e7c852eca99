package relay

import (
	"cmp"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// What is shown of sessions: GET /relay/sessions (admin), the status
// page's sessions panel, and a principal's own (sessionsOf). Each view is
// of this relay's state: in a fleet, the spend of a session's budget
// window is the fleet's as of the last sync, the rest this node's.

// sessionView is one live session. It names the session by a digest of
// its id (the first 16 hex digits of its sha256), never the id: a session
// id is not a secret, but it is the client's, and nothing the relay keeps
// or shows holds one.
type sessionView struct {
	// Session is the digest of the session id.
	Session string `json:"session"`
	// Key is the name of the key or user entry it is served as.
	Key   string `json:"key"`
	Group string `json:"group"`
	// SpendUSD is what its requests cost on this relay.
	SpendUSD float64 `json:"spend_usd"`
	// Budget, when it has a session_budget: the window's budget, what was
	// spent and is held in it, and when it renews.
	BudgetUSD      float64    `json:"budget_usd,omitempty"`
	WindowSpendUSD float64    `json:"window_spend_usd,omitempty"`
	HeldUSD        float64    `json:"held_usd,omitempty"`
	Renews         *time.Time `json:"renews,omitempty"`
	// Requests counts the requests its limits admitted.
	Requests int64 `json:"requests"`
	// LoopGuardHits counts the requests its loop guard refused; LoopRun is
	// how many in a row ended with the same tool call and result now.
	LoopGuardHits int       `json:"loop_guard_hits"`
	LoopRun       int       `json:"loop_run"`
	LastSeen      time.Time `json:"last_seen"`
	// Started is when this relay first saw it.
	Started time.Time `json:"started"`
}

// view is the session's view at now.
func (s *session) view(now time.Time) sessionView {
	s.mu.Lock()
	v := sessionView{Session: s.id, Key: s.key, Group: s.group, SpendUSD: s.spent.USD(), Requests: s.requests,
		LoopGuardHits: s.loopHits, LoopRun: s.loopCount, LastSeen: s.lastSeen.UTC()}
	a := s.spend
	s.mu.Unlock()
	v.Started = s.started.UTC()
	if a != nil {
		limit, spent, end := a.WindowNow(now)
		v.BudgetUSD, v.WindowSpendUSD, v.HeldUSD = limit.USD(), spent.USD(), a.HeldUSD()
		end = end.UTC()
		v.Renews = &end
	}
	return v
}

// eachSession calls f with every live session of the groups' states gs,
// and the principal's state id it belongs to.
func eachSession(now time.Time, gs []*groupState, f func(stateID string, s *session)) {
	for _, st := range gs {
		c := st.sessions.Load()
		if c == nil {
			continue
		}
		c.Each(func(stateID string, ps *principalSessions) { eachLive(now, stateID, ps, f) })
	}
}

// eachLive calls f with every live session of one principal's.
func eachLive(now time.Time, stateID string, ps *principalSessions, f func(stateID string, s *session)) {
	ps.c.Each(func(_ string, s *session) {
		s.mu.Lock()
		live := now.Sub(s.lastSeen) < sessionIdle
		s.mu.Unlock()
		if live {
			f(stateID, s)
		}
	})
}

// sessionsOf lists the live sessions of one principal (its state id: a
// key's name, user:<id> for a user entry or an identity of user *) on
// this relay, the costliest first; never another principal's. It looks at
// the principal's own sessions only, not every group's.
func (r *Relay) sessionsOf(stateID string) []sessionView {
	now := r.now()
	out := []sessionView{}
	for _, g := range r.groups {
		c := g.state.sessions.Load()
		if c == nil {
			continue
		}
		if ps, ok := c.Peek(stateID); ok {
			eachLive(now, stateID, ps, func(_ string, s *session) { out = append(out, s.view(now)) })
		}
	}
	sortSessions(out)
	return out
}

// topSessions lists the n costliest live sessions of every group.
func topSessions(now time.Time, n int) []sessionView {
	var gs []*groupState
	groupStates.Range(func(_, v any) bool {
		gs = append(gs, v.(*groupState))
		return true
	})
	out := []sessionView{}
	eachSession(now, gs, func(_ string, s *session) { out = append(out, s.view(now)) })
	sortSessions(out)
	return out[:min(n, len(out))]
}

// sortSessions puts the costliest first (in their budget's window when
// they have one), then the last seen.
func sortSessions(v []sessionView) {
	slices.SortFunc(v, func(a, b sessionView) int {
		return cmp.Or(cmp.Compare(max(b.SpendUSD, b.WindowSpendUSD), max(a.SpendUSD, a.WindowSpendUSD)),
			b.LastSeen.Compare(a.LastSeen), strings.Compare(a.Session, b.Session))
	})
}

// Bounds of GET /relay/sessions?top=N.
const (
	defaultTopSessions = 20
	maxTopSessions     = 1000
)

// sessions answers GET /relay/sessions?top=N: the N costliest live
// sessions (default 20, at most 1000).
func (adminAPI) sessions(w http.ResponseWriter, r *http.Request) error {
	n := defaultTopSessions
	if q := r.URL.Query().Get("top"); q != "" {
		v, err := strconv.Atoi(q)
		if err != nil || v < 1 || v > maxTopSessions {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest,
				Err: fmt.Errorf("top must be a whole number from 1 to %d, not %q", maxTopSessions, q)}
		}
		n = v
	}
	return writeAdminJSON(w, topSessions(time.Now(), n))
}
