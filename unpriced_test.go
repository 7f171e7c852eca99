package relay

import (
	"database/sql"
	"encoding/json"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/ledger"
)

// unpricedRelay is a relay whose one channel lists no models (it serves
// any model a client names) and answers every request with 1,000 input
// and 1,000 output tokens; key "sk-<name>" has budgets, key
// "sk-<name>-free" none.
func unpricedRelay(t *testing.T, name string, budgets []string) (*Relay, *fakeupstream.Upstream, *observer.ObservedLogs) {
	t.Helper()
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		var body struct{ Model string }
		_ = json.NewDecoder(req.Body).Decode(&body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody(body.Model, "ok", fakeupstream.Usage{InputTokens: 1000, OutputTokens: 1000}))
	}))
	budgeted := Key{Secret: "sk-" + name, Group: name, KeyOptions: KeyOptions{Name: name, Budgets: budgets}}
	free := Key{Secret: "sk-" + name + "-free", Group: name, KeyOptions: KeyOptions{Name: name + "-free"}}
	ch := &Channel{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	r := &Relay{Keys: []*Key{&budgeted, &free}, Channels: []*Channel{ch}, Groups: []*Group{{Name: name, Channels: []string{ch.Name}}},
		Ledger: &ledger.Config{SQLite: &ledger.SQLite{Path: filepath.Join(t.TempDir(), "ledger.db")}}}
	logs := provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 12, 0, 0, 0, time.UTC)}
	r.now = clock.now
	return r, up, logs
}

// TestAnUnpricedModelIsNeverFree sends models the price table does not
// know (an old snapshot, an alias, a made-up id) through a channel that
// serves any model, as a key with a $1 daily budget: each is held and
// charged at the dearest row of its family, flagged in the log, in GET
// /relay/keys and in relay_unpriced_total; a request whose estimate could
// never fit is refused before the upstream sees it. An id in upper case
// takes its model's own row. A key without a budget still pays nothing
// for an unpriced model: nothing counts it.
func TestAnUnpricedModelIsNeverFree(t *testing.T) {
	r, up, logs := unpricedRelay(t, "unpriced", []string{"1usd/day"})
	send := func(model string, maxTokens int, key string) (int, string) {
		w, _ := serveHandler(t, r, newRequest(`{"model":"`+model+`","max_tokens":`+strconv.Itoa(maxTokens)+`,"messages":[{"role":"user","content":"hi"}]}`, key))
		return w.Code, w.Body.String()
	}
	spent := func() float64 {
		rows, _ := keyRows(t)
		return rows["unpriced"].SpendUSD["day"]
	}
	before := testutil.ToFloat64(metricUnpriced.WithLabelValues(labelOther))

	// opus: the dearest opus row is $15/$75 (claude-opus-4, -4-1):
	// 1,000 x $15/M + 1,000 x $75/M = $0.09
	for _, c := range []struct {
		model string
		want  float64
	}{
		{"claude-opus-4-0", 0.09},
		// sonnet: the dearest sonnet row is one with a long-prompt tier
		// ($3/$15 at this prompt's size): $0.018
		{"claude-3-5-sonnet-20241022", 0.018},
		{"claude-3-7-sonnet-latest", 0.018},
		// no family: the dearest row of all, the opus one
		{"my-own-model", 0.09},
	} {
		was := spent()
		if code, body := send(c.model, 8, "sk-unpriced"); code != 200 {
			t.Fatalf("%s: %d %s", c.model, code, body)
		}
		if got := spent() - was; got < c.want-1e-9 || got > c.want+1e-9 {
			t.Errorf("%s was charged $%.6f, want $%.6f", c.model, got, c.want)
		}
	}
	if n := logs.FilterField(zap.Bool("estimated_price", true)).Len(); n != 4 {
		t.Errorf("%d log lines say estimated_price, want 4", n)
	}
	rows, _ := keyRows(t)
	if got := rows["unpriced"].EstimatedPriceUSD["day"]; got < 0.216-1e-9 || got > 0.216+1e-9 {
		t.Errorf("GET /relay/keys estimated_price_usd.day = %v, want 0.216: %s", got, show(rows["unpriced"]))
	}
	if got := testutil.ToFloat64(metricUnpriced.WithLabelValues(labelOther)) - before; got != 4 {
		t.Errorf("relay_unpriced_total{model=other} rose by %v, want 4", got)
	}
	// the ledger's rows say so too
	db, err := sql.Open("sqlite3", "file:"+r.Ledger.SQLite.Path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var flagged int
	waitFor(t, "the ledger's rows of the unpriced requests", 10*time.Second, func() bool {
		return db.QueryRow(`SELECT COUNT(*) FROM relay_usage WHERE estimated_price`).Scan(&flagged) == nil && flagged == 4
	})

	// an id in upper case is its model: claude-haiku-4-5's $1/$5, exact
	was := spent()
	if code, body := send("CLAUDE-HAIKU-4-5", 8, "sk-unpriced"); code != 200 {
		t.Fatalf("upper case: %d %s", code, body)
	}
	if got := spent() - was; got < 0.006-1e-9 || got > 0.006+1e-9 {
		t.Errorf("CLAUDE-HAIKU-4-5 was charged $%.6f, want $0.006", got)
	}
	if n := logs.FilterField(zap.Bool("estimated_price", true)).Len(); n != 4 {
		t.Errorf("an upper-case id of a priced model was charged at an estimate (%d lines)", n)
	}

	// 64,000 output tokens of the dearest opus is $4.80: it never fits $1
	hits := up.Hits()
	code, body := send("claude-opus-4-0", 64000, "sk-unpriced")
	if code != 429 || !strings.Contains(body, "budget_exceeded") {
		t.Errorf("a worst case over the budget: %d %s, want 429 budget_exceeded", code, body)
	}
	if up.Hits() != hits {
		t.Error("the upstream was asked for a request its budget could never take")
	}

	// no budget and no cap: nothing counts it
	if code, body := send("claude-opus-4-0", 8, "sk-unpriced-free"); code != 200 {
		t.Fatalf("an unbudgeted key: %d %s", code, body)
	}
	if rows, _ := keyRows(t); rows["unpriced-free"].SpendUSD["day"] != 0 {
		t.Errorf("an unbudgeted key paid %v for an unpriced model", rows["unpriced-free"].SpendUSD["day"])
	}
}

// TestParallelUnpricedRequestsStayInTheirBudget sends 30 requests at once
// for an unpriced opus with a large max_tokens, on a $1 daily budget: the
// holds at the estimate let through only what the budget can take, and
// each one served is charged.
func TestParallelUnpricedRequestsStayInTheirBudget(t *testing.T) {
	r, _, _ := unpricedRelay(t, "unpriced-par", []string{"1usd/day"})
	var ok atomic.Int64
	done := make(chan struct{})
	for range 30 {
		go func() {
			defer func() { done <- struct{}{} }()
			// worst case: 8,000 x $75/M = $0.60 plus the prompt; costs $0.09
			w, _ := serveHandler(t, r, newRequest(`{"model":"claude-opus-4-0","max_tokens":8000,"messages":[{"role":"user","content":"hi"}]}`, "sk-unpriced-par"))
			if w.Code == 200 {
				ok.Add(1)
			}
		}()
	}
	for range 30 {
		<-done
	}
	rows, _ := keyRows(t)
	t.Logf("figure: 30 parallel unpriced requests on a $1 budget: %d served, $%.4f spent", ok.Load(), rows["unpriced-par"].SpendUSD["day"])
	// each holds over $0.60 and costs $0.09: they pass one or two at a
	// time, and every one served is charged (at no price, all 30 went
	// through for $0)
	spent := rows["unpriced-par"].SpendUSD["day"]
	if want := float64(ok.Load()) * 0.09; spent > 1 || ok.Load() == 0 || ok.Load() >= 30 || spent < want-1e-9 || spent > want+1e-9 {
		t.Errorf("%d served, $%.4f spent of a $1 budget, want fewer than 30 served at $0.09 each", ok.Load(), spent)
	}
}

// TestBudgetsThatMeetUnpricedModelsAreNamedAtLoad: a budget in a group
// whose channel serves any model, or lists one without a price, is named
// in a warning when the config loads; a group without budgets is not.
func TestBudgetsThatMeetUnpricedModelsAreNamedAtLoad(t *testing.T) {
	r, _, _ := unpricedRelay(t, "unpriced-warn", []string{"1usd/day"})
	core, logs := observer.New(zapcore.WarnLevel)
	r.logger = zap.New(core)
	r.warnUnpriced() // as Provision did, into a log the test reads
	lines := logs.FilterMessageSnippet("budgets meet models without a price").All()
	if len(lines) != 1 {
		t.Fatalf("%d warnings, want 1: %v", len(lines), logs.All())
	}
	f := lines[0].ContextMap()
	if f["group"] != "unpriced-warn" || !strings.Contains(show(f["budgets"]), `key \"unpriced-warn\"`) ||
		!strings.Contains(show(f["channels_serving_every_model"]), "unpriced-warn-ch") {
		t.Errorf("the warning says %v", f)
	}

	r2, _, _ := unpricedRelay(t, "unpriced-nobudget", nil)
	core, logs = observer.New(zapcore.WarnLevel)
	r2.logger = zap.New(core)
	r2.warnUnpriced()
	if n := logs.FilterMessageSnippet("without a price").Len(); n != 0 {
		t.Errorf("a group without budgets was warned of (%d)", n)
	}
}
