package relay

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// meteredAnswer answers a message with the output tokens out says (the
// model echoed), so a test sets what each answer costs.
func meteredAnswer(out *atomic.Int64) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Model  string `json:"model"`
			Stream bool   `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		u := fakeupstream.Usage{OutputTokens: int(out.Load())}
		if req.Stream {
			fakeupstream.Stream(fakeupstream.StreamEvents(req.Model, u, "o", "k")...).ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody(req.Model, "ok", u))
	}
}

// The prices of the degrade tests: no price for input, so a message's
// worst case is its max_tokens (20) at the output price: $0.20 for
// m-dg-big ($0.01 a token), $0.02 for m-dg-small ($0.001 a token).
const degradePricing = "\t\tpricing {\n\t\t\tm-dg-big input 0 output 10000\n\t\t\tm-dg-small input 0 output 1000\n\t\t}\n"

// degradeBody asks m-dg-big for at most 20 tokens.
const degradeBody = `{"model":"m-dg-big","max_tokens":20,"messages":[{"role":"user","content":"go on"}]}`

// TestBudgetDegradeStepsDownBeforeRefusing spends a key's $10 daily
// budget on a running Caddy whose group has a full-price channel (weighted
// a million to one) and one at half price: below 80% the full-price one
// serves; from 80% the cheaper one does (budget_degrade 80% cheaper); from
// 95% the message is served as m-dg-small (the upstream receives the
// client's body with only the model changed, the answer says so in
// x-relay-model, and it is billed at m-dg-small's price); at 100% the key
// gets 429 budget_exceeded and no upstream is asked. Every answer says
// what is left in x-relay-budget-remaining-usd, holds included.
func TestBudgetDegradeStepsDownBeforeRefusing(t *testing.T) {
	var out atomic.Int64
	full := fakeupstream.New(t, meteredAnswer(&out))
	cheap := fakeupstream.New(t, meteredAnswer(&out))
	const key = "sk-degrade-steps-0123456789abcdef"
	ask := oneConnection(t)
	startRelay(t, degradePricing+
		channelBlock("dg-steps-full", full.URL, "models m-dg-big m-dg-small", "weight 1000000")+
		channelBlock("dg-steps-cheap", cheap.URL, "models m-dg-big m-dg-small", "price_factor 0.5")+
		"\t\tkey "+key+" dg-steps {\n\t\t\tname dg-steps\n\t\t\tbudget 10usd/day\n\t\t\tbudget_degrade 80% cheaper\n\t\t\tbudget_degrade 95% model m-dg-small\n\t\t}\n"+
		"\t\tgroup dg-steps {\n\t\t\tchannels dg-steps-full dg-steps-cheap\n\t\t}\n")
	degraded := func(mode string) float64 {
		mf, _ := scrape(t)
		return max(0, value(mf, "relay_degraded_total", "group=dg-steps", "mode="+mode))
	}
	step := func(name string, tokens int64, by *fakeupstream.Upstream, model, remaining string, cheaper, swapped float64) {
		t.Helper()
		out.Store(tokens)
		fullHits, cheapHits := full.Hits(), cheap.Hits()
		r := ask(t, http.MethodPost, "/v1/messages", key, degradeBody)
		if r.status != 200 {
			t.Fatalf("%s: %d %s", name, r.status, r.body)
		}
		hit := map[*fakeupstream.Upstream]int{full: full.Hits() - fullHits, cheap: cheap.Hits() - cheapHits}
		if hit[by] != 1 || hit[full]+hit[cheap] != 1 {
			t.Errorf("%s: the full-price channel answered %d, the cheaper %d; want the %s one", name, hit[full], hit[cheap], map[bool]string{true: "full-price", false: "cheaper"}[by == full])
		}
		if got := r.header.Get("X-Relay-Model"); got != model {
			t.Errorf("%s: x-relay-model %q, want %q", name, got, model)
		}
		if got := r.header.Get("X-Relay-Budget-Remaining-Usd"); got != remaining {
			t.Errorf("%s: x-relay-budget-remaining-usd %q, want %q", name, got, remaining)
		}
		if c, m := degraded("cheaper"), degraded("model"); c != cheaper || m != swapped {
			t.Errorf("%s: relay_degraded_total cheaper %v, model %v; want %v and %v", name, c, m, cheaper, swapped)
		}
	}
	// each remaining is $10 less what was spent, less the request's own
	// hold of its worst case while it runs
	step("at 0%", 790, full, "", "9.8", 0, 0)              // $7.90 spent
	step("at 79%", 10, full, "", "1.9", 0, 0)              // $8.00
	step("at 80%", 20, cheap, "", "1.8", 1, 0)             // 20 tokens at half price: $8.10
	step("at 81%", 280, cheap, "", "1.7", 2, 0)            // $9.50
	step("at 95%", 100, cheap, "m-dg-small", "0.48", 3, 1) // 100 small tokens at half price: $9.55
	if got, want := string(cheap.Last(t).Body), strings.Replace(degradeBody, `"m-dg-big"`, `"m-dg-small"`, 1); got != want {
		t.Errorf("at 95%% the upstream received\n%s\nwant the client's body with only the model changed:\n%s", got, want)
	}
	step("at 95.5%", 900, cheap, "m-dg-small", "0.43", 4, 2) // $10.00

	hits := full.Hits() + cheap.Hits()
	r := ask(t, http.MethodPost, "/v1/messages", key, degradeBody)
	wantRelayError(t, r, 429, "rate_limit_error", "budget_exceeded")
	if got := r.header.Get("X-Relay-Budget-Remaining-Usd"); got != "0" {
		t.Errorf("the spent budget's 429: x-relay-budget-remaining-usd %q, want 0", got)
	}
	if full.Hits()+cheap.Hits() != hits {
		t.Error("a key whose budget is spent reached an upstream")
	}
	if c, m := degraded("cheaper"), degraded("model"); c != 4 || m != 2 {
		t.Errorf("a refused request counted as degraded: cheaper %v, model %v", c, m)
	}
	// the swapped requests were billed at m-dg-small's price
	u := usageOf(t, ask, key)
	if u.SpendUSD["day"] != 10 || len(u.Budgets) != 1 || u.Budgets[0].RemainingUSD != 0 {
		t.Errorf("GET /v1/relay/usage after the budget is spent: %s", show(u))
	}
}

// TestTheRemainingHeaderIsOnEveryAnswer asks, on a running Caddy, with a
// key of a $5 daily budget (and a looser monthly one): a message, an
// upstream's error, the relay's own error, the models list, a stream, a
// Chat Completion;
// each answer says exactly what is left of the daily budget, its own hold
// counted while it runs. A key without a budget gets no such header, not
// even the one its upstream (a relay itself) sent.
func TestTheRemainingHeaderIsOnEveryAnswer(t *testing.T) {
	var out atomic.Int64
	out.Store(100) // $1 a message of m-dg-big
	metered := meteredAnswer(&out)
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Relay-Budget-Remaining-Usd", "999") // the operator's own, at an upstream relay
		metered(w, r)
	}))
	failing := fakeupstream.New(t, fakeupstream.Error(400, "invalid_request_error", "messages: bad"))
	const key, free = "sk-remaining-0123456789abcdef", "sk-remaining-free-0123456789abcdef"
	ask := oneConnection(t)
	startRelay(t, degradePricing+
		channelBlock("remaining-ch", up.URL, "models m-dg-big")+
		channelBlock("remaining-failing", failing.URL, "models m-dg-small")+
		"\t\tkey "+key+" remaining {\n\t\t\tname remaining\n\t\t\tbudget 5usd/day\n\t\t\tbudget 100usd/month\n\t\t}\n"+
		"\t\tkey "+free+" remaining {\n\t\t\tname remaining-free\n\t\t}\n"+
		"\t\tgroup remaining {\n\t\t\tchannels remaining-ch remaining-failing\n\t\t}\n")
	remaining := func(what string, r reply, status int, want string) {
		t.Helper()
		if r.status != status {
			t.Fatalf("%s: %d %s, want %d", what, r.status, r.body, status)
		}
		if got := r.header.Values("X-Relay-Budget-Remaining-Usd"); len(got) != 1 || got[0] != want {
			t.Errorf("%s: x-relay-budget-remaining-usd %q, want %q", what, got, want)
		}
	}
	// $5 less its own hold of $0.20; then $1 is spent
	remaining("a message", ask(t, http.MethodPost, "/v1/messages", key, degradeBody), 200, "4.8")
	// an upstream's 400, passed on, while it holds $0.02 of m-dg-small
	remaining("an upstream's error", ask(t, http.MethodPost, "/v1/messages", key, strings.Replace(degradeBody, "m-dg-big", "m-dg-small", 1)), 400, "3.98")
	// the relay's own 400, before anything is held
	r := ask(t, http.MethodPost, "/v1/messages", key, `{"model":`)
	wantRelayError(t, r, 400, "invalid_request_error", "")
	remaining("the relay's own error", r, 400, "4")
	remaining("the models list", ask(t, http.MethodGet, "/v1/models", key, ""), 200, "4")
	remaining("a stream", ask(t, http.MethodPost, "/v1/messages", key, strings.Replace(degradeBody, `"max_tokens":20`, `"max_tokens":20,"stream":true`, 1)), 200, "3.8")
	// $2 spent: a Chat Completion holds $0.20 as a message does
	remaining("a chat completion", ask(t, http.MethodPost, PathChatCompletions, key, `{"model":"m-dg-big","max_tokens":20,"messages":[{"role":"user","content":"go on"}]}`), 200, "2.8")

	if r := ask(t, http.MethodPost, "/v1/messages", free, degradeBody); r.status != 200 || r.header.Get("X-Relay-Budget-Remaining-Usd") != "" {
		t.Errorf("a key without a budget: %d, x-relay-budget-remaining-usd %q, want none", r.status, r.header.Get("X-Relay-Budget-Remaining-Usd"))
	}
}

// oneConnection is send over a single connection to the relay: the server
// reads a request only once the handler of the one before it returned,
// its account step (which settles its holds) included, so each request
// sees the spend of those before it.
func oneConnection(t *testing.T) func(t *testing.T, method, path, key, body string, header ...string) reply {
	tr := &http.Transport{MaxConnsPerHost: 1, MaxIdleConnsPerHost: 1}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	return func(t *testing.T, method, path, key, body string, header ...string) reply {
		t.Helper()
		req, err := http.NewRequest(method, relayURL+path, strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if key != "" {
			req.Header.Set("X-Api-Key", key)
		}
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("%s %s: reading the body: %v", method, path, err)
		}
		return reply{resp.StatusCode, resp.Header, b}
	}
}
