package relay

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/money"
)

// A scripted Claude Code session: the request shapes Claude Code sends,
// each turn of an agent loop a tool call of the assistant and its result.

// ccSession is one Claude Code session as the relay sees it: its id in
// the X-Claude-Code-Session-Id header and at the end of metadata.user_id.
type ccSession struct {
	id     string
	turns  []string // the messages after the prompt, as JSON
	header bool     // sends the header (else only metadata.user_id)
}

func newCCSession(id string) *ccSession { return &ccSession{id: id, header: true} }

// toolTurn adds an assistant's tool call (name, input) and the user's
// tool result (content, is_error), each with a new id as Claude Code's.
func (s *ccSession) toolTurn(name, input, result string, isError bool) {
	id := "toolu_" + strconv.Itoa(len(s.turns)) + "abc"
	s.turns = append(s.turns,
		`{"role":"assistant","content":[{"type":"text","text":"Let me run it."},{"type":"tool_use","id":"`+id+`","name":"`+name+`","input":`+input+`}]}`,
		`{"role":"user","content":[{"type":"tool_result","tool_use_id":"`+id+`","content":`+strconv.Quote(result)+`,"is_error":`+strconv.FormatBool(isError)+`}]}`)
}

// prompt adds the person's next prompt.
func (s *ccSession) prompt(text string) {
	s.turns = append(s.turns, `{"role":"assistant","content":[{"type":"text","text":"Done."}]}`, `{"role":"user","content":`+strconv.Quote(text)+`}`)
}

// body is the next request's body, asking for up to maxTokens of m-hold.
func (s *ccSession) body(maxTokens int) string {
	msgs := append([]string{`{"role":"user","content":[{"type":"text","text":"make the tests pass"}]}`}, s.turns...)
	return `{"model":"m-hold","max_tokens":` + strconv.Itoa(maxTokens) +
		`,"system":[{"type":"text","text":"You are Claude Code, Anthropic's official CLI for Claude."}]` +
		`,"tools":[{"name":"Bash","description":"Run a command","input_schema":{"type":"object","properties":{"command":{"type":"string"}}}}]` +
		`,"metadata":{"user_id":"user_7f3a9c0d_account_1b2c3d4e_session_` + s.id + `"}` +
		`,"messages":[` + strings.Join(msgs, ",") + `],"stream":false}`
}

// request is the next request of the session, with key.
func (s *ccSession) request(key string, maxTokens int) *http.Request {
	req := newRequest(s.body(maxTokens), key)
	req.Header.Set("User-Agent", "claude-cli/2.0.14 (external, cli)")
	req.Header.Set("Anthropic-Version", "2023-06-01")
	req.Header.Set("X-Stainless-Retry-Count", "0")
	if s.header {
		req.Header.Set("X-Claude-Code-Session-Id", s.id)
	}
	return req
}

// sessionRelay is a relay of one key with session limits, on upstream h;
// as holdRelay's, its model m-hold costs $0.01 an output token.
func sessionRelay(t *testing.T, name *string, limits SessionLimits, h http.Handler) *Relay {
	t.Helper()
	*name += "-" + strconv.FormatInt(holdRelays.Add(1), 10)
	up := fakeupstream.New(t, h)
	if g, ok := h.(*gate); ok {
		t.Cleanup(g.openAll)
	}
	n := *name
	keys := []*Key{
		{Secret: "sk-" + n, Group: n, KeyOptions: KeyOptions{Name: n, SessionLimits: limits}},
		{Secret: "sk-other-" + n, Group: n, KeyOptions: KeyOptions{Name: "other-" + n}}, // the group's session limits
	}
	ch := &Channel{Name: n + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	g := &Group{Name: n, Channels: []string{ch.Name}, SessionLimits: SessionLimits{LoopGuard: 3}}
	r := &Relay{Keys: keys, Channels: []*Channel{ch}, Groups: []*Group{g},
		Pricing: map[string]Price{"m-hold": {Input: 0, Output: 10_000}}}
	provisionHandler(t, r)
	return r
}

// tenOutputTokens answers every message with 10 output tokens: $0.10 of
// m-hold.
func tenOutputTokens(hits *atomic.Int32) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m-hold", "ok", fakeupstream.Usage{OutputTokens: 10}))
	}
}

// sessionRefusal checks a session's refusal: 429 rate_limit_error with
// code, x-should-retry: false, and a message that says what each of
// words says; it returns the message.
func sessionRefusal(t *testing.T, what string, w *httptest.ResponseRecorder, code string, words ...string) string {
	t.Helper()
	typ, got, msg := budgetError(t, w)
	if w.Code != 429 || typ != "rate_limit_error" || got != code {
		t.Fatalf("%s: %d %s, want 429 rate_limit_error %s", what, w.Code, w.Body, code)
	}
	if w.Header().Get("X-Should-Retry") != "false" {
		t.Errorf("%s: x-should-retry %q, want false", what, w.Header().Get("X-Should-Retry"))
	}
	for _, word := range words {
		if !strings.Contains(msg, word) {
			t.Errorf("%s: the message %q does not say %q", what, msg, word)
		}
	}
	return msg
}

// TestASessionOverItsBudgetIsToldWhatToDo: a Claude Code session under
// session_budget 0.30usd/1h spends $0.10 a request; its fourth request is
// refused, saying the budget, what was spent, when it renews and what to
// do, with a retry-after to the window's end; another session of the key
// is served; the window's end renews it.
func TestASessionOverItsBudgetIsToldWhatToDo(t *testing.T) {
	var hits atomic.Int32
	name := "session-budget"
	r := sessionRelay(t, &name, SessionLimits{SessionBudget: "0.30usd/1h"}, tenOutputTokens(&hits))
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 10, 15, 0, 0, time.UTC)}
	r.now = clock.now
	key := "sk-" + name
	s := newCCSession("5e2d1c3a-0f1e-4b8a-9c7d-2e4f6a8b0c1d")
	for i := range 3 {
		s.toolTurn("Bash", `{"command":"ls src/`+strconv.Itoa(i)+`"}`, "a.go b.go", false)
		if w, _ := serveHandler(t, r, s.request(key, 10)); w.Code != 200 {
			t.Fatalf("request %d of the session: %d %s", i+1, w.Code, w.Body)
		}
	}
	s.toolTurn("Bash", `{"command":"go test ./..."}`, "ok", false)
	w, _ := serveHandler(t, r, s.request(key, 10))
	sessionRefusal(t, "the request past the session's budget", w, "session_budget_exceeded",
		"this session has spent $0.30 of its budget of $0.30 per 1h", `session_budget of key "`+name+`"`,
		"renews in 45m0s, at 11:00 UTC", "Start a new session")
	if w.Header().Get("Retry-After") != "2700" {
		t.Errorf("retry-after %q, want 2700 (to 11:00)", w.Header().Get("Retry-After"))
	}
	if hits.Load() != 3 {
		t.Errorf("the upstream saw %d requests, want 3", hits.Load())
	}
	// the same session known by metadata.user_id alone
	s.header = false
	w, _ = serveHandler(t, r, s.request(key, 10))
	sessionRefusal(t, "the same session without the header", w, "session_budget_exceeded")

	// a request that could never fit in what is left says so
	fresh := newCCSession("0b7c0cf4-4a57-4e0c-8a59-5b1f6c2d3e4f")
	w, _ = serveHandler(t, r, fresh.request(key, 10))
	if w.Code != 200 {
		t.Fatalf("another session of the key: %d %s", w.Code, w.Body)
	}
	w, _ = serveHandler(t, r, fresh.request(key, 25))
	sessionRefusal(t, "a request over what is left", w, "session_budget_exceeded",
		"cannot afford this request: it may cost up to $0.25", "$0.20 remains of its budget of $0.30 per 1h", "Lower max_tokens")

	clock.advance(45 * time.Minute) // 11:00: a new window
	if w, _ := serveHandler(t, r, s.request(key, 10)); w.Code != 200 {
		t.Fatalf("the session in its next window: %d %s", w.Code, w.Body)
	}
	if v := testutil.ToFloat64(metricSessionRefusals.WithLabelValues(name, "budget")); v != 3 {
		t.Errorf("relay_session_refusals_total{reason=budget} = %v, want 3", v)
	}
}

// TestParallelRequestsOfASessionCannotOverspend: requests of one session
// in flight together hold their worst cases against its budget; one that
// does not fit beside them waits for them, and what the session spends
// never passes the budget.
func TestParallelRequestsOfASessionCannotOverspend(t *testing.T) {
	g, name := newGate(), "session-holds"
	r := sessionRelay(t, &name, SessionLimits{SessionBudget: "0.30usd/1h"}, g)
	key := "sk-" + name
	s := newCCSession("9d1e2f3a-4b5c-6d7e-8f90-a1b2c3d4e5f6")
	var inFlight []*sent
	for i := range 3 { // each holds $0.10: $0.30 held
		inFlight = append(inFlight, serveAsync(t, r, key, s.body(10)))
		g.arrival(t, "request "+strconv.Itoa(i+1))
	}
	sv := r.sessionsOf(name)
	if len(sv) != 1 || sv[0].HeldUSD < 0.2999 || sv[0].HeldUSD > 0.3001 || sv[0].BudgetUSD != 0.3 {
		t.Fatalf("three requests in flight: sessions %+v, want one holding $0.30 of $0.30", sv)
	}
	fourth := serveAsync(t, r, key, s.body(10))
	var sa *money.Account
	eachSession(r.now(), []*groupState{r.groups[name].state}, func(_ string, ss *session) { sa = ss.spend })
	waitFor(t, "the fourth queued on the session's budget", 5*time.Second, func() bool { return queuedOn(r, name, sa) })
	g.openAll() // each costs $0.10: the budget is spent, and the fourth cannot go
	for i, x := range inFlight {
		if w := x.wait(t, "request "+strconv.Itoa(i+1)); w.Code != 200 {
			t.Fatalf("request %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	sessionRefusal(t, "the fourth", fourth.wait(t, "the fourth"), "session_budget_exceeded", "has spent $0.30")
	sv = r.sessionsOf(name)
	if len(sv) != 1 || sv[0].WindowSpendUSD < 0.2999 || sv[0].WindowSpendUSD > 0.3001 || sv[0].HeldUSD != 0 || sv[0].Requests != 4 {
		t.Fatalf("after all: %+v, want $0.30 spent, nothing held, 4 requests admitted", sv)
	}
}

// TestLoopGuardStopsALoopingSession: Claude Code runs the same failing
// test again and again; under loop_guard 5 the fifth request that ends
// with the same call and the same result is refused, and so is a sixth;
// an SDK retry does not count; a different result is served at once.
func TestLoopGuardStopsALoopingSession(t *testing.T) {
	var hits atomic.Int32
	name := "session-loop"
	r := sessionRelay(t, &name, SessionLimits{LoopGuard: 5}, tenOutputTokens(&hits))
	key := "sk-" + name
	s := newCCSession("3c4d5e6f-7a8b-4c9d-8e0f-1a2b3c4d5e6f")
	failing := func() { s.toolTurn("Bash", `{"command":"npm test"}`, "FAIL src/app.test.js: expected 2, got 3", true) }
	for i := range 4 {
		failing()
		if w, _ := serveHandler(t, r, s.request(key, 10)); w.Code != 200 {
			t.Fatalf("loop turn %d: %d %s", i+1, w.Code, w.Body)
		}
		if i == 1 { // the SDK retries turn 2: the same request again does not count
			req := s.request(key, 10)
			req.Header.Set("X-Stainless-Retry-Count", "1")
			if w, _ := serveHandler(t, r, req); w.Code != 200 {
				t.Fatalf("a retry: %d %s", w.Code, w.Body)
			}
		}
	}
	failing()
	w, _ := serveHandler(t, r, s.request(key, 10))
	sessionRefusal(t, "the fifth same call and result", w, "session_loop",
		"the same tool call with the same result 5 times in a row", `loop_guard 5 of key "`+name+`"`, "new instructions")
	if w.Header().Get("Retry-After") != "" {
		t.Errorf("a loop has no retry-after: %q", w.Header().Get("Retry-After"))
	}
	failing()
	w, _ = serveHandler(t, r, s.request(key, 10))
	sessionRefusal(t, "the sixth", w, "session_loop")
	if hits.Load() != 4 { // the retry was answered from the request it repeats (dedup.go)
		t.Errorf("the upstream saw %d requests, want 4", hits.Load())
	}
	// another result ends the loop
	s.toolTurn("Bash", `{"command":"npm test"}`, "PASS src/app.test.js", false)
	if w, _ := serveHandler(t, r, s.request(key, 10)); w.Code != 200 {
		t.Fatalf("a different last result: %d %s", w.Code, w.Body)
	}
	sv := r.sessionsOf(name)
	if len(sv) != 1 || sv[0].LoopGuardHits != 2 || sv[0].Requests != 6 || sv[0].Session != sessionDigest(s.id) {
		t.Fatalf("the session: %+v, want 2 loop guard hits and 6 requests admitted", sv)
	}
	if v := testutil.ToFloat64(metricSessionRefusals.WithLabelValues(name, "loop")); v != 2 {
		t.Errorf("relay_session_refusals_total{reason=loop} = %v, want 2", v)
	}

	// the other key of the group takes the group's loop_guard 3, and has
	// sessions of its own: the same session id is another session there
	other := "sk-other-" + name
	for i := range 2 {
		if w, _ := serveHandler(t, r, s.request(other, 10)); w.Code != 200 {
			t.Fatalf("the other key's request %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	w, _ = serveHandler(t, r, s.request(other, 10))
	sessionRefusal(t, "the other key's third", w, "session_loop", "loop_guard 3")
	if len(r.sessionsOf("other-"+name)) != 1 || len(r.sessionsOf(name)) != 1 {
		t.Errorf("each key sees its own session only: %+v, %+v", r.sessionsOf("other-"+name), r.sessionsOf(name))
	}
}

// TestSessionRateAndRequestsWithoutASession: session_rate holds each
// session to its rate; a request of no session (no header, a user_id with
// no session part) is held to none of the session limits.
func TestSessionRateAndRequestsWithoutASession(t *testing.T) {
	var hits atomic.Int32
	name := "session-rate"
	r := sessionRelay(t, &name, SessionLimits{SessionRate: "2/m"}, tenOutputTokens(&hits))
	key := "sk-" + name
	s := newCCSession("aa11bb22-cc33-4d44-8e55-ff6677889900")
	for i := range 2 {
		s.prompt("step " + strconv.Itoa(i))
		if w, _ := serveHandler(t, r, s.request(key, 10)); w.Code != 200 {
			t.Fatalf("request %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	w, _ := serveHandler(t, r, s.request(key, 10))
	sessionRefusal(t, "the third in a minute", w, "session_rate_limited", "rate of 2/m", "may send again in")
	if ra, _ := strconv.Atoi(w.Header().Get("Retry-After")); ra < 1 || ra > 30 {
		t.Errorf("retry-after %q, want the time to the next request", w.Header().Get("Retry-After"))
	}
	if w, _ := serveHandler(t, r, newCCSession("another").request(key, 10)); w.Code != 200 {
		t.Fatalf("another session: %d %s", w.Code, w.Body)
	}
	for i := range 3 {
		body := `{"model":"m-hold","max_tokens":10,"metadata":{"user_id":"end-user-42"},"messages":[{"role":"user","content":"hi"}]}`
		if w, _ := serveHandler(t, r, newRequest(body, key)); w.Code != 200 {
			t.Fatalf("request %d of no session: %d %s", i+1, w.Code, w.Body)
		}
	}
}

// TestGetRelaySessionsListsTheCostliest: GET /relay/sessions?top=N lists
// the costliest live sessions, by a digest of their id, never the id.
func TestGetRelaySessionsListsTheCostliest(t *testing.T) {
	var hits atomic.Int32
	name := "session-admin"
	r := sessionRelay(t, &name, SessionLimits{SessionBudget: "5usd/24h"}, tenOutputTokens(&hits))
	key := "sk-" + name
	cheap, dear := newCCSession("cheap-"+name), newCCSession("dear-"+name)
	for range 2 {
		dear.prompt("more")
		serveHandler(t, r, dear.request(key, 10))
	}
	serveHandler(t, r, cheap.request(key, 10))
	get := func(query string) (int, []sessionView, string) {
		w := httptest.NewRecorder()
		err := (adminAPI{}).sessions(w, httptest.NewRequest(http.MethodGet, "/relay/sessions"+query, nil))
		if err != nil {
			return 400, nil, err.Error()
		}
		var rows []sessionView
		if err := json.Unmarshal(w.Body.Bytes(), &rows); err != nil {
			t.Fatalf("%v: %s", err, w.Body)
		}
		return w.Code, rows, w.Body.String()
	}
	_, rows, body := get("?top=1000")
	var mine []sessionView
	for _, row := range rows {
		if row.Key == name {
			mine = append(mine, row)
		}
	}
	if len(mine) != 2 || mine[0].Session != sessionDigest(dear.id) || mine[0].SpendUSD != 0.2 || mine[0].Requests != 2 ||
		mine[1].Session != sessionDigest(cheap.id) || mine[0].Group != name || mine[0].BudgetUSD != 5 || mine[0].Renews == nil {
		t.Fatalf("the key's sessions: %+v", mine)
	}
	if strings.Contains(body, dear.id) || strings.Contains(body, cheap.id) {
		t.Errorf("GET /relay/sessions shows a session id: %s", body)
	}
	if _, rows, _ := get("?top=1"); len(rows) != 1 {
		t.Errorf("top=1: %d rows", len(rows))
	}
	if code, _, msg := get("?top=0"); code != 400 || !strings.Contains(msg, "top must be") {
		t.Errorf("top=0: %d %s", code, msg)
	}
}

// TestSessionAlertRules evaluates the session alerts with promtool: a loop
// guard's refusal pages once, a steady stream of refusals for 15 minutes
// pages, a few refusals do not.
func TestSessionAlertRules(t *testing.T) {
	promtool := needTool(t, "promtool", "apt-get install -y prometheus")
	rules, err := filepath.Abs("examples/prometheus/relay-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	exprs := alertExprs(t, rules)
	series := `      - series: 'relay_session_refusals_total{group="looping",reason="loop"}'
        values: '0 0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'relay_session_refusals_total{group="runaway",reason="budget"}'
        values: '0+5x30'
      - series: 'relay_session_refusals_total{group="calm",reason="budget"}'
        values: '0 1 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2'
`
	promtoolTest(t, promtool, rules, series, fmt.Sprintf(`      - expr: %q
        eval_time: 5m
        exp_samples:
          - labels: '{group="looping"}'
            value: 1
      - expr: %q
        eval_time: 25m
        exp_samples:
          - labels: '{group="runaway",reason="budget"}'
            value: 5
`, exprs["RelaySessionLooping"], "round("+exprs["RelaySessionRefusalsSustained"]+")"), "the session alerts")
}

// BenchmarkServeHTTPSessions is BenchmarkServeHTTP for requests of 100
// Claude Code sessions under session_budget, session_rate and loop_guard:
// what a session's state, its hold and its loop guard's reading cost.
func BenchmarkServeHTTPSessions(b *testing.B) {
	up := fakeupstream.Start(fakeupstream.Fast(), false)
	defer up.Close()
	name := "bench-sessions"
	limits := SessionLimits{SessionBudget: "1000000usd/24h", SessionRate: "1000000/s", LoopGuard: 5}
	r := &Relay{
		Identity: "{http.request.header.X-Bench-User}",
		Users:    []*User{{ID: "*", Group: name, KeyOptions: KeyOptions{SessionLimits: limits}}},
		Channels: []*Channel{{Name: name, UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey), Models: []string{"claude-sonnet-4-5"}}},
		Groups:   []*Group{{Name: name, Channels: []string{name}}},
	}
	benchLoop(b, r, len(benchBody), func(i int) *http.Request {
		req := httptest.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(benchBody))
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("X-Bench-User", "dev@bench.example")
		req.Header.Set("X-Claude-Code-Session-Id", "session-"+strconv.Itoa(i%100))
		return req
	})
}

// TestAnIdleSessionIsDroppedWithItsAccount: a session unused for
// sessionIdle, with nothing in flight, is dropped when another session
// comes, and its spend account leaves the pool: a session's spend is never
// kept past its session.
func TestAnIdleSessionIsDroppedWithItsAccount(t *testing.T) {
	var hits atomic.Int32
	name := "session-idle"
	r := sessionRelay(t, &name, SessionLimits{SessionBudget: "1usd/1h"}, tenOutputTokens(&hits))
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 10, 0, 0, 0, time.UTC)}
	r.now = clock.now
	key := "sk-" + name
	old := newCCSession("idle-" + name)
	if w, _ := serveHandler(t, r, old.request(key, 10)); w.Code != 200 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	account := sessionSpendPrefix + fleet.Digest(name+"\x00"+old.id)
	if n := money.Refs(account); n != 1 {
		t.Fatalf("the session's account has %d references, want 1", n)
	}
	clock.advance(sessionIdle + time.Minute)
	if w, _ := serveHandler(t, r, newCCSession("new-"+name).request(key, 10)); w.Code != 200 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	if n := money.Refs(account); n != 0 {
		t.Errorf("the idle session's account has %d references, want none", n)
	}
	if sv := r.sessionsOf(name); len(sv) != 1 || sv[0].Session != sessionDigest("new-"+name) {
		t.Errorf("sessions after the idle one went: %+v", sv)
	}
}
