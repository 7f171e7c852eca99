package relay

import (
	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// upstreamRatelimits are the anthropic-ratelimit-* headers of an upstream
// organisation: values no client of the relay may see by default.
var upstreamRatelimits = []string{
	"Anthropic-Ratelimit-Requests-Limit", "4000",
	"Anthropic-Ratelimit-Requests-Remaining", "3999",
	"Anthropic-Ratelimit-Requests-Reset", "2030-01-01T00:00:01Z",
	"Anthropic-Ratelimit-Tokens-Limit", "800000",
	"Anthropic-Ratelimit-Tokens-Remaining", "799000",
	"Anthropic-Ratelimit-Tokens-Reset", "2030-01-01T00:00:02Z",
	"Anthropic-Ratelimit-Input-Tokens-Limit", "600000",
	"Anthropic-Ratelimit-Input-Tokens-Remaining", "599000",
	"Anthropic-Ratelimit-Input-Tokens-Reset", "2030-01-01T00:00:03Z",
	"Anthropic-Ratelimit-Output-Tokens-Limit", "200000",
	"Anthropic-Ratelimit-Output-Tokens-Remaining", "199000",
	"Anthropic-Ratelimit-Output-Tokens-Reset", "2030-01-01T00:00:04Z",
}

// organisationUpstream answers with upstreamRatelimits on every answer: a
// stream when asked for one, a 400 for model claude-refused, and for model
// claude-drained an answer saying its request limit is spent for a minute.
func organisationUpstream(t *testing.T) *fakeupstream.Upstream {
	return fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := mustRead(r)
		for i := 0; i < len(upstreamRatelimits); i += 2 {
			w.Header().Set(upstreamRatelimits[i], upstreamRatelimits[i+1])
		}
		switch {
		case strings.Contains(body, `"stream":true`):
			fakeupstream.Stream(fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 10, OutputTokens: 5}, "hi")...)(w, r)
		case strings.Contains(body, "claude-refused"):
			fakeupstream.Error(400, "invalid_request_error", "messages: field required")(w, r)
		case strings.Contains(body, "claude-drained"):
			w.Header().Set("Anthropic-Ratelimit-Requests-Remaining", "0")
			w.Header().Set("Anthropic-Ratelimit-Requests-Reset", time.Now().Add(time.Minute).UTC().Format(time.RFC3339))
			fallthrough
		default:
			_, _ = w.Write(fakeupstream.MessageBody("claude-sonnet-4-5", "ok", fakeupstream.Usage{InputTokens: 10, OutputTokens: 5}))
		}
	}))
}

// ratelimits returns the anthropic-ratelimit-* headers a client got, by
// name without the prefix, lowercased: "requests-remaining".
func ratelimits(h http.Header) map[string]string {
	out := map[string]string{}
	for k, vs := range h {
		if isRatelimitHeader(k) {
			out[strings.ToLower(k[len(ratelimitPrefix):])] = strings.Join(vs, ",")
		}
	}
	return out
}

// limit is what a client should see of one of its key's limits: the
// limit, what remains ("": not checked) and a window for the reset (zero:
// not checked beyond its form).
type limit struct {
	limit, remaining string
	from, to         time.Time
}

// wantOwnLimits checks that a client got exactly its key's headers: those
// of each limit (requests, tokens) given, none of another, none of the
// upstream's.
func wantOwnLimits(t *testing.T, what string, r reply, want map[string]limit) map[string]string {
	t.Helper()
	got := ratelimits(r.header)
	if len(got) != 3*len(want) {
		t.Errorf("%s: anthropic-ratelimit-* headers %v, want those of %v only", what, got, want)
	}
	for name, l := range want {
		if got[name+"-limit"] != l.limit {
			t.Errorf("%s: %s-limit = %q, want %q", what, name, got[name+"-limit"], l.limit)
		}
		if l.remaining != "" && got[name+"-remaining"] != l.remaining {
			t.Errorf("%s: %s-remaining = %q, want %q", what, name, got[name+"-remaining"], l.remaining)
		}
		reset, err := time.Parse(time.RFC3339, got[name+"-reset"])
		if err != nil || !strings.HasSuffix(got[name+"-reset"], "Z") {
			t.Errorf("%s: %s-reset = %q is not RFC 3339 in UTC", what, name, got[name+"-reset"])
			continue
		}
		if !l.from.IsZero() && (reset.Before(l.from.Truncate(time.Second)) || reset.After(l.to)) {
			t.Errorf("%s: %s-reset = %v, want between %v and %v", what, name, reset, l.from, l.to)
		}
	}
	return got
}

func TestEachClientSeesItsOwnKeysRateLimits(t *testing.T) {
	const alpha, bravo = "sk-rlh-alpha-0123456789abcdef", "sk-rlh-bravo-0123456789abcdef"
	up := organisationUpstream(t)
	keys := "\t\tkey " + alpha + " rlh {\n\t\t\tname rlh-alpha\n\t\t\trate 10/h\n\t\t\ttokens 100000/d\n\t\t}\n" +
		"\t\tkey " + bravo + " rlh {\n\t\t\tname rlh-bravo\n\t\t\trate 5/h\n\t\t}\n"
	startRelay(t, keys+channelBlock("rlh-ch", up.URL)+"\t\tgroup rlh {\n\t\t\tchannels rlh-ch\n\t\t}\n")
	estimate := estimateTokens([]byte(simpleBody))
	tokenSecs := func(n int64) time.Duration {
		return time.Duration(float64(n) / (100000.0 / 86400) * float64(time.Second))
	}

	// alpha: 10 requests an hour (one back every 6m), 100000 tokens a day
	start := time.Now()
	r := send(t, "POST", "/v1/messages", alpha, simpleBody)
	if r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	wantOwnLimits(t, "alpha's first answer", r, map[string]limit{
		"requests": {"10", "9", start.Add(6 * time.Minute), time.Now().Add(6*time.Minute + time.Second)},
		// its estimate is charged until it ends
		"tokens": {"100000", itoa(100000 - estimate), start.Add(tokenSecs(estimate) - time.Second), time.Now().Add(tokenSecs(estimate) + time.Second)},
	})

	// what remains decreases: the first is charged the 15 tokens it used
	// (once the relay is done with it, which may be just after the client
	// has its answer) and the second its estimate
	r = send(t, "POST", "/v1/messages", alpha, simpleBody)
	second := wantOwnLimits(t, "alpha's second answer", r, map[string]limit{
		"requests": {"10", "8", start.Add(12 * time.Minute), time.Now().Add(12*time.Minute + time.Second)},
		"tokens":   {limit: "100000"},
	})
	if n, _ := strconv.ParseInt(second["tokens-remaining"], 10, 64); n != 100000-15-estimate && n != 100000-2*estimate {
		t.Errorf("tokens-remaining %d after the second request, want %d", n, 100000-15-estimate)
	}

	// a stream, and an upstream's error passed through, are alike
	r = send(t, "POST", "/v1/messages", alpha, streamBody)
	if r.status != 200 || !strings.Contains(string(r.body), "message_stop") {
		t.Fatalf("stream: %d %s", r.status, r.body)
	}
	wantOwnLimits(t, "alpha's stream", r, map[string]limit{"requests": {limit: "10", remaining: "7"}, "tokens": {limit: "100000"}})
	r = send(t, "POST", "/v1/messages", alpha, `{"model":"claude-refused","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 400 || !strings.Contains(string(r.body), "messages: field required") {
		t.Fatalf("the upstream's 400: %d %s", r.status, r.body)
	}
	wantOwnLimits(t, "the upstream's 400 to alpha", r, map[string]limit{"requests": {limit: "10", remaining: "6"}, "tokens": {limit: "100000"}})

	// bravo, on the same channel: 5 requests an hour and no token limit
	for n := 4; n >= 0; n-- {
		r = send(t, "POST", "/v1/messages", bravo, simpleBody)
		if r.status != 200 {
			t.Fatalf("bravo: %d %s", r.status, r.body)
		}
		wantOwnLimits(t, "bravo", r, map[string]limit{"requests": {"5", itoa(int64(n)), start, time.Now().Add(time.Hour + time.Second)}})
	}
	// the relay's own 429 says the same
	before := time.Now()
	r = send(t, "POST", "/v1/messages", bravo, simpleBody)
	wantRelayError(t, r, 429, "rate_limit_error", "key_rate_limited")
	wantOwnLimits(t, "bravo's 429", r, map[string]limit{"requests": {"5", "0", before.Add(time.Hour - 13*time.Minute), time.Now().Add(time.Hour + time.Second)}})

	// the relay still reads the upstream's own: a spent limit cools the
	// model's class on the channel until its reset, though no client saw it
	r = send(t, "POST", "/v1/messages", alpha, `{"model":"claude-drained","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`)
	wantOwnLimits(t, "alpha, the upstream drained", r, map[string]limit{"requests": {limit: "10", remaining: "5"}, "tokens": {limit: "100000"}})
	if c, ok := channels(t)["rlh-ch"].Classes["other"]; !ok || c.Until.Before(time.Now().Add(50*time.Second)) {
		t.Errorf("the channel after its upstream said its requests were spent: class other cooling %v until %v", ok, c.Until)
	}

	// pass: the upstream's headers, unchanged, and none of the relay's
	passUp := organisationUpstream(t)
	startRelay(t, "\t\tupstream_ratelimit_headers pass\n"+keys+channelBlock("rlh-pass-ch", passUp.URL)+"\t\tgroup rlh {\n\t\t\tchannels rlh-pass-ch\n\t\t}\n")
	for _, body := range []string{simpleBody, streamBody, `{"model":"claude-refused","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`} {
		r = send(t, "POST", "/v1/messages", alpha, body)
		got := ratelimits(r.header)
		if len(got) != len(upstreamRatelimits)/2 {
			t.Errorf("pass, %s: %v, want the upstream's %d headers", body, got, len(upstreamRatelimits)/2)
		}
		for i := 0; i < len(upstreamRatelimits); i += 2 {
			if v := r.header.Get(upstreamRatelimits[i]); v != upstreamRatelimits[i+1] {
				t.Errorf("pass, %s: %s = %q, want the upstream's %q", body, upstreamRatelimits[i], v, upstreamRatelimits[i+1])
			}
		}
	}
	r = send(t, "POST", "/v1/messages", bravo, simpleBody) // still over its rate: limits survive a reload
	wantRelayError(t, r, 429, "rate_limit_error", "key_rate_limited")
	if got := ratelimits(r.header); len(got) != 0 {
		t.Errorf("pass: the relay's 429 carries %v, want no anthropic-ratelimit-* header", got)
	}
}

func TestRatelimitHeadersOption(t *testing.T) {
	for _, v := range []string{"replace", "pass"} {
		r, err := parseRelay(t, caddyfileWith("upstream_ratelimit_headers "+v+"\nkey sk-test g\n", "", ""))
		if err != nil || r.UpstreamRatelimitHeaders != v {
			t.Errorf("%s: %v %q", v, err, r.UpstreamRatelimitHeaders)
		}
	}
	for src, want := range map[string]string{
		"upstream_ratelimit_headers strip\nkey sk-test g\n": `upstream_ratelimit_headers must be replace or pass, not "strip"`,
		"upstream_ratelimit_headers\nkey sk-test g\n":       "wrong argument count",
	} {
		if _, err := parseRelay(t, caddyfileWith(src, "", "")); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want %q", src, err, want)
		}
	}
}

func TestHeadroomOfLocalLimits(t *testing.T) {
	l := new(limits.Limiter)
	l.Configure(limits.Spec{Rate: limits.Rate{N: 3, Period: time.Minute}, Tokens: limits.Rate{N: 1200, Period: time.Minute}}, testNow)
	g, scope, _ := l.Take(testNow, 300)
	if scope != limits.ScopeNone {
		t.Fatal(scope)
	}
	spec, left := l.Left(testNow, g)
	if left.Requests != 2 || !left.RequestsFull.Equal(testNow.Add(20*time.Second)) || left.Tokens != 900 || !left.TokensFull.Equal(testNow.Add(15*time.Second)) {
		t.Errorf("after one request of 300 tokens: %+v", left)
	}
	h := http.Header{}
	setRatelimitHeaders(h, spec, left)
	for k, want := range map[string]string{
		"requests-limit": "3", "requests-remaining": "2", "requests-reset": "2025-03-14T15:09:46Z",
		"tokens-limit": "1200", "tokens-remaining": "900", "tokens-reset": "2025-03-14T15:09:41Z",
	} {
		if got := ratelimits(h)[k]; got != want {
			t.Errorf("%s = %q, want %q", k, got, want)
		}
	}
	// the bucket in debt: nothing remains, full again once the debt is paid
	l.Charge(testNow, &g, 1000)
	if _, left := l.Left(testNow, g); left.Tokens != 0 || !left.TokensFull.Equal(testNow.Add(65*time.Second)) {
		t.Errorf("in debt: %+v", left)
	}
	// a reset that falls inside a second is rounded up to the next
	h = http.Header{}
	setRatelimit(h, "Requests", 3, 1, testNow.Add(1500*time.Millisecond))
	if got := h.Get("Anthropic-Ratelimit-Requests-Reset"); got != "2025-03-14T15:09:28Z" {
		t.Errorf("reset %q, want it rounded up", got)
	}
}

func TestSharedLimitsSayWhatIsLeft(t *testing.T) {
	srv := redistest.Start(t)
	// a large bucket: its numbers need all their digits in Redis
	spec := limits.Spec{Rate: limits.Rate{N: 10, Period: time.Minute}, Tokens: limits.Rate{N: 3_000_000_000, Period: 1000 * 24 * time.Hour}}
	// exact: a bucket this large would be leased in blocks, whose headers
	// count what the blocks of the other nodes hold as spent
	fa, fb := testFleet(t, srv.Addr, "left:", 0), testFleet(t, srv.Addr, "left:", 0)
	fa.limits.NoLeases(true)
	fb.limits.NoLeases(true)
	a := sharedLimiter(t, fa, "k:left", spec)
	b := sharedLimiter(t, fb, "k:left", spec) // another node

	near := func(got, want time.Time, what string) {
		t.Helper()
		if d := got.Sub(want); d < -50*time.Millisecond || d > 50*time.Millisecond {
			t.Errorf("%s: %v, want %v", what, got, want)
		}
	}
	perToken := time.Duration(float64(1000*24*time.Hour) / 3e9) // 28.8ms: 35 tokens a second
	t0 := time.Now()
	g, scope, _ := a.Take(t0, 1_000_000)
	if scope != limits.ScopeNone || !g.Left.Known {
		t.Fatalf("refused by %q, or nothing said of what is left: %+v", scope, g.Left)
	}
	if g.Left.Requests != 9 || g.Left.Tokens != 2_999_000_000 {
		t.Errorf("after the first request: %d requests, %d tokens left; want 9 and 2999000000", g.Left.Requests, g.Left.Tokens)
	}
	near(g.Left.RequestsFull, t0.Add(6*time.Second), "the rate full again")
	near(g.Left.TokensFull, t0.Add(1_000_000*perToken), "the bucket full again")

	// the other node's answer counts what this one took, and its own
	g2, scope, _ := b.Take(time.Now(), 2_000_000)
	if scope != limits.ScopeNone || g2.Left.Requests != 8 {
		t.Fatalf("the other node: %q, %d requests left, want 8", scope, g2.Left.Requests)
	}
	if g2.Left.Tokens < 2_997_000_000 || g2.Left.Tokens > 2_997_000_100 {
		t.Errorf("tokens left %d, want 2997000000 and the few refilled since", g2.Left.Tokens)
	}
	near(g2.Left.RequestsFull, t0.Add(12*time.Second), "the rate full again after two")
	// an estimate charged once the body is read counts at once
	b.Charge(time.Now(), &g2, 500_000)
	if g2.Left.Tokens < 2_996_500_000 || g2.Left.Tokens > 2_996_500_100 {
		t.Errorf("after a charge of 500000: %d tokens left", g2.Left.Tokens)
	}
	near(g2.Left.TokensFull, t0.Add(3_500_000*perToken), "the bucket full again after the charge")
	a.Done(time.Now(), g, 0)
	b.Done(time.Now(), g2, 0)

	// a refusal says what is left too: the rate spent, full a minute after
	// the first
	for range 8 {
		g, scope, _ := a.Take(time.Now(), -1)
		if scope != limits.ScopeNone {
			t.Fatal(scope)
		}
		a.Done(time.Now(), g, 0)
	}
	g, scope, wait := a.Take(time.Now(), 10)
	if scope != limits.ScopeRate || wait <= 0 {
		t.Fatalf("the eleventh request: %q, wait %v; want a rate refusal", scope, wait)
	}
	if !g.Left.Known || g.Left.Requests != 0 || g.Left.Tokens < 2_996_000_000 {
		t.Errorf("refused: %+v, want no request and the tokens left", g.Left)
	}
	near(g.Left.RequestsFull, t0.Add(time.Minute), "the rate full again after ten")

	// refused for concurrency, the rate and tokens are told as they are
	one := sharedLimiter(t, testFleet(t, srv.Addr, "left:", 0), "k:one", limits.Spec{Rate: limits.Rate{N: 5, Period: time.Hour}, Concurrency: 1})
	held, scope, _ := one.Take(time.Now(), -1)
	if scope != limits.ScopeNone {
		t.Fatal(scope)
	}
	defer one.Done(time.Now(), held, 0)
	if g, scope, _ := one.Take(time.Now(), -1); scope != limits.ScopeConcurrency || !g.Left.Known || g.Left.Requests != 4 {
		t.Errorf("refused by %q with %+v, want concurrency and 4 requests left", scope, g.Left)
	}
}

func TestTheFleetsHeadersCountEveryNode(t *testing.T) {
	srv := redistest.Start(t)
	startRelay(t, fleetBlock(srv.Addr, "local", "fleet-left"))
	other := sharedLimiter(t, testFleet(t, srv.Addr, "fleet-left:", 0), fleet.Tag("k:", "fleet-left-key"), limits.Spec{Rate: limits.Rate{N: 3, Period: time.Minute}})
	if _, scope, _ := other.Take(time.Now(), -1); scope != limits.ScopeNone {
		t.Fatal(scope)
	}
	start := time.Now()
	r := message(t, simpleBody)
	if r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	// one taken by the other node, one by this request: one left
	wantOwnLimits(t, "a fleet's key", r, map[string]limit{"requests": {"3", "1", start.Add(39 * time.Second), time.Now().Add(41 * time.Second)}})
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
