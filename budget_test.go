package relay

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/money"
)

// TestABadBudgetPeriodListsThePeriods reads a Caddyfile whose budget has a
// period the relay does not know: its error says which it does, total
// among them.
func TestABadBudgetPeriodListsThePeriods(t *testing.T) {
	_, err := parseRelay(t, "relay {\n\tkey sk-client-secret-0123456789 prod {\n\t\tbudget 5usd/year\n\t}\n\tchannel a {\n\t\tapi_key {env.A}\n\t}\n\tgroup prod {\n\t\tchannels a\n\t}\n}\n")
	if err == nil || !strings.Contains(err.Error(), "day, week or month") || !strings.Contains(err.Error(), "or total") {
		t.Errorf("budget 5usd/year: %v, want an error listing day, week, month and total", err)
	}
}

// budgetRelay is a relay with one key of the given budgets whose upstream
// reports 200,000 input tokens per answer at $1 per million: $0.20 each.
func budgetRelay(t *testing.T, name string, budgets []string, hits *atomic.Int64) (*Relay, *fakeClock) {
	t.Helper()
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m-budget", "ok", fakeupstream.Usage{InputTokens: 200_000}))
	}))
	key := Key{Secret: "sk-" + name, Group: name, KeyOptions: KeyOptions{Name: name, Budgets: budgets}}
	ch := &Channel{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	r := &Relay{Keys: []*Key{&key}, Channels: []*Channel{ch}, Groups: []*Group{{Name: name, Channels: []string{ch.Name}}},
		Pricing: map[string]Price{"m-budget": {Input: 1, Output: 1}}}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 23, 0, 0, 0, time.UTC)}
	r.now = clock.now
	return r, clock
}

// spendMetric reads one key's series of the spend collector.
func spendMetric(t *testing.T, name, key, period string) (float64, bool) {
	t.Helper()
	return scopeMetric(t, name, "key", key, period)
}

func TestBudgetIsEnforcedUntilThePeriodEnds(t *testing.T) {
	var hits atomic.Int64
	r, clock := budgetRelay(t, "budget-day", []string{"1usd/day", "100usd/month"}, &hits)
	core, logs := observer.New(zapcore.InfoLevel)
	r.logger = zap.New(core)
	send := func() *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(`{"model":"m-budget","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, "sk-budget-day"))
		return w
	}
	// five answers of $0.20 reach the $1 daily budget; the fifth starts
	// with $0.80 spent, so it is served
	for i := range 5 {
		if w := send(); w.Code != 200 {
			t.Fatalf("request %d: %d %s", i+1, w.Code, w.Body)
		}
		if i == 3 {
			if n := logs.FilterMessage("key budget nearly spent").Len(); n != 1 {
				t.Errorf("at $0.80 of $1: %d warnings, want 1", n)
			}
		}
	}
	if n := logs.FilterMessageSnippet("key budget spent").Len(); n != 1 {
		t.Errorf("at $1.00 of $1: %d lines saying the budget is spent, want 1", n)
	}
	w := send()
	var body struct {
		Error struct{ Type, Code, Message string }
	}
	_ = json.Unmarshal(w.Body.Bytes(), &body)
	if w.Code != 429 || body.Error.Type != "rate_limit_error" || body.Error.Code != "budget_exceeded" {
		t.Fatalf("over the budget: %d %s", w.Code, w.Body)
	}
	if !strings.Contains(body.Error.Message, `"budget-day"`) || !strings.Contains(body.Error.Message, "daily $1.00") {
		t.Errorf("message %q should name the key and the budget", body.Error.Message)
	}
	if ra := w.Header().Get("Retry-After"); ra != "3600" { // to midnight UTC
		t.Errorf("retry-after %q, want 3600", ra)
	}
	if w.Header().Get("X-Should-Retry") != "false" {
		t.Errorf("x-should-retry %q, want false", w.Header().Get("X-Should-Retry"))
	}
	if hits.Load() != 5 {
		t.Errorf("the upstream was called %d times, want 5", hits.Load())
	}
	if v, _ := spendMetric(t, "relay_spend_usd", "budget-day", "day"); v < 0.999 || v > 1.001 {
		t.Errorf("relay_spend_usd{period=day} = %v, want 1", v)
	}
	if v, _ := spendMetric(t, "relay_budget_warn_usd", "budget-day", "day"); v != 0.8 {
		t.Errorf("relay_budget_warn_usd{period=day} = %v, want 0.8", v)
	}
	if _, ok := spendMetric(t, "relay_spend_usd", "budget-day", "week"); ok {
		t.Error("a week without a budget is exported")
	}
	rows, _ := keyRows(t)
	if row := rows["budget-day"]; row.SpendUSD["day"] != 1 || row.BudgetUSD["day"] != 1 || row.RemainingUSD["day"] != 0 ||
		row.BudgetUSD["month"] != 100 || row.RemainingUSD["month"] != 99 || row.BudgetUSD["week"] != 0 {
		t.Errorf("GET /relay/keys: %s", show(row))
	}

	// a second before midnight: still refused; at midnight: a new day
	clock.advance(time.Hour - time.Second)
	if w := send(); w.Code != 429 {
		t.Fatalf("a second before midnight: %d", w.Code)
	}
	clock.advance(time.Second)
	if w := send(); w.Code != 200 {
		t.Fatalf("after midnight: %d %s", w.Code, w.Body)
	}
	if v, _ := spendMetric(t, "relay_spend_usd", "budget-day", "month"); v < 1.199 || v > 1.201 {
		t.Errorf("the month keeps counting: %v, want 1.2", v)
	}
}

// TestATotalBudgetNeverRenews spends a key's lifetime budget of $1: it
// is refused with 429 budget_exceeded saying the budget never renews and
// with no retry-after (no wait would help), before and after midnight and
// a year later, while its daily budget renews beside it.
func TestATotalBudgetNeverRenews(t *testing.T) {
	var hits atomic.Int64
	r, clock := budgetRelay(t, "budget-total", []string{"1usd/total", "0.9usd/day"}, &hits)
	core, logs := observer.New(zapcore.InfoLevel)
	r.logger = zap.New(core)
	send := func(maxTokens int) (*httptest.ResponseRecorder, string) {
		w, _ := serveHandler(t, r, newRequest(`{"model":"m-budget","max_tokens":`+strconv.Itoa(maxTokens)+`,"messages":[{"role":"user","content":"hi"}]}`, "sk-budget-total"))
		var body struct {
			Error struct{ Type, Code, Message string }
		}
		_ = json.Unmarshal(w.Body.Bytes(), &body)
		if w.Code == 429 && body.Error.Code != "budget_exceeded" {
			t.Errorf("a 429 of code %q, want budget_exceeded: %s", body.Error.Code, w.Body)
		}
		return w, body.Error.Message
	}
	noRetryAfter := func(what string, w *httptest.ResponseRecorder) {
		t.Helper()
		if ra, ms := w.Header().Get("Retry-After"), w.Header().Get("Retry-After-Ms"); ra != "" || ms != "" {
			t.Errorf("%s: retry-after %q, retry-after-ms %q; want none for a budget that never renews", what, ra, ms)
		}
		if w.Header().Get("X-Should-Retry") != "false" {
			t.Errorf("%s: x-should-retry %q, want false", what, w.Header().Get("X-Should-Retry"))
		}
	}
	// four answers of $0.20 at 23:00 UTC: $0.80 of the day's $0.90 and of
	// the total's $1
	for i := range 4 {
		if w, _ := send(8); w.Code != 200 {
			t.Fatalf("request %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	// midnight: the day renews, the total goes on
	clock.advance(time.Hour)
	// a request that may cost $0.30 cannot fit in the $0.20 left
	w, msg := send(300_000)
	if w.Code != 429 || !strings.Contains(msg, "cannot afford") || !strings.Contains(msg, "lifetime $1.00 budget, which never renews") {
		t.Fatalf("a request over what is left of the total: %d %q", w.Code, msg)
	}
	noRetryAfter("a request it cannot afford", w)
	if w, _ := send(8); w.Code != 200 {
		t.Fatalf("the fifth answer, after midnight: %d %s", w.Code, w.Body)
	}
	if n := logs.FilterMessageSnippet("key budget spent: it never renews").Len(); n != 1 {
		t.Errorf("at $1.00 of $1 in total: %d lines saying the budget is spent for good, want 1", n)
	}
	for _, later := range []time.Duration{0, 24 * time.Hour, 400 * 24 * time.Hour} {
		clock.advance(later)
		w, msg := send(8)
		if w.Code != 429 || !strings.Contains(msg, `"budget-total"`) || !strings.Contains(msg, "of its lifetime $1.00 budget; it never renews") {
			t.Fatalf("%v after the total was spent: %d %q", later, w.Code, msg)
		}
		noRetryAfter("a spent total", w)
	}
	if hits.Load() != 5 {
		t.Errorf("the upstream was called %d times, want 5", hits.Load())
	}
	rows, _ := keyRows(t)
	if row := rows["budget-total"]; row.SpendUSD["total"] != 1 || row.BudgetUSD["total"] != 1 || row.RemainingUSD["total"] != 0 || row.SpendUSD["day"] != 0 {
		t.Errorf("GET /relay/keys: %s", show(row))
	}
	if v, _ := spendMetric(t, "relay_spend_usd", "budget-total", "total"); v < 0.999 || v > 1.001 {
		t.Errorf("relay_spend_usd{period=total} = %v, want 1", v)
	}
	if v, _ := spendMetric(t, "relay_budget_usd", "budget-total", "total"); v != 1 {
		t.Errorf("relay_budget_usd{period=total} = %v, want 1", v)
	}
}

func TestBudgetRefusesARequestItCannotAffordUpFront(t *testing.T) {
	var hits atomic.Int64
	r, _ := budgetRelay(t, "budget-big", []string{"0.01usd/day"}, &hits)
	// about 25,000 tokens of input at $1 per million: $0.025, over $0.01
	big := `{"model":"m-budget","max_tokens":8,"messages":[{"role":"user","content":"` + strings.Repeat("word ", 20_000) + `"}]}`
	w, _ := serveHandler(t, r, newRequest(big, "sk-budget-big"))
	if w.Code != 429 || !strings.Contains(w.Body.String(), `"code":"budget_exceeded"`) || !strings.Contains(w.Body.String(), "cannot afford") {
		t.Fatalf("an unaffordable request: %d %s", w.Code, w.Body)
	}
	// sub-cent amounts keep their significant digits
	if msg := w.Body.String(); !strings.Contains(msg, "of its daily $0.01 budget") ||
		!regexp.MustCompile(`may cost up to \$0\.0[1-9]\d*\b`).MatchString(msg) || strings.Contains(msg, "$0.00") {
		t.Errorf("an unaffordable request's amounts: %s", msg)
	}
	if hits.Load() != 0 {
		t.Errorf("the upstream was called %d times, want 0", hits.Load())
	}
	// a small one is served
	if w, _ := serveHandler(t, r, newRequest(`{"model":"m-budget","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, "sk-budget-big")); w.Code != 200 {
		t.Fatalf("a small request: %d %s", w.Code, w.Body)
	}
}

func TestDollarsKeepSignificantDigits(t *testing.T) {
	for v, want := range map[float64]string{
		0: "$0.00", 0.0042: "$0.0042", 0.00421: "$0.0042", 0.01: "$0.01", 0.025: "$0.025",
		0.2: "$0.20", 0.0999: "$0.10", 1: "$1.00", 12.5: "$12.50", 200: "$200.00", 0.000000071: "$0.000000071",
	} {
		if got := dollars(v); got != want {
			t.Errorf("dollars(%v) = %s, want %s", v, got, want)
		}
	}
}

// TestBudgetAlertsOnRealSpend spends two keys' budgets through the relay,
// one to its warning share and one whole, hands what the relay exports to
// promtool, and evaluates the shipped budget alerts on it: each fires for
// its key alone.
func TestBudgetAlertsOnRealSpend(t *testing.T) {
	promtool := needTool(t, "promtool", "apt-get install -y prometheus")
	var hits atomic.Int64
	for name, answers := range map[string]int{"budget-alert-near": 4, "budget-alert-spent": 5, "budget-alert-low": 1} {
		r, _ := budgetRelay(t, name, []string{"1usd/day"}, &hits)
		for range answers {
			if w, _ := serveHandler(t, r, newRequest(`{"model":"m-budget","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, "sk-"+name)); w.Code != 200 {
				t.Fatalf("%s: %d", name, w.Code)
			}
		}
	}
	series := spendSeries(t, func(label, value string) bool {
		return label == "key" && strings.HasPrefix(value, "budget-alert-")
	})
	rules, err := filepath.Abs("examples/prometheus/relay-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	exprs := alertExprs(t, rules)
	promtoolTest(t, promtool, rules, series, fmt.Sprintf(`      - expr: %q
        eval_time: 5m
        exp_samples:
          - labels: '{key="budget-alert-near",period="day",scope="key"}'
            value: 0.8
      - expr: %q
        eval_time: 5m
        exp_samples:
          - labels: '{key="budget-alert-spent",period="day",scope="key"}'
            value: 1
`, exprs["RelayBudgetNearlySpent"], exprs["RelayBudgetExhausted"]), "the budget alerts on what the relay exported")
}

// userStarBudget provisions a relay whose user * entry of group name gives
// each identity a budget of $0.30 a day, on an upstream whose every answer
// costs $0.20 (200,000 input tokens at $1/MTok), stepped by an injected
// clock; body is a request for that priced model.
func userStarBudget(t *testing.T, name string) (*Relay, *fakeClock, string) {
	t.Helper()
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m-budget", "ok", fakeupstream.Usage{InputTokens: 200_000}))
	}))
	r := &Relay{
		Identity: "{http.auth.user.id}",
		Users:    []*User{{ID: "*", Group: name, KeyOptions: KeyOptions{Budgets: []string{"0.3usd/day"}}}},
		Keys:     []*Key{{Secret: "sk-" + name + "-key-0123456789abcdef", Group: name, KeyOptions: KeyOptions{Name: name + "-key"}}},
		Channels: []*Channel{{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}},
		Groups:   []*Group{{Name: name, Channels: []string{name + "-ch"}}},
		Pricing:  map[string]Price{"m-budget": {Input: 1, Output: 1}},
	}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 12, 0, 0, 0, time.UTC)}
	r.now = clock.now
	return r, clock, `{"model":"m-budget","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
}

// TestBudgetsOfUserStarAreEachIdentitys gives every identity of user * a
// budget of its own: bob spending his does not stop carol, and the
// identities' spend is kept but exported as no metric series (whose key
// label would grow with the identities).
func TestBudgetsOfUserStarAreEachIdentitys(t *testing.T) {
	r, clock, body := userStarBudget(t, "bstar")
	for i, want := range []int{200, 200, 429} { // $0.20, $0.40: the third starts over $0.30
		if w, _, _ := serveAs(t, r, "bob-bstar", "", body); w.Code != want {
			t.Fatalf("bob's request %d: %d, want %d: %s", i+1, w.Code, want, w.Body)
		}
	}
	if w, _, _ := serveAs(t, r, "carol-bstar", "", body); w.Code != 200 {
		t.Fatalf("carol after bob spent his budget: %d %s", w.Code, w.Body)
	}
	if _, ok := spendMetric(t, "relay_spend_usd", "user:*", "day"); ok {
		t.Error("the spend of user * identities is exported under the label user:*")
	}
	clock.advance(12 * time.Hour)
	if w, _, _ := serveAs(t, r, "bob-bstar", "", body); w.Code != 200 {
		t.Fatalf("bob on the next day: %d %s", w.Code, w.Body)
	}
}

// TestAnIdleIdentityKeepsItsSpend lets an identity of user * go idle until
// its state is dropped: its spend account leaves the pool with it, and
// what it spent comes back with it.
func TestAnIdleIdentityKeepsItsSpend(t *testing.T) {
	r, clock, body := userStarBudget(t, "bidle")
	held := func(stateID string) bool {
		return money.Refs(stateID) > 0
	}
	if w, _, _ := serveAs(t, r, "dave-bidle", "", body); w.Code != 200 { // $0.20 of $0.30
		t.Fatalf("dave: %d %s", w.Code, w.Body)
	}
	clock.advance(idleAfter + time.Minute)
	if w, _, _ := serveAs(t, r, "erin-bidle", "", body); w.Code != 200 { // her request sweeps dave's idle state
		t.Fatalf("erin: %d %s", w.Code, w.Body)
	}
	if held("user:dave-bidle") {
		t.Fatal("the spend account of an identity whose state was dropped is still held")
	}
	for i, want := range []int{200, 429} { // $0.40, then over the budget: his $0.20 came back
		if w, _, _ := serveAs(t, r, "dave-bidle", "", body); w.Code != want {
			t.Fatalf("dave's request %d after his pause: %d, want %d: %s", i+1, w.Code, want, w.Body)
		}
	}
}
