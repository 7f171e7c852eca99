package relay

import (
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/money"
)

// floorRelay is a relay of key sk-<name> with a $1 daily budget, whose
// upstream reports 190,000 input tokens and 16 output tokens for every
// answer, as for a prompt held in a file: $0.5702 at m-floor's $3/$15.
func floorRelay(t *testing.T, name string, floor *float64) (*Relay, *atomic.Int64) {
	t.Helper()
	var hits atomic.Int64
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m-floor", "ok", fakeupstream.Usage{InputTokens: 190_000, OutputTokens: 16}))
	}))
	key := Key{Secret: "sk-" + name, Group: name, KeyOptions: KeyOptions{Name: name, Budgets: []string{"1usd/day"}}}
	ch := &Channel{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	r := &Relay{Keys: []*Key{&key}, Channels: []*Channel{ch}, Groups: []*Group{{Name: name, Channels: []string{ch.Name}}},
		Pricing: map[string]Price{"m-floor": {Input: 3, Output: 15}}, HoldFloor: floor}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 12, 0, 0, 0, time.UTC)}
	r.now = clock.now
	return r, &hits
}

// TestPromptsOutsideTheBodyHoldAFloor sends 30 requests at once whose
// prompt is a document the upstream fetches (by URL, by an escaped URL
// key, by a web_fetch tool), each of 16 output tokens, on a $1 budget: the
// input of each is held at the model's context window, within what the
// budget has left, so they pass one at a time and the budget is exceeded
// by one request's error at most, where all 30 went through and spent $17.
func TestPromptsOutsideTheBodyHoldAFloor(t *testing.T) {
	bodies := map[string]string{
		"url source":  `{"model":"m-floor","max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"url","url":"https://example.com/a.pdf"}},{"type":"text","text":"summarise"}]}]}`,
		"escaped key": `{"model":"m-floor","max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"\u0075rl","\u0075rl":"https://example.com/a.pdf"}}]}]}`,
		"web fetch":   `{"model":"m-floor","max_tokens":16,"tools":[{"type":"web_fetch_20250910","name":"web_fetch"}],"messages":[{"role":"user","content":"read https://example.com"}]}`,
	}
	for name, body := range bodies {
		t.Run(strings.ReplaceAll(name, " ", "-"), func(t *testing.T) {
			kname := "floor-" + strings.ReplaceAll(name, " ", "-")
			r, hits := floorRelay(t, kname, nil)
			var wg sync.WaitGroup
			var served atomic.Int64
			for range 30 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					w, _ := serveHandler(t, r, newRequest(body, "sk-"+kname))
					switch {
					case w.Code == 200:
						served.Add(1)
					case w.Code != 429 || !strings.Contains(w.Body.String(), "budget_exceeded"):
						t.Errorf("%d %s", w.Code, w.Body)
					}
				}()
			}
			wg.Wait()
			rows, _ := keyRows(t)
			spent := rows[kname].SpendUSD["day"]
			t.Logf("figure: 30 parallel requests by %s on a $1 budget: %d served, $%.4f spent", name, served.Load(), spent)
			// one request's error past the budget, at most: $1 + $0.5702
			if spent > 1.5703 || served.Load() > 2 || int64(hits.Load()) != served.Load() {
				t.Errorf("%d served (upstream: %d), $%.4f spent of a $1 budget", served.Load(), hits.Load(), spent)
			}
			if served.Load() == 0 {
				t.Error("nothing was served: the floor must fit within the budget")
			}
		})
	}
}

// TestAFloorIsOnlyForPromptsOutsideTheBody: a request whose prompt is all
// in its body holds its own worst case, not the floor; hold_floor sets the
// floor; a request that escapes no letter is not taken for one that hides
// a key.
func TestAFloorIsOnlyForPromptsOutsideTheBody(t *testing.T) {
	floor := 0.25
	r, _ := floorRelay(t, "floor-plain", &floor)
	plan := func(body string) money.NanoUSD {
		in := &inbound{route: routeMessages, ask: asked{body: []byte(body), header: http.Header{}}, who: requester{key: r.keyByName(t, "floor-plain")}}
		in.who.state = in.who.key.state
		if rerr := in.inspect(); rerr != nil {
			t.Fatal(rerr.msg)
		}
		in.ask.estimate = estimateTokens(in.ask.body)
		if rerr := r.planHolds(in); rerr != nil {
			t.Fatal(rerr.msg)
		}
		return in.grant.worst
	}
	plain := plan(`{"model":"m-floor","max_tokens":16,"messages":[{"role":"user","content":"caf\u00e9 \u003cb\u003e"}]}`)
	if plain.USD() > 0.001 {
		t.Errorf("a prompt in its body holds $%v", plain.USD())
	}
	withFile := plan(`{"model":"m-floor","max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"url","url":"https://x/a.pdf"}}]}]}`)
	if got := withFile.USD(); got < 0.25 || got > 0.2504 {
		t.Errorf("a prompt by URL holds $%v, want hold_floor's $0.25 and its output", got)
	}
}

// TestABatchHoldsTheFloorOfEachRequestThatReadsOutside: a batch's request
// whose prompt is a file holds the floor at the batch price, each of them,
// uncapped by any budget (a batch's requests are many); one whose prompt
// is in its params holds its own worst case.
func TestABatchHoldsTheFloorOfEachRequestThatReadsOutside(t *testing.T) {
	r, _ := floorRelay(t, "floor-batch", nil)
	plain := `{"custom_id":"a","params":{"model":"m-floor","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}}`
	file := `{"custom_id":"b","params":{"model":"m-floor","max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"file","file_id":"file_x"}}]}]}}`
	if got := r.batchWorstCase([]byte(`{"requests":[`+plain+`]}`), 1, false); got > 0.001 {
		t.Errorf("a batch of a plain request holds $%v", got)
	}
	// 200,000 tokens at $3/M and 16 at $15/M, at half price: $0.30012 each
	got := r.batchWorstCase([]byte(`{"requests":[`+file+`,`+file+`,`+plain+`]}`), 1, false)
	if got < 0.6002 || got > 0.6008 {
		t.Errorf("a batch of two requests by file_id holds $%v, want $0.6002 and the plain one's", got)
	}
	if long := r.batchWorstCase([]byte(`{"requests":[`+file+`]}`), 1, true); long < 1.5 {
		t.Errorf("with the 1M context a file request holds $%v, want a 1,000,000-token floor", long)
	}
}

// TestHoldFloorIsReadFromTheCaddyfile: an amount in US dollars, with or
// without its unit; anything else is refused with the option's name.
func TestHoldFloorIsReadFromTheCaddyfile(t *testing.T) {
	const tail = "\tkey sk-client-secret-0123456789 g\n\tchannel a {\n\t\tapi_key {env.A}\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n}\n"
	for in, want := range map[string]float64{"0.5": 0.5, "2usd": 2, "0": 0} {
		r, err := parseRelay(t, "relay {\n\thold_floor "+in+"\n"+tail)
		if err != nil || r.HoldFloor == nil || *r.HoldFloor != want {
			t.Errorf("hold_floor %s: %v", in, err)
		}
	}
	for _, bad := range []string{"-1", "lots", "NaN", "Inf"} {
		if _, err := parseRelay(t, "relay {\n\thold_floor "+bad+"\n"+tail); err == nil || !strings.Contains(err.Error(), "hold_floor") {
			t.Errorf("hold_floor %s: %v", bad, err)
		}
	}
}
