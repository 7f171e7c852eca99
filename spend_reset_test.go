package relay

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
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

// resetBody is a message of model m-reset: 5 output tokens at $0.04 each
// ($40,000 per million) and no price for input, so it holds $0.20 while it
// runs and fakeupstream.Message's answer costs $0.20.
const resetBody = `{"model":"m-reset","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`

// resetRow decodes a row of GET /relay/keys, as the reset answers it.
func resetRow(t *testing.T, body string) keyStatus {
	t.Helper()
	var row keyStatus
	if err := json.Unmarshal([]byte(body), &row); err != nil {
		t.Fatalf("the reset's answer is not a key's row: %v: %s", err, body)
	}
	return row
}

// TestResettingSpendServesTheKeyAgain spends a key's daily budget on a
// running Caddy, then resets its spend through the admin API: a reset of
// the total alone leaves the day spent and the key refused, a reset of the
// day serves it again, and a reset of every period clears them all. Each
// answer is the key's row of GET /relay/keys.
func TestResettingSpendServesTheKeyAgain(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	const key = "sk-reset-serve-0123456789abcdef"
	startRelay(t, "\t\tpricing {\n\t\t\tm-reset input 0 output 40000\n\t\t}\n"+
		channelBlock("reset-serve-ch", up.URL)+
		"\t\tkey "+key+" reset-serve {\n\t\t\tname reset-serve\n\t\t\tbudget 0.4usd/day\n\t\t\tbudget 1usd/total\n\t\t}\n"+
		"\t\tgroup reset-serve {\n\t\t\tchannels reset-serve-ch\n\t\t}\n")
	ask := func() int { return send(t, http.MethodPost, "/v1/messages", key, resetBody).status }
	reset := func(query string) keyStatus {
		t.Helper()
		status, body := adminDo(t, http.MethodPost, "/relay/keys/reset-serve/spend/reset"+query, "")
		if status != 200 {
			t.Fatalf("POST .../spend/reset%s: %d %s", query, status, body)
		}
		return resetRow(t, body)
	}
	for i := range 2 {
		if s := ask(); s != 200 {
			t.Fatalf("request %d: %d", i+1, s)
		}
	}
	if s := ask(); s != 429 {
		t.Fatalf("past the $0.40 of the day: %d, want 429", s)
	}

	row := reset("?period=total")
	if row.Name != "reset-serve" || row.SpendUSD["total"] != 0 || row.SpendUSD["day"] != 0.4 || row.SpendUSD["week"] != 0.4 || row.RemainingUSD["total"] != 1 {
		t.Errorf("after a reset of the total: %s", show(row))
	}
	if s := ask(); s != 429 {
		t.Fatalf("after a reset of the total alone, the day is still spent: %d, want 429", s)
	}

	row = reset("?period=day")
	if row.SpendUSD["day"] != 0 || row.SpendUSD["total"] != 0 || row.SpendUSD["week"] != 0.4 || row.SpendUSD["month"] != 0.4 || row.RemainingUSD["day"] != 0.4 {
		t.Errorf("after a reset of the day: %s", show(row))
	}
	if s := ask(); s != 200 {
		t.Fatalf("after a reset of the day: %d, want 200", s)
	}

	row = reset("")
	for p, v := range row.SpendUSD {
		if v != 0 {
			t.Errorf("after a reset of every period, %s is %v: %s", p, v, show(row))
		}
	}
	rows, _ := keyRows(t)
	if got := rows["reset-serve"]; show(got.SpendUSD) != show(row.SpendUSD) {
		t.Errorf("GET /relay/keys after the reset: %s, want %s", show(got.SpendUSD), show(row.SpendUSD))
	}
	if up.Hits() != 3 {
		t.Errorf("the upstream answered %d times, want 3", up.Hits())
	}
}

// TestResetAnswersItsErrorsAsJSON asks the reset route of a running Caddy
// what it cannot do: a wrong method, an unknown key, a bad period, user *.
func TestResetAnswersItsErrorsAsJSON(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, "\t\tidentity {http.auth.user.id}\n\t\tuser * reset-errors\n"+
		channelBlock("reset-errors-ch", up.URL)+
		"\t\tkey sk-reset-errors-0123456789abcdef reset-errors {\n\t\t\tname reset-errors\n\t\t}\n"+
		"\t\tgroup reset-errors {\n\t\t\tchannels reset-errors-ch\n\t\t}\n")
	for _, c := range []struct {
		method, path string
		status       int
		allow, says  string
	}{
		{http.MethodGet, "/relay/keys/reset-errors/spend/reset", 405, "POST", "use POST"},
		{http.MethodDelete, "/relay/keys/reset-errors/spend/reset", 405, "POST", "use POST"},
		{http.MethodPost, "/relay/keys/no-such-key/spend/reset", 404, "", `unknown key "no-such-key"`},
		{http.MethodPost, "/relay/keys/reset-errors/spend/reset?period=year", 400, "", `period "year"`},
		{http.MethodPost, "/relay/keys/reset-errors/spend/reset?period=day&period=week", 400, "", "give one of day, week, month or total"},
		{http.MethodPost, "/relay/keys/user:*/spend/reset", 400, "", "each identity it serves has a spend of its own"},
		{http.MethodPost, "/relay/keys/reset-errors/spend", 404, "", "POST /relay/keys/<name>/spend/reset"},
	} {
		req, _ := http.NewRequest(c.method, adminURL+c.path, nil)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body struct {
			Error string `json:"error"`
		}
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if resp.StatusCode != c.status || err != nil || !strings.Contains(body.Error, c.says) ||
			resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("Allow") != c.allow {
			t.Errorf("%s %s: %d %q (%v), Allow %q; want %d JSON saying %q, Allow %q",
				c.method, c.path, resp.StatusCode, body.Error, err, resp.Header.Get("Allow"), c.status, c.says, c.allow)
		}
	}
	// a key that never served a request has no spend account: it resets
	// to nothing and answers its row
	if status, body := adminDo(t, http.MethodPost, "/relay/keys/reset-errors/spend/reset", ""); status != 200 || resetRow(t, body).Name != "reset-errors" {
		t.Errorf("a reset of a key without state: %d %s", status, body)
	}
}

// adminReset calls the reset route without a server, as keyRows does.
func adminReset(t *testing.T, name, query string) (int, string) {
	t.Helper()
	w := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/relay/keys/"+name+"/spend/reset"+query, nil)
	req.SetPathValue("name", name)
	if err := (adminAPI{}).resetSpend(w, req); err != nil {
		t.Fatalf("reset %s%s: %v", name, query, err)
	}
	return w.Code, w.Body.String()
}

// TestAResetForgivesTheEstimatesAndIsLogged resets a key's total, after a
// midnight of its relay's clock: the total, and the part of it estimated
// outputs cost, go to zero; one line says whose and which period; the
// refused key is served again.
func TestAResetForgivesTheEstimatesAndIsLogged(t *testing.T) {
	var hits atomic.Int64
	r, clock := budgetRelay(t, "reset-total", []string{"0.4usd/total"}, &hits)
	core, logs := observer.New(zapcore.InfoLevel)
	r.logger = zap.New(core)
	send := func() int {
		w, _ := serveHandler(t, r, newRequest(`{"model":"m-budget","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, "sk-reset-total"))
		return w.Code
	}
	for i, want := range []int{200, 200, 429} { // $0.20 each
		if s := send(); s != want {
			t.Fatalf("request %d: %d, want %d", i+1, s, want)
		}
	}
	r.keyByName(t, "reset-total").state.spend.ChargedEstimate(clock.now(), 0.05, money.EstimateOutput)
	clock.advance(2 * time.Hour) // a new day: the total goes on
	if rows, _ := keyRows(t); rows["reset-total"].EstimatedUSD["total"] != 0.05 || rows["reset-total"].SpendUSD["total"] != 0.4 {
		t.Fatalf("before the reset: %s", show(rows["reset-total"]))
	}

	status, body := adminReset(t, "reset-total", "?period=total")
	row := resetRow(t, body)
	if status != 200 || row.SpendUSD["total"] != 0 || row.EstimatedUSD["total"] != 0 || row.RemainingUSD["total"] != 0.4 {
		t.Errorf("the reset's answer: %d %s", status, body)
	}
	lines := logs.FilterMessage("key spend reset").All()
	if len(lines) != 1 {
		t.Fatalf("%d lines saying the spend was reset, want 1", len(lines))
	}
	fields := lines[0].ContextMap()
	if fields["key"] != "reset-total" || show(fields["periods"]) != `["total"]` || strings.Contains(show(fields), "sk-reset-total") {
		t.Errorf("the reset's line: %v", fields)
	}
	if s := send(); s != 200 {
		t.Errorf("after the reset: %d, want 200", s)
	}
	if hits.Load() != 3 {
		t.Errorf("the upstream answered %d times, want 3", hits.Load())
	}
}

// TestAResetReachesAKeyThatHasNoStateYet resets a key that has not served
// a request since the relay started, but spent before: what is stored of
// it goes, so its row says zero, and so does the account it takes at its
// first request.
func TestAResetReachesAKeyThatHasNoStateYet(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	key := Key{Secret: "sk-reset-dormant-0123456789abcdef", Group: "reset-dormant", KeyOptions: KeyOptions{Name: "reset-dormant"}}
	ch := &Channel{Name: "reset-dormant-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	r := &Relay{Keys: []*Key{&key}, Channels: []*Channel{ch}, Groups: []*Group{{Name: "reset-dormant", Channels: []string{ch.Name}}}}
	provisionHandler(t, r)
	now := time.Now()
	stored := money.NewAccount("reset-dormant") // what it spent before, let go: the store keeps it
	stored.Charge(now, 3, nil)
	_ = stored.Destruct()
	if k := r.keyByName(t, "reset-dormant"); k.active.Load() {
		t.Fatal("the key took its state before its first request")
	}
	if rows, _ := keyRows(t); rows["reset-dormant"].SpendUSD["month"] != 3 {
		t.Fatalf("before the reset, the stored spend: %s", show(rows["reset-dormant"]))
	}
	_, body := adminReset(t, "reset-dormant", "?period=day")
	if row := resetRow(t, body); row.SpendUSD["day"] != 0 || row.SpendUSD["month"] != 3 {
		t.Errorf("after a reset of the day: %s", body)
	}
	_, body = adminReset(t, "reset-dormant", "")
	if row := resetRow(t, body); row.SpendUSD["month"] != 0 {
		t.Errorf("after a reset of every period: %s", body)
	}
	if w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-reset-dormant-0123456789abcdef")); w.Code != 200 {
		t.Fatalf("the key's first request: %d %s", w.Code, w.Body)
	}
	if usd, _ := r.keyByName(t, "reset-dormant").state.spend.Spent(now); usd[money.PeriodTotal] > 0.01 || usd[money.PeriodMonth] > 0.01 {
		t.Errorf("the account the key took: %v, want only what its first request cost", usd)
	}
}

// keyByName is r's key named name.
func (r *Relay) keyByName(t *testing.T, name string) *key {
	t.Helper()
	for _, k := range r.keys {
		if k.name == name {
			return k
		}
	}
	t.Fatalf("no key %q", name)
	return nil
}
