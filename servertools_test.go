package relay

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/pgtest"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// searchUsage is what the upstreams of these tests report: 1,000 input
// and 1,000 output tokens, and 50 web searches.
var searchUsage = fakeupstream.Usage{InputTokens: 1000, OutputTokens: 1000,
	ServerToolUse: &fakeupstream.ServerToolUse{WebSearchRequests: 50, WebFetchRequests: 3}}

// searchUpstream answers a message as the request asks, streamed or not,
// with usage u; it counts the requests it answers in hits (when not nil).
func searchUpstream(t *testing.T, u fakeupstream.Usage, hits *atomic.Int64) *fakeupstream.Upstream {
	return fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits != nil {
			hits.Add(1)
		}
		var req struct {
			Model  string `json:"model"`
			Stream bool   `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		if req.Stream {
			fakeupstream.Stream(fakeupstream.StreamEvents(req.Model, u, "Searched", " and", " found")...)(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody(req.Model, "Searched and found", u))
	}))
}

// searchRelay is a relay whose key name has budget over 100usd/day, in
// group name, on one channel to up that lists model, with the given
// pricing (nil: the built-in list only).
func searchRelay(t *testing.T, name, model string, up *fakeupstream.Upstream, pricing map[string]Price) *Relay {
	t.Helper()
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-" + name + "-0123456789", Group: name, KeyOptions: KeyOptions{Name: name, Budgets: []string{"100usd/day"}}}},
		Channels: []*Channel{{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey), Models: []string{model}}},
		Groups:   []*Group{{Name: name, Channels: []string{name + "-ch"}}},
		Pricing:  pricing,
	}
	return r
}

// spentToday is what GET /relay/keys says key spent today: its nano-USD
// count, in USD.
func spentToday(t *testing.T, key string) float64 {
	t.Helper()
	rows, body := keyRows(t)
	row, ok := rows[key]
	if !ok {
		t.Fatalf("GET /relay/keys has no %s: %s", key, body)
	}
	return row.SpendUSD["day"]
}

// A message whose answer reports 50 web searches costs its tokens and
// $10 per 1,000 searches ($0.50), read from a non-streaming body and from
// a stream's message_delta (its message_start counts none yet), for a
// model of the built-in list and one configured: in the key's spend (to
// the nano-USD), in relay_cost_usd_total and in the log line's cost_usd.
// The 3 web fetches cost nothing beyond their tokens.
func TestWebSearchesAreChargedBesideTheTokens(t *testing.T) {
	for _, tc := range []struct {
		name, model string
		pricing     map[string]Price
		want        float64 // USD: the tokens' list price and $0.50
	}{
		{"listed", "claude-sonnet-4-5", nil, 0.518},                                            // $3 and $15 per million tokens
		{"configured", "m-search", map[string]Price{"m-search": {Input: 1, Output: 1}}, 0.502}, // $1 and $1
	} {
		for _, stream := range []bool{false, true} {
			name := fmt.Sprintf("search-%s-%v", tc.name, stream)
			t.Run(name, func(t *testing.T) {
				r := searchRelay(t, name, tc.model, searchUpstream(t, searchUsage, nil), tc.pricing)
				logs := provisionHandler(t, r)
				cost := metricCost.WithLabelValues(name, name+"-ch", tc.model)
				costBefore := testutil.ToFloat64(cost)
				body := fmt.Sprintf(`{"model":%q,"max_tokens":64,"stream":%v,"tools":[{"type":"web_search_20250305","name":"web_search"}],"messages":[{"role":"user","content":"What is new?"}]}`, tc.model, stream)
				w, _ := serveHandler(t, r, newRequest(body, "sk-"+name+"-0123456789"))
				if w.Code != 200 {
					t.Fatalf("%d %s", w.Code, w.Body)
				}
				if got := spentToday(t, name); got != tc.want {
					t.Errorf("the key spent $%v, want $%v: the tokens and 50 searches at $10 per 1,000", got, tc.want)
				}
				if got := testutil.ToFloat64(cost) - costBefore; math.Abs(got-tc.want) > 1e-12 {
					t.Errorf("relay_cost_usd_total grew by %v, want %v", got, tc.want)
				}
				lines := logs.FilterMessage("relayed request").All()
				if len(lines) != 1 {
					t.Fatalf("%d log lines", len(lines))
				}
				if got, _ := lines[0].ContextMap()["cost_usd"].(float64); math.Abs(got-tc.want) > 1e-12 {
					t.Errorf("the log line's cost_usd = %v, want %v", got, tc.want)
				}
			})
		}
	}
}

// A pricing line's web_search is its model's price per 1,000 searches, in
// the Caddyfile and in JSON; a model without one keeps $10.
func TestAPricingLineSetsItsModelsWebSearchPrice(t *testing.T) {
	up := searchUpstream(t, searchUsage, nil)
	parsed, err := parseRelay(t, fmt.Sprintf(`relay {
	key sk-search-price-caddyfile-0123456789 search-price-caddyfile {
		name search-price-caddyfile
		budget 100usd/day
	}
	channel search-price-caddyfile-ch {
		url %s
		api_key %s
		models m-search-cheap m-search-plain
	}
	group search-price-caddyfile {
		channels search-price-caddyfile-ch
	}
	pricing {
		m-search-cheap input 1 output 1 web_search 5
		m-search-plain input 1 output 1
	}
}`, up.URL, channelKey))
	if err != nil {
		t.Fatal(err)
	}
	var fromJSON Relay
	if err := json.Unmarshal([]byte(`{"pricing":{"m-search-cheap":{"input":1,"output":1,"web_search":5},"m-search-plain":{"input":1,"output":1}}}`), &fromJSON); err != nil {
		t.Fatal(err)
	}
	jsonRelay := searchRelay(t, "search-price-json", "m-search-cheap", up, fromJSON.Pricing)
	jsonRelay.Channels[0].Models = []string{"m-search-cheap", "m-search-plain"}
	for _, tc := range []struct {
		r    *Relay
		name string
	}{{parsed, "search-price-caddyfile"}, {jsonRelay, "search-price-json"}} {
		provisionHandler(t, tc.r)
		spent := 0.0
		for _, m := range []struct {
			model string
			usd   float64
		}{{"m-search-cheap", 0.002 + 0.25}, {"m-search-plain", 0.002 + 0.5}} {
			body := `{"model":"` + m.model + `","max_tokens":64,"messages":[{"role":"user","content":"What is new?"}]}`
			w, _ := serveHandler(t, tc.r, newRequest(body, "sk-"+tc.name+"-0123456789"))
			if w.Code != 200 {
				t.Fatalf("%s: %d %s", tc.name, w.Code, w.Body)
			}
			spent += m.usd
			if got := spentToday(t, tc.name); math.Abs(got-spent) > 1e-12 {
				t.Errorf("%s: after %s the key spent $%v, want $%v", tc.name, m.model, got, spent)
			}
		}
	}
}

// A request that declares a web search tool holds its searches against
// its budget: max_uses of them, or 10 when it sets none, at the model's
// web_search price. On a budget of $0.15 (tokens cost a few millionths),
// 20 searches ($0.20) are refused before the upstream is asked; 10 (the
// default), 5, and a request without the tool are served.
func TestAWebSearchToolHoldsItsSearches(t *testing.T) {
	var hits atomic.Int64
	up := searchUpstream(t, fakeupstream.Usage{InputTokens: 10, OutputTokens: 5}, &hits)
	r := searchRelay(t, "search-hold", "m-search-hold", up, map[string]Price{"m-search-hold": {Input: 1, Output: 1}})
	r.Keys[0].Budgets = []string{"0.15usd/day"}
	provisionHandler(t, r)
	ask := func(tools string) *httptest.ResponseRecorder {
		body := `{"model":"m-search-hold","max_tokens":16,` + tools + `"messages":[{"role":"user","content":"What is new?"}]}`
		w, _ := serveHandler(t, r, newRequest(body, "sk-search-hold-0123456789"))
		return w
	}
	w := ask(`"tools":[{"type":"web_search_20250305","name":"web_search","max_uses":20}],`)
	var refusal struct{ Error struct{ Type, Code string } }
	_ = json.Unmarshal(w.Body.Bytes(), &refusal)
	if w.Code != 429 || refusal.Error.Code != "budget_exceeded" || hits.Load() != 0 {
		t.Errorf("20 searches at $0.01 on a $0.15 budget: %d %s, the upstream asked %d times; want 429 budget_exceeded, not asked", w.Code, w.Body, hits.Load())
	}
	for _, tools := range []string{
		`"tools":[{"type":"web_search_20250305","name":"web_search"}],`,
		`"tools":[{"name":"lookup","input_schema":{"type":"object"}},{"type":"web_search_20260209","name":"web_search","max_uses":5}],`,
		``,
	} {
		if w := ask(tools); w.Code != 200 {
			t.Errorf("%s: %d %s, want it served", tools, w.Code, w.Body)
		}
	}
}

// A batch holds its requests' web searches at their full price when it is
// made: on a budget of $0.30, a batch whose request may search 40 times
// ($0.40) is refused before the upstream makes it; one whose requests
// may search 10 times each (the default, and max_uses 10), $0.20, is made.
func TestABatchHoldsItsRequestsSearches(t *testing.T) {
	store := fakeupstream.NewStore("search-batch-hold")
	r := searchRelay(t, "search-batch-hold", "claude-sonnet-4-5", fakeupstream.New(t, store), nil)
	r.Keys[0].Budgets = []string{"0.30usd/day"}
	noFloor := 0.0 // the searches alone: what they bring in is held at hold_floor, here nothing
	r.HoldFloor = &noFloor
	provisionHandler(t, r)
	create := func(tools ...string) *httptest.ResponseRecorder {
		reqs := make([]string, len(tools))
		for i, tool := range tools {
			reqs[i] = fmt.Sprintf(`{"custom_id":"r%d","params":{"model":"claude-sonnet-4-5","max_tokens":16,"tools":[%s],"messages":[{"role":"user","content":"Hi"}]}}`, i, tool)
		}
		post := httptest.NewRequest(http.MethodPost, "/v1/messages/batches", strings.NewReader(`{"requests":[`+strings.Join(reqs, ",")+`]}`))
		post.Header.Set("X-Api-Key", "sk-search-batch-hold-0123456789")
		post.Header.Set("Content-Type", "application/json")
		w, _ := serveHandler(t, r, post)
		return w
	}
	if w := create(`{"type":"web_search_20250305","name":"web_search","max_uses":40}`); w.Code != 429 || store.Batches() != 0 {
		t.Errorf("a batch that may search 40 times on a $0.30 budget: %d %s, %d batches made; want 429, none", w.Code, w.Body, store.Batches())
	}
	if w := create(`{"type":"web_search_20250305","name":"web_search"}`, `{"type":"web_search_20250305","name":"web_search","max_uses":10}`); w.Code != 200 || store.Batches() != 1 {
		t.Errorf("a batch that may search 20 times on a $0.30 budget: %d %s, %d batches made; want it made", w.Code, w.Body, store.Batches())
	}
}

// A batch's results are charged $10 per 1,000 web searches at the full
// price (the batch price halves their tokens only), in the spend of the
// key that made it and in the ledger's server_tool_usd of its rows.
func TestBatchResultsPayWebSearchesInFull(t *testing.T) {
	store := fakeupstream.NewStore("search-batch")
	store.Searches = 50
	up := fakeupstream.New(t, store)
	path := filepath.Join(t.TempDir(), "ledger.db")
	r := searchRelay(t, "search-batch", "claude-sonnet-4-5", up, nil)
	r.Ledger = &ledger.Config{SQLite: &ledger.SQLite{Path: path}}
	provisionHandler(t, r)
	key := "sk-search-batch-0123456789"
	post := httptest.NewRequest(http.MethodPost, "/v1/messages/batches", strings.NewReader(`{"requests":[`+
		`{"custom_id":"r0","params":{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}},`+
		`{"custom_id":"r1","params":{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}}]}`))
	post.Header.Set("X-Api-Key", key)
	post.Header.Set("Content-Type", "application/json")
	w, _ := serveHandler(t, r, post)
	var made struct{ ID string }
	if err := json.Unmarshal(w.Body.Bytes(), &made); w.Code != 200 || err != nil || made.ID == "" {
		t.Fatalf("create: %d %s", w.Code, w.Body)
	}
	get := httptest.NewRequest(http.MethodGet, "/v1/messages/batches/"+made.ID+"/results", nil)
	get.Header.Set("X-Api-Key", key)
	if w, _ := serveHandler(t, r, get); w.Code != 200 || !strings.Contains(w.Body.String(), `"custom_id":"r1"`) {
		t.Fatalf("results: %d %s", w.Code, w.Body)
	}
	want := batchUSD(2, 3, 15) + 2*50*0.01
	if got := spentToday(t, "search-batch"); math.Abs(got-want) > 1e-12 {
		t.Errorf("the batch's maker spent $%v, want $%v: the tokens at half price, 100 searches at $10 per 1,000", got, want)
	}
	db := openLedgerDB(t, "sqlite3", "file:"+path+"?mode=ro")
	var tool float64
	waitFor(t, "the batch's rows in the ledger", 10*time.Second, func() bool {
		return db.QueryRow(`SELECT SUM(server_tool_usd) FROM relay_usage WHERE cause = 'batch'`).Scan(&tool) == nil && tool > 0
	})
	if math.Abs(tool-1) > 1e-9 {
		t.Errorf("the ledger's rows of the batch hold server_tool_usd %v, want 1", tool)
	}
}

// openLedgerDB opens a ledger's database beside its writer, closed when
// the test ends.
func openLedgerDB(t *testing.T, driver, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open(driver, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// The ledger's row of a request with 50 web searches holds its whole cost
// in cost_nano_usd, as the budgets charged it, and the searches' part of
// it in server_tool_usd: in SQLite and in Postgres.
func TestTheLedgerRowHoldsTheServerToolCost(t *testing.T) {
	for _, backend := range []string{"sqlite", "postgres"} {
		t.Run(backend, func(t *testing.T) {
			name := "search-ledger-" + backend
			r := searchRelay(t, name, "m-search", searchUpstream(t, searchUsage, nil), map[string]Price{"m-search": {Input: 1, Output: 1}})
			var db *sql.DB
			if backend == "sqlite" {
				path := filepath.Join(t.TempDir(), "ledger.db")
				r.Ledger = &ledger.Config{SQLite: &ledger.SQLite{Path: path}}
				db = openLedgerDB(t, "sqlite3", "file:"+path+"?mode=ro")
			} else {
				pg := pgtest.Start(t)
				r.Ledger = &ledger.Config{Postgres: &ledger.Postgres{DSN: pg.DSN()}}
				db = openLedgerDB(t, "pgx", pg.DSN())
			}
			provisionHandler(t, r)
			for _, stream := range []bool{false, true} {
				body := fmt.Sprintf(`{"model":"m-search","max_tokens":64,"stream":%v,"messages":[{"role":"user","content":"What is new?"}]}`, stream)
				if w, _ := serveHandler(t, r, newRequest(body, "sk-"+name+"-0123456789")); w.Code != 200 {
					t.Fatalf("%d %s", w.Code, w.Body)
				}
			}
			var rows int
			waitFor(t, "both rows in the ledger", 10*time.Second, func() bool {
				return db.QueryRow(`SELECT COUNT(*) FROM relay_usage WHERE key_name = '`+name+`'`).Scan(&rows) == nil && rows == 2
			})
			res, err := db.Query(`SELECT cost_nano_usd, server_tool_usd FROM relay_usage WHERE key_name = '` + name + `'`)
			if err != nil {
				t.Fatal(err)
			}
			defer res.Close()
			for res.Next() {
				var nano int64
				var tool float64
				if err := res.Scan(&nano, &tool); err != nil {
					t.Fatal(err)
				}
				if nano != 502_000_000 || tool != 0.5 {
					t.Errorf("a row holds cost_nano_usd %d and server_tool_usd %v, want 502000000 and 0.5", nano, tool)
				}
			}
			if err := res.Err(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// Bedrock's answers are Anthropic's, its streams Anthropic's events in
// frames of its own, and Vertex's both Anthropic's: the searches they
// report are charged as Anthropic's are, streamed or not.
func TestCloudChannelsChargeTheirWebSearches(t *testing.T) {
	const model = "claude-sonnet-4-5-20250929"
	t.Run("bedrock", func(t *testing.T) {
		fb := providertest.NewFakeBedrock(t, func(w http.ResponseWriter, r *http.Request) {
			if strings.HasSuffix(r.URL.Path, "/invoke-with-response-stream") {
				providertest.EventStream(fakeupstream.StreamEvents(model, searchUsage, "Searched"))(w, r)
				return
			}
			fakeupstream.Raw(200, fakeupstream.MessageBody(model, "Searched", searchUsage))(w, r)
		})
		startRelay(t, bedrockChannel(t, "br-search", fb.URL)+keyAndGroup("br-search", "br-search"))
		checkCloudSearchCost(t, "br-search")
	})
	t.Run("vertex", func(t *testing.T) {
		g := providertest.NewFakeGoogle(t, 3600)
		vertex := providertest.NewFakeVertex(t, g, func(w http.ResponseWriter, r *http.Request) {
			if strings.HasSuffix(r.URL.Path, ":streamRawPredict") {
				fakeupstream.Stream(fakeupstream.StreamEvents(model, searchUsage, "Searched")...)(w, r)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(fakeupstream.MessageBody(model, "Searched", searchUsage))
		})
		startRelay(t, vertexBlock("vx-search", vertex.URL, g.ServiceAccountFile(t), "models claude-sonnet-4-5=claude-sonnet-4-5@20250929")+
			keyAndGroup("vx-search", "vx-search"))
		checkCloudSearchCost(t, "vx-search")
	})
}

// checkCloudSearchCost sends a message and a stream through channel (the
// only one of its group, of the same name) and checks that each cost its
// tokens and 50 searches in relay_cost_usd_total.
func checkCloudSearchCost(t *testing.T, channel string) {
	t.Helper()
	for i, body := range []string{
		`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`,
		streamBody,
	} {
		if r := message(t, body); r.status != 200 {
			t.Fatalf("%d %s", r.status, r.body)
		}
		mf, _ := scrape(t)
		want := float64(i+1) * 0.518 // $3 and $15 per million tokens, $10 per 1,000 searches
		if got := value(mf, "relay_cost_usd_total", "group="+channel, "channel="+channel); math.Abs(got-want) > 1e-9 {
			t.Errorf("after %d answers relay_cost_usd_total is %v, want %v", i+1, got, want)
		}
	}
}

// The web searches of an answer are usage.server_tool_use's
// web_search_requests: of a whole message, and of a stream the last count
// said (message_delta's are cumulative), never a sum; an event without
// them (or with null) leaves the count as it was.
func TestUsageReadsTheWebSearches(t *testing.T) {
	var u usage
	u.fromMessage([]byte(`{"usage":{"input_tokens":5,"output_tokens":3,"server_tool_use":{"web_search_requests":7,"web_fetch_requests":2}}}`))
	if u.webSearches != 7 || u.input != 5 {
		t.Errorf("a message: %+v, want 7 searches", u)
	}
	for _, tc := range []struct {
		name   string
		events [][2]string
		want   int32
	}{
		{"counted in message_delta", [][2]string{
			{"message_start", `{"type":"message_start","message":{"usage":{"input_tokens":9,"output_tokens":1,"server_tool_use":{"web_search_requests":0}}}}`},
			{"message_delta", `{"type":"message_delta","delta":{"stop_reason":null},"usage":{"output_tokens":20,"server_tool_use":{"web_search_requests":2,"web_fetch_requests":1}}}`},
			{"message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":40,"server_tool_use":{"web_search_requests":5,"web_fetch_requests":1}}}`},
		}, 5},
		{"said once, in message_start", [][2]string{
			{"message_start", `{"type":"message_start","message":{"usage":{"input_tokens":9,"output_tokens":1,"server_tool_use":{"web_search_requests":4}}}}`},
			{"message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":40,"server_tool_use":null}}`},
		}, 4},
		{"none", [][2]string{
			{"message_start", `{"type":"message_start","message":{"usage":{"input_tokens":9,"output_tokens":1}}}`},
			{"message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":40}}`},
		}, 0},
	} {
		var u usage
		for _, ev := range tc.events {
			u.fromEvent([]byte(ev[0]), []byte(ev[1]))
		}
		if u.webSearches != tc.want || u.output != 40 {
			t.Errorf("%s: %+v, want %d searches", tc.name, u, tc.want)
		}
	}
}

// A channel's price_factor applies to the web searches as to the tokens.
func TestAPriceFactorAppliesToWebSearches(t *testing.T) {
	batch := 0.25
	pb := newPricebook(map[string]Price{"m-plain": {Input: 1, Output: 1, Batch: &batch}})
	u := usage{input: 1000, output: 1000, webSearches: 50}
	// a channel's price_factor applies to the searches as to the tokens
	relay := &Relay{prices: pb}
	in := &inbound{grant: granted{target: "m-plain"}, end: ending{answered: &channel{priceFactor: 0.8}, usage: u}}
	if priced, tools := relay.price(in); !priced || math.Abs(in.end.cost-0.8*0.502) > 1e-12 || math.Abs(tools-0.4) > 1e-12 {
		t.Errorf("at price_factor 0.8: cost %v, of which server tools %v; want %v and 0.4", in.end.cost, tools, 0.8*0.502)
	}
}

// web_search is a pricing line's price per 1,000 searches, for the whole
// model: not negative, and not a long prompt's.
func TestCaddyfileWebSearchPrice(t *testing.T) {
	at := func(line string) string {
		return "relay {\n\tkey k g\n\tchannel a {\n\t\tprovider mock\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n\tpricing {\n\t\t" + line + "\n\t}\n}"
	}
	r, err := parseRelay(t, at("m input 1 output 2 web_search 12.5 above 1000 input 2 output 4"))
	if err != nil {
		t.Fatal(err)
	}
	if p := r.Pricing["m"]; p.WebSearch == nil || *p.WebSearch != 12.5 || p.LongPrompt.WebSearch != nil {
		t.Errorf("pricing = %+v", p)
	}
	for _, bad := range []string{"m input 1 output 1 web_search -1", "m input 1 output 1 web_search x", "m input 1 output 1 above 10 input 2 web_search 3"} {
		if _, err := parseRelay(t, at(bad)); err == nil || !strings.Contains(err.Error(), "web_search") {
			t.Errorf("%q: want an error about web_search, got %v", bad, err)
		}
	}
	for raw, want := range map[string]string{
		`{"input":1,"output":1,"web_search":-1}`:                                                "negative",
		`{"input":1,"output":1,"long_prompt":{"above":10,"input":2,"output":2,"web_search":3}}`: "web_search",
	} {
		var p Price
		if err := json.Unmarshal([]byte(raw), &p); err != nil {
			t.Fatal(err)
		}
		if err := p.Validate(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %s", raw, err, want)
		}
	}
}
