package relay

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/tidwall/gjson"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/health"
)

const (
	opusModel   = "claude-opus-4-1"
	sonnetModel = "claude-sonnet-4-5"
)

func classBody(model string) string {
	return `{"model":"` + model + `","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`
}

// perModel answers a request for a model of answers with its handler, any
// other with def.
func perModel(answers map[string]http.Handler, def http.Handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if h, ok := answers[gjson.GetBytes(b, "model").String()]; ok {
			h.ServeHTTP(w, r)
			return
		}
		def.ServeHTTP(w, r)
	}
}

// hitsFor counts the requests for model an upstream received.
func hitsFor(up *fakeupstream.Upstream, model string) int {
	n := 0
	for _, r := range up.Requests() {
		if gjson.GetBytes(r.Body, "model").String() == model {
			n++
		}
	}
	return n
}

// classRelay provisions a relay whose group name holds two anthropic
// channels, name-a (priority 1) at a and name-b (priority 2) at b, each
// with the channel options of opts, driven by a fake clock.
func classRelay(t *testing.T, name, a, b string, opts func(*Channel), group func(*Group)) (*Relay, *fakeClock) {
	t.Helper()
	chA := &Channel{Name: name + "-a", UpstreamRaw: upstream("anthropic", "url", a, "api_key", channelKey), Priority: 1}
	chB := &Channel{Name: name + "-b", UpstreamRaw: upstream("anthropic", "url", b, "api_key", channelKey), Priority: 2}
	if opts != nil {
		opts(chA)
		opts(chB)
	}
	g := &Group{Name: name, Channels: []string{chA.Name, chB.Name}}
	if group != nil {
		group(g)
	}
	r := &Relay{Keys: []*Key{{Secret: "sk-" + name + "-0123456789", Group: name}}, Channels: []*Channel{chA, chB}, Groups: []*Group{g}}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Unix(1_900_000_000, 0)}
	r.now = clock.now
	return r, clock
}

// sendModel sends a request for model through r as name's key.
func sendModel(t *testing.T, r *Relay, name, model string) *httptest.ResponseRecorder {
	t.Helper()
	w, _ := serveHandler(t, r, newRequest(classBody(model), "sk-"+name+"-0123456789"))
	return w
}

func TestModelClasses(t *testing.T) {
	ch := &channel{classRows: classRows(newPricebook(map[string]Price{"my-finetune": {Input: 1, Output: 2}}))}
	for id, want := range map[string]string{
		"claude-opus-4-1":                                 "opus",
		"claude-opus-4-1-20250805":                        "opus",
		"us.anthropic.claude-opus-4-1-20250805-v1:0":      "opus",
		"claude-sonnet-4-5@20250929":                      "sonnet",
		"anthropic.claude-3-5-sonnet-20241022-v2:0":       "sonnet",
		"claude-haiku-4-5":                                "haiku",
		"claude-fable-5-1":                                "claude-fable-5-1",
		"claude-fable-5-1-20260301":                       "claude-fable-5-1",
		"claude-fable-5":                                  "claude-fable-5",
		"my-finetune":                                     "my-finetune",
		"claude-opusx-1":                                  "other", // not the word opus
		"magnum-opus":                                     "opus",
		"some-model-nobody-lists":                         "other",
		"arn:aws:bedrock:us-east-1:1:inference-profile/x": "other",
	} {
		if got := ch.classify(id, false); got != want {
			t.Errorf("class of %q = %q, want %q", id, got, want)
		}
	}
	if got := ch.classify("my-own-model", true); got != "my-own-model" {
		t.Errorf("a listed model none of the rules names is a class of its own, got %q", got)
	}

	// model_class lines come first, and match the upstream id
	ch.classRules = []ModelClass{{Match: "*fast*", Class: "fast"}, {Match: "claude-*-4-5", Class: "gen45"}}
	for id, want := range map[string]string{"claude-sonnet-4-5": "gen45", "claude-haiku-fast": "fast", "claude-opus-4-1": "opus"} {
		if got := ch.classify(id, false); got != want {
			t.Errorf("with rules, class of %q = %q, want %q", id, got, want)
		}
	}

	// the class of a request is the class of the upstream id it is mapped to
	ch = &channel{}
	ch.models, _ = parseModels([]string{"big=us.anthropic.claude-opus-4-1-v1:0", "small=claude-haiku-4-5", "mine=vendor-model-7"})
	ch.provisionClasses(nil, classRows(newPricebook(nil)))
	for model, want := range map[string]string{"big": "opus", "small": "haiku", "mine": "vendor-model-7"} {
		if got := ch.classOf(model); got != want {
			t.Errorf("class of %q on a mapping channel = %q, want %q", model, got, want)
		}
	}
	if !slices.Equal(ch.classNames, []string{"haiku", "opus", "vendor-model-7"}) {
		t.Errorf("the class labels of a listing channel: %v", ch.classNames)
	}
}

func TestGlobMatch(t *testing.T) {
	for _, c := range []struct {
		pattern, s string
		want       bool
	}{
		{"*", "", true}, {"*", "anything/at:all", true}, {"a*", "a", true}, {"a*", "ba", false},
		{"*opus*", "us.anthropic.claude-opus-4-1-v1:0", true}, {"*opus*", "claude-sonnet", false},
		{"claude-*-4-5", "claude-sonnet-4-5", true}, {"claude-*-4-5", "claude-sonnet-4-5-x", false},
		{"a*b*c", "aXbYbZc", true}, {"a*b*c", "aXbYbZ", false}, {"abc", "abc", true}, {"abc", "abcd", false},
		{"**x", "yyx", true}, {"x**", "x", true},
	} {
		if got := globMatch(c.pattern, c.s); got != c.want {
			t.Errorf("globMatch(%q, %q) = %v, want %v", c.pattern, c.s, got, c.want)
		}
	}
}

func TestModelClassLines(t *testing.T) {
	for _, c := range []struct {
		m   ModelClass
		bad string
	}{
		{ModelClass{Match: "*opus*", Class: "opus"}, ""},
		{ModelClass{Match: "*", Class: "all"}, ""},
		{ModelClass{Match: "", Class: "x"}, "glob"},
		{ModelClass{Match: "a b", Class: "x"}, "only letters"},
		{ModelClass{Match: "*opus*", Class: "a/b"}, "want letters"},
		{ModelClass{Match: "*opus*", Class: "other"}, "no line names"},
	} {
		err := c.m.validate()
		if c.bad == "" && err != nil || c.bad != "" && (err == nil || !strings.Contains(err.Error(), c.bad)) {
			t.Errorf("%+v: %v, want %q", c.m, err, c.bad)
		}
	}
}

func TestModelClassInTheCaddyfile(t *testing.T) {
	r, err := parseRelay(t, "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel a {\n\t\tapi_key {env.A}\n"+
		"\t\tmodel_class *opus* big\n\t\tmodel_class claude-*-fast fast\n\t}\n\tgroup prod {\n\t\tchannels a\n\t}\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := r.Channels[0].ModelClasses, []ModelClass{{"*opus*", "big"}, {"claude-*-fast", "fast"}}; !slices.Equal(got, want) {
		t.Fatalf("model_classes %+v, want %+v", got, want)
	}
	base := func(line string) string {
		return "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel a {\n\t\tapi_key {env.A}\n" + line +
			"\t}\n\tgroup prod {\n\t\tchannels a\n\t}\n}\n"
	}
	for name, src := range map[string]string{
		"a class named other":  base("\t\tmodel_class *opus* other # here\n"),
		"a class with a slash": base("\t\tmodel_class *opus* a/b # here\n"),
		"a glob with a quote":  base("\t\tmodel_class *op\"us* big # here\n"),
		"no class":             base("\t\tmodel_class *opus* # here\n"),
		"a third argument":     base("\t\tmodel_class *opus* big more # here\n"),
		"after a good one":     base("\t\tmodel_class *opus* big\n\t\tmodel_class *haiku* other # here\n"),
	} {
		wantErrorAtMarkedLine(t, name, src)
	}
}

func TestAnOpus429CoolsOnlyOpusOnItsChannel(t *testing.T) {
	a := fakeupstream.New(t, perModel(map[string]http.Handler{
		opusModel: fakeupstream.Error(429, "rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit", "Retry-After", "30"),
	}, fakeupstream.Message("from a")))
	b := fakeupstream.New(t, fakeupstream.Message("from b"))
	r, clock := classRelay(t, "cls429", a.URL, b.URL, nil, nil)

	if w := sendModel(t, r, "cls429", opusModel); w.Code != 200 || !strings.Contains(w.Body.String(), "from b") {
		t.Fatalf("opus through a 429: %d %s", w.Code, w.Body)
	}
	if w := sendModel(t, r, "cls429", sonnetModel); w.Code != 200 || !strings.Contains(w.Body.String(), "from a") {
		t.Fatalf("sonnet after an opus 429 must still go to a: %d %s", w.Code, w.Body)
	}
	if w := sendModel(t, r, "cls429", opusModel); w.Code != 200 || !strings.Contains(w.Body.String(), "from b") {
		t.Fatalf("opus while opus cools on a: %d %s", w.Code, w.Body)
	}
	if hitsFor(a, opusModel) != 1 || hitsFor(a, sonnetModel) != 1 || hitsFor(b, opusModel) != 2 || hitsFor(b, sonnetModel) != 0 {
		t.Fatalf("a saw opus %d, sonnet %d; b saw opus %d, sonnet %d", hitsFor(a, opusModel), hitsFor(a, sonnetModel), hitsFor(b, opusModel), hitsFor(b, sonnetModel))
	}

	h := findChannel("cls429-a")
	st := h.status("cls429-a", clock.now())
	want := classStatus{State: stateCooldown, Until: clock.now().Add(30 * time.Second).UTC(), Reason: "status 429"}
	if st.State != stateCooldown || len(st.Classes) != 1 || st.Classes["opus"] != want || !st.CooldownUntil.Equal(want.Until) ||
		st.LastError != "rate_limited" || st.LastErrorReason != "status 429 (class opus)" {
		t.Fatalf("a after an opus 429: %+v", st)
	}
	if h.ChannelState(clock.now()) != stateHealthy {
		t.Errorf("the channel itself is %s: only its opus class cools", h.ChannelState(clock.now()))
	}

	// 30s on, opus is back on a
	clock.advance(30 * time.Second)
	sendModel(t, r, "cls429", opusModel)
	if hitsFor(a, opusModel) != 2 {
		t.Errorf("opus after its cooldown ended: a saw it %d times, want 2", hitsFor(a, opusModel))
	}
}

func TestWhatCoolsAClassAndWhatCoolsTheChannel(t *testing.T) {
	for _, c := range []struct {
		name    string
		answer  http.Handler
		channel bool // the whole channel cools
	}{
		{"529", fakeupstream.Error(529, "overloaded_error", "Overloaded"), false},
		{"overloaded-event", fakeupstream.Stream(fakeupstream.Event("error", `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`)), false},
		{"500", fakeupstream.Error(500, "api_error", "Internal server error"), true},
		{"401", fakeupstream.Error(401, "authentication_error", "invalid x-api-key"), true},
		{"spend-limit-429", fakeupstream.Raw(429, []byte(`{"type":"error","error":{"type":"rate_limit_error","message":"spend limit","details":{"error_code":"enforced_spend_limit_reached"}}}`)), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := "clsw-" + c.name
			a := fakeupstream.New(t, perModel(map[string]http.Handler{opusModel: c.answer}, fakeupstream.Message("from a")))
			b := fakeupstream.New(t, fakeupstream.Message("from b"))
			r, clock := classRelay(t, name, a.URL, b.URL, nil, nil)
			if w := sendModel(t, r, name, opusModel); w.Code != 200 || !strings.Contains(w.Body.String(), "from b") {
				t.Fatalf("opus: %d %s", w.Code, w.Body)
			}
			w := sendModel(t, r, name, sonnetModel)
			st := findChannel(name+"-a").status(name+"-a", clock.now())
			if c.channel {
				if !strings.Contains(w.Body.String(), "from b") || hitsFor(a, sonnetModel) != 0 || st.Classes != nil || st.State != stateCooldown {
					t.Fatalf("after a %s on opus, the whole channel cools: sonnet got %s, a: %+v", c.name, w.Body, st)
				}
				return
			}
			if !strings.Contains(w.Body.String(), "from a") || hitsFor(a, sonnetModel) != 1 {
				t.Fatalf("after a %s on opus, sonnet still goes to a: %s", c.name, w.Body)
			}
			if cl, ok := st.Classes["opus"]; !ok || !cl.Until.Equal(clock.now().Add(defaultCooldown)) || st.State != stateCooldown {
				t.Fatalf("a after a %s on opus: %+v", c.name, st)
			}
			sendModel(t, r, name, opusModel)
			if hitsFor(a, opusModel) != 1 {
				t.Errorf("opus went to a again while its class cools there")
			}
		})
	}
}

func TestASpentQuotaOfAnOpusAnswerCoolsOnlyOpus(t *testing.T) {
	var reset string
	a := fakeupstream.New(t, perModel(map[string]http.Handler{
		opusModel: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Anthropic-Ratelimit-Tokens-Remaining", "0")
			w.Header().Set("Anthropic-Ratelimit-Tokens-Reset", reset)
			w.Header().Set("Anthropic-Ratelimit-Requests-Remaining", "40")
			fakeupstream.Message("opus from a")(w, r)
		}),
	}, fakeupstream.Message("from a")))
	b := fakeupstream.New(t, fakeupstream.Message("from b"))
	r, clock := classRelay(t, "clsquota", a.URL, b.URL, nil, nil)
	reset = clock.now().Add(20 * time.Second).UTC().Format(time.RFC3339)

	if w := sendModel(t, r, "clsquota", opusModel); w.Code != 200 || !strings.Contains(w.Body.String(), "opus from a") {
		t.Fatalf("opus: %d %s", w.Code, w.Body)
	}
	if w := sendModel(t, r, "clsquota", sonnetModel); !strings.Contains(w.Body.String(), "from a") {
		t.Fatalf("sonnet after opus's quota was spent on a: %s", w.Body)
	}
	if w := sendModel(t, r, "clsquota", opusModel); !strings.Contains(w.Body.String(), "from b") {
		t.Fatalf("opus while its quota on a is spent: %s", w.Body)
	}
	st := findChannel("clsquota-a").status("clsquota-a", clock.now())
	if cl := st.Classes["opus"]; len(st.Classes) != 1 || !cl.Until.Equal(clock.now().Add(20*time.Second).UTC()) ||
		cl.Reason != "anthropic-ratelimit-tokens-remaining: 0" || st.Busy {
		t.Fatalf("a after opus's quota was spent: %+v", st)
	}
	clock.advance(20 * time.Second)
	if w := sendModel(t, r, "clsquota", opusModel); !strings.Contains(w.Body.String(), "from a") {
		t.Errorf("opus after its quota's reset: %s", w.Body)
	}
}

// A request whose every candidate cools because its upstream said so is
// answered in the upstream's words: 529 overloaded_error after 529s, 429
// rate_limit_error after 429s, with the wait to the first recovery.
func TestEveryCandidateClassCoolingAnswersAsEveryChannelCooling(t *testing.T) {
	t.Run("529s", func(t *testing.T) {
		a := fakeupstream.New(t, perModel(map[string]http.Handler{opusModel: fakeupstream.Error(529, "overloaded_error", "Overloaded")}, fakeupstream.Message("from a")))
		b := fakeupstream.New(t, perModel(map[string]http.Handler{opusModel: fakeupstream.Error(529, "overloaded_error", "Overloaded")}, fakeupstream.Message("from b")))
		r, clock := classRelay(t, "clsall", a.URL, b.URL, func(ch *Channel) {
			ch.Cooldown = caddy.Duration(30 * time.Second)
			if strings.HasSuffix(ch.Name, "-b") {
				ch.Cooldown = caddy.Duration(10 * time.Second)
			}
		}, nil)
		if w := sendModel(t, r, "clsall", opusModel); w.Code != 529 {
			t.Fatalf("opus, both channels overloaded: %d %s", w.Code, w.Body)
		}
		clock.advance(4 * time.Second)
		// the relay speaks the upstreams' language: they said overloaded
		w := sendModel(t, r, "clsall", opusModel)
		if w.Code != 529 || gjson.Get(w.Body.String(), "error.type").String() != "overloaded_error" ||
			gjson.Get(w.Body.String(), "error.code").String() != "no_healthy_channel" ||
			w.Header().Get("Retry-After") != "6" || w.Header().Get("Retry-After-Ms") != "6000" || w.Header().Get("X-Should-Retry") != "" {
			t.Fatalf("opus while it cools everywhere: %d %v %s (want 529 overloaded_error no_healthy_channel, retry-after the first recovery, 6s)", w.Code, w.Header(), w.Body)
		}
		if w := sendModel(t, r, "clsall", sonnetModel); w.Code != 200 || !strings.Contains(w.Body.String(), "from a") {
			t.Fatalf("sonnet meanwhile: %d %s", w.Code, w.Body)
		}
		if a.Hits()+b.Hits() != 3 {
			t.Errorf("the upstreams saw %d requests, want 3", a.Hits()+b.Hits())
		}
	})
	t.Run("429s", func(t *testing.T) {
		a := fakeupstream.New(t, perModel(map[string]http.Handler{opusModel: fakeupstream.Error(429, "rate_limit_error", "limited", "Retry-After", "40")}, fakeupstream.Message("from a")))
		b := fakeupstream.New(t, perModel(map[string]http.Handler{opusModel: fakeupstream.Error(429, "rate_limit_error", "limited", "Retry-After", "20")}, fakeupstream.Message("from b")))
		r, _ := classRelay(t, "clsall429", a.URL, b.URL, nil, func(g *Group) { g.MaxQueue = -1 })
		if w := sendModel(t, r, "clsall429", opusModel); w.Code != 429 {
			t.Fatalf("opus, both channels limited: %d %s", w.Code, w.Body)
		}
		w := sendModel(t, r, "clsall429", opusModel)
		if w.Code != 429 || gjson.Get(w.Body.String(), "error.type").String() != "rate_limit_error" ||
			gjson.Get(w.Body.String(), "error.code").String() != "no_healthy_channel" ||
			!strings.Contains(w.Body.String(), "rate-limited by its upstream") || w.Header().Get("Retry-After") != "20" || w.Header().Get("X-Should-Retry") != "" {
			t.Fatalf("opus while it is limited everywhere: %d %v %s", w.Code, w.Header(), w.Body)
		}
	})
}

// A mix of reasons is the relay's own 503: a channel overloaded and one
// failing (or one rate-limited) is no one upstream's word.
func TestCandidatesCoolingForMixedReasonsAnswer503(t *testing.T) {
	for _, c := range []struct {
		name string
		b    http.Handler
	}{
		{"529 and 500", fakeupstream.Error(500, "api_error", "Internal server error")},
		{"529 and 429", fakeupstream.Error(429, "rate_limit_error", "limited", "Retry-After", "40")},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := "clsmix" + strings.ReplaceAll(c.name, " ", "")
			a := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
			b := fakeupstream.New(t, c.b)
			r, _ := classRelay(t, name, a.URL, b.URL, nil, func(g *Group) { g.MaxQueue = -1 })
			sendModel(t, r, name, opusModel) // both answer their error: each cools
			w := sendModel(t, r, name, opusModel)
			if w.Code != 503 || gjson.Get(w.Body.String(), "error.type").String() != "relay_error" ||
				gjson.Get(w.Body.String(), "error.code").String() != "no_healthy_channel" || w.Header().Get("Retry-After") == "" {
				t.Fatalf("opus while one channel is overloaded and the other out for another reason: %d %v %s", w.Code, w.Header(), w.Body)
			}
			if a.Hits() != 1 || b.Hits() != 1 {
				t.Errorf("the upstreams saw %d and %d requests, want 1 each: no upstream is asked while all cool", a.Hits(), b.Hits())
			}
		})
	}
}

func TestClassCooldownsOnTheAdminAPIAndMetrics(t *testing.T) {
	a := fakeupstream.New(t, perModel(map[string]http.Handler{
		opusModel: fakeupstream.Error(429, "rate_limit_error", "limited", "Retry-After", "120"),
	}, fakeupstream.Message("from a")))
	b := fakeupstream.New(t, fakeupstream.Message("from b"))
	startRelay(t, channelBlock("clsapi-a", a.URL, "models "+opusModel+" "+sonnetModel+"\n\t\t\tmodel_class *sonnet-4-5* s45")+
		channelBlock("clsapi-b", b.URL, "priority 2")+keyAndGroup("clsapi", "clsapi-a clsapi-b"))
	if r := message(t, classBody(opusModel)); r.status != 200 {
		t.Fatalf("opus: %d %s", r.status, r.body)
	}
	before := time.Now()

	resp, err := client.Get(adminURL + "/relay/channels")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	row := gjson.GetBytes(raw, `#(name=="clsapi-a")`)
	until, err := time.Parse(time.RFC3339Nano, row.Get("classes.opus.until").String())
	if row.Get("state").String() != "cooldown" || row.Get("classes.opus.state").String() != "cooldown" ||
		row.Get("classes.opus.reason").String() != "status 429" || err != nil ||
		until.Before(before.Add(118*time.Second)) || until.After(time.Now().Add(120*time.Second)) ||
		len(row.Get("classes").Map()) != 1 || row.Get("cooldown_until").String() != row.Get("classes.opus.until").String() {
		t.Fatalf("GET /relay/channels, clsapi-a: %s", row.Raw)
	}
	if row := gjson.GetBytes(raw, `#(name=="clsapi-b")`); row.Get("state").String() != "healthy" || row.Get("classes").Exists() {
		t.Fatalf("GET /relay/channels, clsapi-b: %s", row.Raw)
	}

	mf, _ := scrape(t)
	if v := value(mf, "relay_channel_class_cooling", "channel=clsapi-a", "class=opus"); v < 118 || v > 120 {
		t.Errorf("relay_channel_class_cooling{channel=clsapi-a,class=opus} = %v, want about 120", v)
	}
	if v := value(mf, "relay_channel_class_cooling", "channel=clsapi-a", "class=s45"); v != 0 {
		t.Errorf("relay_channel_class_cooling{channel=clsapi-a,class=s45} = %v, want 0", v)
	}
	if v := value(mf, "relay_channel_state", "channel=clsapi-a", "state=cooldown"); v != 1 {
		t.Errorf("relay_channel_state{channel=clsapi-a,state=cooldown} = %v, want 1 while a class cools", v)
	}
	var labels []string
	for _, m := range mf["relay_channel_class_cooling"].GetMetric() {
		var ch, class string
		for _, l := range m.GetLabel() {
			switch l.GetName() {
			case "channel":
				ch = l.GetValue()
			case "class":
				class = l.GetValue()
			}
		}
		if ch == "clsapi-a" {
			labels = append(labels, class)
		}
	}
	slices.Sort(labels)
	if !slices.Equal(labels, []string{"opus", "s45"}) {
		t.Errorf("clsapi-a's class labels: %v, want the classes of the models it lists", labels)
	}

	// a reset ends the class's cooldown too
	adminPost(t, "clsapi-a", "reset")
	if st := channels(t)["clsapi-a"]; st.State != stateHealthy || st.Classes != nil {
		t.Errorf("after a reset: %+v", st)
	}
}

// TestAHostileClientCannotGrowClassState sends thousands of model ids of
// its own choosing to a channel that serves every model and answers each
// 429: the class state and the gauge's labels stay the config's.
func TestAHostileClientCannotGrowClassState(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Error(429, "rate_limit_error", "limited", "Retry-After", "1"))
	b := fakeupstream.New(t, fakeupstream.Message("from b"))
	r, clock := classRelay(t, "clshostile", a.URL, b.URL, nil, nil)
	for i := range 2000 {
		sendModel(t, r, "clshostile", fmt.Sprintf("hostile-model-%d", i))
		clock.advance(1100 * time.Millisecond) // each ends its class's cooldown: every request reaches a
	}
	if n := hitsFor(a, "hostile-model-1999"); n != 1 || a.Hits() != 2000 {
		t.Fatalf("the hostile models reached a %d times, want 2000", a.Hits())
	}
	h := findChannel("clshostile-a")
	sendModel(t, r, "clshostile", "hostile-model-last")
	if c := h.CoolingClasses(clock.now()); len(c) != 1 || c[classOther].Until == 0 {
		t.Fatalf("class state after 2000 models: %+v, want one class: other", c)
	}
	// what the fleet could publish is capped too: internal/health's
	// TestClassCooldownsAreBounded

	// and the gauge's labels are the classes the config can name, other
	// standing for any class it does not
	reg := prometheus.NewRegistry()
	reg.MustRegister(metricStates)
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	want := findChannel("clshostile-a").classLabels()
	for _, f := range families {
		if f.GetName() != "relay_channel_class_cooling" {
			continue
		}
		for _, m := range f.GetMetric() {
			var ch, class string
			for _, l := range m.GetLabel() {
				if l.GetName() == "channel" {
					ch = l.GetValue()
				} else if l.GetName() == "class" {
					class = l.GetValue()
				}
			}
			if ch == "clshostile-a" && !slices.Contains(want, class) {
				t.Errorf("label class=%q is not one the config names (%v)", class, want)
			}
		}
	}
	if !slices.Contains(want, classOther) || len(want) > 3+len(classRows(newPricebook(nil)))+1 {
		t.Errorf("the class labels of a channel that serves every model: %v", want)
	}
}

// BenchmarkClassCooldownCheck measures the selector's check of a
// request's model class on one channel: with no class cooling (one
// atomic), and with another class cooling (the model's class resolved and
// looked up).
func BenchmarkClassCooldownCheck(b *testing.B) {
	ch := testChannel("bench-class", withModels("claude-opus-4-1", "claude-sonnet-4-5", "claude-haiku-4-5"))
	ch.provisionClasses(nil, classRows(newPricebook(nil)))
	now := testNow
	b.Run("none cooling", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if ok, _, _ := ch.classAvailable("claude-sonnet-4-5", now); !ok {
				b.Fatal("out")
			}
		}
	})
	coolClass(ch.health, "opus", now)
	b.Run("another cooling", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if ok, _, _ := ch.classAvailable("claude-sonnet-4-5", now); !ok {
				b.Fatal("out")
			}
		}
	})
	b.Run("its own cooling", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if ok, _, _ := ch.classAvailable("claude-opus-4-1", now); ok {
				b.Fatal("not out")
			}
		}
	})
	open := testChannel("bench-class-open")
	open.provisionClasses(nil, classRows(newPricebook(nil)))
	coolClass(open.health, "opus", now)
	b.Run("another cooling, every model served", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if ok, _, _ := open.classAvailable("claude-sonnet-4-5-20250929", now); !ok {
				b.Fatal("out")
			}
		}
	})
}

// coolClass cools class on the channel for a minute from now, as a 529
// for a model of it would.
func coolClass(h *channelHealth, class string, now time.Time) {
	h.Record(health.Verdict{Outcome: outcomeOverloaded, Reason: "status 529", Class: class}, health.CooldownPolicy{Base: time.Minute, Max: time.Minute}, now, 0)
}
