package relay

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// TestTheRemainingHeaderCountsTheSessionBudget: a key with $5 a day whose
// sessions each have $0.30 an hour, its requests $0.10 each: every answer
// to a request of a session says in x-relay-budget-remaining-usd what is
// left of the tightest budget that applies, the session's (its own hold
// counted while it runs), down to 0 on the refusal past it; a request of
// no session is told what is left of the key's.
func TestTheRemainingHeaderCountsTheSessionBudget(t *testing.T) {
	var hits atomic.Int32
	up := fakeupstream.New(t, tenOutputTokens(&hits))
	const name = "session-remaining"
	const key = "sk-" + name + "-0123456789abcdef"
	r := &Relay{
		Keys: []*Key{{Secret: key, Group: name, KeyOptions: KeyOptions{Name: name, Budgets: []string{"5usd/day"},
			SessionLimits: SessionLimits{SessionBudget: "0.30usd/1h"}}}},
		Channels: []*Channel{{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}},
		Groups:   []*Group{{Name: name, Channels: []string{name + "-ch"}}},
		Pricing:  map[string]Price{"m-hold": {Input: 0, Output: 10_000}},
	}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 10, 15, 0, 0, time.UTC)}
	r.now = clock.now

	s := newCCSession("3f2e1d0c-9b8a-4765-8432-10fedcba9876")
	for i, want := range []string{"0.2", "0.1"} {
		s.prompt("step " + want)
		w, _ := serveHandler(t, r, s.request(key, 10))
		if w.Code != 200 {
			t.Fatalf("the session's request %d: %d %s", i+1, w.Code, w.Body)
		}
		if got := w.Header().Get(headerBudgetRemaining); got != want {
			t.Errorf("the session's request %d: x-relay-budget-remaining-usd %q, want the session's %q", i+1, got, want)
		}
	}
	// no session: the key's $5 less the $0.20 spent and its own hold
	w, _ := serveHandler(t, r, newRequest(`{"model":"m-hold","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`, key))
	if got := w.Header().Get(headerBudgetRemaining); w.Code != 200 || got != "4.7" {
		t.Errorf("a request of no session: %d, x-relay-budget-remaining-usd %q, want the key's 4.7", w.Code, got)
	}
	s.prompt("the last step")
	if w, _ := serveHandler(t, r, s.request(key, 10)); w.Code != 200 || w.Header().Get(headerBudgetRemaining) != "0" {
		t.Errorf("the session's third request: %d, x-relay-budget-remaining-usd %q, want 0", w.Code, w.Header().Get(headerBudgetRemaining))
	}
	s.prompt("one more")
	w, _ = serveHandler(t, r, s.request(key, 10))
	sessionRefusal(t, "past the session's budget", w, "session_budget_exceeded")
	if got := w.Header().Get(headerBudgetRemaining); got != "0" {
		t.Errorf("the refusal past the session's budget: x-relay-budget-remaining-usd %q, want 0", got)
	}
}

// TestBudgetDegradeCountsTheSessionBudget: budget_degrade steps by the
// tightest budget that applies to a message, the session's among them: a
// key with $5 a day, whose sessions have $0.40 an hour, serves a
// session's request as the cheaper model once the session has used half
// of its budget, while the key's budget is barely touched.
func TestBudgetDegradeCountsTheSessionBudget(t *testing.T) {
	var hits atomic.Int32
	up := fakeupstream.New(t, tenOutputTokens(&hits))
	const name = "session-degrade"
	const key = "sk-" + name + "-0123456789abcdef"
	r := &Relay{
		Keys: []*Key{{Secret: key, Group: name, KeyOptions: KeyOptions{Name: name, Budgets: []string{"5usd/day"},
			BudgetDegrade: []BudgetDegrade{{Percent: 50, Mode: degradeModel, Model: "m-hold-small"}},
			SessionLimits: SessionLimits{SessionBudget: "0.40usd/1h"}}}},
		Channels: []*Channel{{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}},
		Groups:   []*Group{{Name: name, Channels: []string{name + "-ch"}}},
		Pricing:  map[string]Price{"m-hold": {Input: 0, Output: 10_000}, "m-hold-small": {Input: 0, Output: 1_000}},
	}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 10, 15, 0, 0, time.UTC)}
	r.now = clock.now

	s := newCCSession("8d7c6b5a-4f3e-4d2c-9b1a-0f9e8d7c6b5a")
	for i, want := range []string{"", "", "m-hold-small"} { // at 0%, 25%, then 50% of the session's $0.40
		s.prompt("step")
		w, _ := serveHandler(t, r, s.request(key, 10))
		if w.Code != 200 {
			t.Fatalf("the session's request %d: %d %s", i+1, w.Code, w.Body)
		}
		if got := w.Header().Get("X-Relay-Model"); got != want {
			t.Errorf("the session's request %d: x-relay-model %q, want %q", i+1, got, want)
		}
	}
}
