package relay

import (
	"strconv"
	"sync/atomic"
	"testing"
)

// TestAnotherKeysSessionIDsCannotPushOutASession: key B of the group sends
// more made-up session ids than a principal's sessions are bounded to; key
// A's session is its own principal's, keeps its budget's spend, and goes
// on from it.
func TestAnotherKeysSessionIDsCannotPushOutASession(t *testing.T) {
	var hits atomic.Int32
	name := "session-flood"
	r := sessionRelay(t, &name, SessionLimits{SessionBudget: "5usd/1h"}, tenOutputTokens(&hits))
	s := newCCSession("5e6f7a8b-9c0d-4e1f-8a2b-3c4d5e6f7a8b")
	if w, _ := serveHandler(t, r, s.request("sk-"+name, 10)); w.Code != 200 {
		t.Fatalf("key A's first request: %d %s", w.Code, w.Body)
	}
	before := r.sessionsOf(name)
	if len(before) != 1 || before[0].WindowSpendUSD < 0.0999 || before[0].BudgetUSD != 5 {
		t.Fatalf("key A's session: %+v, want $0.10 spent of $5", before)
	}

	k := r.keys[digestOf("sk-other-"+name)]
	r.activate(k)
	in := &inbound{}
	in.who.key, in.who.state, in.who.stateID = k, k.state, k.stateID
	now := r.now()
	for i := range maxSessions + 100 {
		r.session(in, "made-up-"+strconv.Itoa(i), k.sessions, now)
	}
	ps, _ := r.groups[name].state.sessions.Load().Peek(k.stateID)
	if n := ps.c.Len(); n != maxSessions {
		t.Errorf("key B keeps %d sessions, want its bound %d", n, maxSessions)
	}
	after := r.sessionsOf(name)
	if len(after) != 1 || after[0].WindowSpendUSD != before[0].WindowSpendUSD || after[0].Session != sessionDigest(s.id) {
		t.Fatalf("key A's session after key B's flood: %+v, want it with its $%v spent", after, before[0].WindowSpendUSD)
	}
	s.prompt("and now?")
	if w, _ := serveHandler(t, r, s.request("sk-"+name, 10)); w.Code != 200 {
		t.Fatalf("key A's second request: %d %s", w.Code, w.Body)
	}
	if sv := r.sessionsOf(name); len(sv) != 1 || sv[0].WindowSpendUSD < 0.1999 || sv[0].Requests != 2 {
		t.Fatalf("key A's session goes on from its spend: %+v, want $0.20 spent, 2 requests", sv)
	}
}
