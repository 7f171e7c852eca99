package relay

import (
	"cmp"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"golang.org/x/crypto/bcrypt"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// usageOf asks GET /v1/relay/usage with key (header pairs follow, for a
// client that signs in instead) and decodes the answer.
func usageOf(t *testing.T, ask func(t *testing.T, method, path, key, body string, header ...string) reply, key string, header ...string) usageAnswer {
	t.Helper()
	r := ask(t, http.MethodGet, PathRelayUsage, key, "", header...)
	if r.status != 200 || r.header.Get("Content-Type") != "application/json" || r.header.Get("Cache-Control") != "private, no-store" {
		t.Fatalf("GET %s: %d %v %s", PathRelayUsage, r.status, r.header, r.body)
	}
	var u usageAnswer
	if err := json.Unmarshal(r.body, &u); err != nil {
		t.Fatalf("GET %s: %v: %s", PathRelayUsage, err, r.body)
	}
	return u
}

// TestUsageAnswersOnlyTheKeysOwn spends $1 with key A and $3 with key B
// of one group, on a running Caddy, and asks each for its usage: each sees
// its own name, limits, spend, budgets and degrade state, and nothing of
// the other, nor any secret (its own key, the channel's key, the
// upstream's address, the channels' names). Without a key: the relay's
// 401; another method: 405. Each ask counts against the key's rate as a
// request does (and against nothing else), and reaches no upstream.
func TestUsageAnswersOnlyTheKeysOwn(t *testing.T) {
	var out atomic.Int64
	up := fakeupstream.New(t, meteredAnswer(&out))
	const keyA, keyB = "sk-usage-alpha-0123456789abcdef", "sk-usage-bravo-0123456789abcdef"
	ask := oneConnection(t)
	startRelay(t, degradePricing+
		channelBlock("usage-own-ch", up.URL, "models m-dg-big m-dg-small")+
		"\t\tkey "+keyA+" usage-own {\n\t\t\tname usage-alpha\n\t\t\trate 10/m\n\t\t\tbudget 10usd/day\n\t\t\tbudget_degrade 5% cheaper\n\t\t}\n"+
		"\t\tkey "+keyB+" usage-own {\n\t\t\tname usage-bravo\n\t\t\tbudget 20usd/month\n\t\t\tbudget 50usd/total\n\t\t}\n"+
		"\t\tgroup usage-own {\n\t\t\tchannels usage-own-ch\n\t\t\tbudget_degrade 50% model m-dg-small\n\t\t}\n")
	out.Store(100)
	if r := ask(t, http.MethodPost, "/v1/messages", keyA, degradeBody); r.status != 200 { // $1
		t.Fatalf("A's message: %d %s", r.status, r.body)
	}
	out.Store(300)
	if r := ask(t, http.MethodPost, "/v1/messages", keyB, degradeBody); r.status != 200 { // $3
		t.Fatalf("B's message: %d %s", r.status, r.body)
	}
	hits := up.Hits()

	// four asks: each counts against A's rate of 10 a minute
	var a usageAnswer
	for range 4 {
		a = usageOf(t, ask, keyA)
	}
	if a.Kind != "key" || a.Name != "usage-alpha" || a.Group != "usage-own" || a.Identity != "" {
		t.Errorf("A is %s", show(a))
	}
	if a.Limits.Rate != "10/m" || a.Limits.RateRemaining == nil || *a.Limits.RateRemaining != 5 {
		t.Errorf("A's limits: %s; want rate 10/m with 5 left (its message spent one, its four usage asks four)", show(a.Limits))
	}
	if a.SpendUSD["day"] != 1 || a.SpendUSD["month"] != 1 || len(a.SpendUSD) != 3 || a.Holds.Requests != 0 || a.Holds.USD != 0 {
		t.Errorf("A's spend and holds: %s", show(a))
	}
	if len(a.Budgets) != 1 || a.Budgets[0] != (usageBudget{Scope: "key", Period: "day", LimitUSD: 10, SpentUSD: 1, RemainingUSD: 9, PeriodEnd: a.Budgets[0].PeriodEnd}) ||
		a.Budgets[0].PeriodEnd.IsZero() || a.BudgetRemainingUSD == nil || *a.BudgetRemainingUSD != 9 {
		t.Errorf("A's budgets: %s", show(a))
	}
	if d := a.Degrade; len(d.Steps) != 1 || d.Steps[0] != (BudgetDegrade{Percent: 5, Mode: "cheaper"}) || d.UsedPercent == nil || *d.UsedPercent != 10 || !d.Cheaper || d.Model != "" {
		t.Errorf("A's degrade (its own steps, at 10%% of its budget): %s", show(a.Degrade))
	}
	if a.Sessions == nil || len(a.Sessions) != 0 {
		t.Errorf("A's sessions: %v, want an empty list", a.Sessions)
	}

	b := usageOf(t, ask, keyB)
	if b.Name != "usage-bravo" || b.SpendUSD["month"] != 3 || b.SpendUSD["total"] != 3 || len(b.Budgets) != 2 ||
		b.BudgetRemainingUSD == nil || *b.BudgetRemainingUSD != 17 || b.Limits.Rate != "" || b.Limits.RateRemaining != nil {
		t.Errorf("B: %s", show(b))
	}
	if d := b.Degrade; len(d.Steps) != 1 || d.Steps[0].Model != "m-dg-small" || d.Cheaper || d.Model != "" || *d.UsedPercent != 15 {
		t.Errorf("B's degrade (its group's steps, at 15%% of its tightest budget): %s", show(b.Degrade))
	}

	raw := func(key string) string { return string(ask(t, http.MethodGet, PathRelayUsage, key, "").body) }
	for who, body := range map[string]string{"A": raw(keyA), "B": raw(keyB)} {
		for _, secret := range []string{keyA, keyB, channelKey, up.URL, strings.TrimPrefix(up.URL, "http://"), "usage-own-ch"} {
			if strings.Contains(body, secret) {
				t.Errorf("%s's usage holds %q: %s", who, secret, body)
			}
		}
	}
	if body := raw(keyA); strings.Contains(body, "usage-bravo") || strings.Contains(body, `"total"`) {
		t.Errorf("A's usage tells of B: %s", body)
	}
	if body := raw(keyB); strings.Contains(body, "usage-alpha") || strings.Contains(body, "10/m") {
		t.Errorf("B's usage tells of A: %s", body)
	}

	wantRelayError(t, ask(t, http.MethodGet, PathRelayUsage, "", ""), 401, "authentication_error", "")
	wantRelayError(t, ask(t, http.MethodGet, PathRelayUsage, "sk-usage-nobody-0123456789abcdef", ""), 401, "authentication_error", "")
	r := ask(t, http.MethodPost, PathRelayUsage, keyA, "{}")
	wantRelayError(t, r, 405, "invalid_request_error", "")
	if r.header.Get("Allow") != "GET" {
		t.Errorf("405 allows %q, want GET", r.header.Get("Allow"))
	}
	if up.Hits() != hits {
		t.Errorf("asking for usage reached the upstream %d times", up.Hits()-hits)
	}
	// A's rate has room left for a message
	if r := ask(t, http.MethodPost, "/v1/messages", keyA, degradeBody); r.status != 200 {
		t.Errorf("A's second message after its usage asks: %d %s", r.status, r.body)
	}
}

// TestUsageAnswersOnlyTheIdentitysOwn signs in alice, bob (both served by
// user *, each with a budget of its own) and carol (an entry of her own)
// through basic_auth on a running Caddy: each usage answer is the
// identity's own, and names no other identity.
func TestUsageAnswersOnlyTheIdentitysOwn(t *testing.T) {
	var out atomic.Int64
	up := fakeupstream.New(t, meteredAnswer(&out))
	hash, err := bcrypt.GenerateFromPassword([]byte("right-password"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	var accounts string
	for _, u := range []string{"alice-us", "bob-us", "carol-us"} {
		accounts += "\t\t" + u + " " + string(hash) + "\n"
	}
	site := "\t@signin header Authorization \"Basic *\"\n\tbasic_auth @signin {\n" + accounts + "\t}\n"
	ask := oneConnection(t)
	startRelayWith(t, site,
		degradePricing+
			"\t\tidentity {http.auth.user.id}\n"+
			"\t\tuser carol-us usage-ids {\n\t\t\tbudget 7usd/week\n\t\t}\n"+
			"\t\tuser * usage-ids {\n\t\t\tbudget 10usd/day\n\t\t\ttokens 100000/h\n\t\t}\n"+
			channelBlock("usage-ids-ch", up.URL, "models m-dg-big")+
			"\t\tgroup usage-ids {\n\t\t\tchannels usage-ids-ch\n\t\t}\n")
	signIn := func(user string) []string {
		return []string{"Authorization", "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":right-password"))}
	}
	for user, tokens := range map[string]int64{"alice-us": 100, "bob-us": 200, "carol-us": 300} { // $1, $2, $3
		out.Store(tokens)
		if r := ask(t, http.MethodPost, "/v1/messages", "", degradeBody, signIn(user)...); r.status != 200 {
			t.Fatalf("%s's message: %d %s", user, r.status, r.body)
		}
	}
	for _, c := range []struct {
		user, name, period string
		spent, left        float64
	}{
		{"alice-us", "user:*", "day", 1, 9},
		{"bob-us", "user:*", "day", 2, 8},
		{"carol-us", "user:carol-us", "week", 3, 4},
	} {
		u := usageOf(t, ask, "", signIn(c.user)...)
		if u.Kind != "user" || u.Name != c.name || u.Identity != c.user || u.SpendUSD[c.period] != c.spent ||
			len(u.Budgets) != 1 || u.Budgets[0].Scope != "user" || u.Budgets[0].Period != c.period || *u.BudgetRemainingUSD != c.left {
			t.Errorf("%s's usage: %s", c.user, show(u))
		}
		body := string(ask(t, http.MethodGet, PathRelayUsage, "", "", signIn(c.user)...).body)
		for _, other := range []string{"alice-us", "bob-us", "carol-us", "right-password", "$2a$"} {
			if other != c.user && strings.Contains(body, other) {
				t.Errorf("%s's usage holds %q: %s", c.user, other, body)
			}
		}
	}
	// a wrong password: basic_auth's 401, before the relay
	if r := ask(t, http.MethodGet, PathRelayUsage, "", "", "Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte("bob-us:wrong"))); r.status != 401 || r.header.Get("X-Relay-Request-Id") != "" {
		t.Errorf("a wrong password: %d %v", r.status, r.header)
	}
}

// TestUsageListsOnlyTheKeysOwnSessions runs a Claude Code session with
// key A and another with key B of one group, each held to a session
// budget: A's usage lists A's session (by its digest, never its id) and
// not B's, and the other way round.
func TestUsageListsOnlyTheKeysOwnSessions(t *testing.T) {
	var out atomic.Int64
	up := fakeupstream.New(t, meteredAnswer(&out))
	const keyA, keyB = "sk-usage-sess-alpha-0123456789abcdef", "sk-usage-sess-bravo-0123456789abcdef"
	const sessA, sessB = "7d9c4d6e-0000-4000-8000-00000000000a", "7d9c4d6e-0000-4000-8000-00000000000b"
	ask := oneConnection(t)
	startRelay(t, degradePricing+
		channelBlock("usage-sess-ch", up.URL, "models m-dg-big m-dg-small")+
		"\t\tkey "+keyA+" usage-sess {\n\t\t\tname usage-sess-alpha\n\t\t}\n"+
		"\t\tkey "+keyB+" usage-sess {\n\t\t\tname usage-sess-bravo\n\t\t}\n"+
		"\t\tgroup usage-sess {\n\t\t\tchannels usage-sess-ch\n\t\t\tsession_budget 50usd/24h\n\t\t}\n")
	out.Store(100)
	for _, c := range []struct{ key, sess string }{{keyA, sessA}, {keyB, sessB}, {keyB, sessB}} {
		if r := ask(t, http.MethodPost, "/v1/messages", c.key, degradeBody, "X-Claude-Code-Session-Id", c.sess); r.status != 200 {
			t.Fatalf("message: %d %s", r.status, r.body)
		}
	}
	for _, c := range []struct {
		key, own, other string
		requests        int64
	}{{keyA, sessA, sessB, 1}, {keyB, sessB, sessA, 2}} {
		u := usageOf(t, ask, c.key)
		if len(u.Sessions) != 1 || u.Sessions[0].Session != sessionDigest(c.own) || u.Sessions[0].Requests != c.requests || u.Sessions[0].BudgetUSD != 50 {
			t.Errorf("%s's sessions: %s; want its own one, %s, with %d requests", u.Name, show(u.Sessions), sessionDigest(c.own), c.requests)
		}
		body := string(ask(t, http.MethodGet, PathRelayUsage, c.key, "").body)
		for _, leak := range []string{c.own, c.other, sessionDigest(c.other)} {
			if strings.Contains(body, leak) {
				t.Errorf("%s's usage holds %q: %s", u.Name, leak, body)
			}
		}
	}
}

// TestUsageIsCountedAgainstTheKeysRate polls GET /v1/relay/usage with key
// A (rate 3/m) on a running Caddy: each ask spends one of its rate, says
// what is left in its answer and its anthropic-ratelimit-* headers, and
// the fourth gets the relay's 429 rate_limit_error with a retry-after, as
// a message over the rate does; A's messages then wait as well. Key B of
// the same group polls and sends as before: A's polling spends A's rate,
// nobody else's.
func TestUsageIsCountedAgainstTheKeysRate(t *testing.T) {
	var out atomic.Int64
	up := fakeupstream.New(t, meteredAnswer(&out))
	const keyA, keyB = "sk-usage-rate-alpha-0123456789abcdef", "sk-usage-rate-bravo-0123456789abcdef"
	ask := oneConnection(t)
	startRelay(t, degradePricing+
		channelBlock("usage-rate-ch", up.URL, "models m-dg-big")+
		"\t\tkey "+keyA+" usage-rate {\n\t\t\tname usage-rate-alpha\n\t\t\trate 3/m\n\t\t}\n"+
		"\t\tkey "+keyB+" usage-rate {\n\t\t\tname usage-rate-bravo\n\t\t\trate 3/m\n\t\t}\n"+
		"\t\tgroup usage-rate {\n\t\t\tchannels usage-rate-ch\n\t\t}\n")
	out.Store(1)
	for i, left := range []int64{2, 1, 0} {
		r := ask(t, http.MethodGet, PathRelayUsage, keyA, "")
		var u usageAnswer
		if err := json.Unmarshal(r.body, &u); r.status != 200 || err != nil {
			t.Fatalf("ask %d: %d %s", i+1, r.status, r.body)
		}
		if u.Limits.RateRemaining == nil || *u.Limits.RateRemaining != left ||
			r.header.Get("Anthropic-Ratelimit-Requests-Remaining") != strconv.FormatInt(left, 10) || r.header.Get("Anthropic-Ratelimit-Requests-Limit") != "3" {
			t.Errorf("ask %d: rate left %s, headers %v; want %d", i+1, show(u.Limits), r.header, left)
		}
	}
	r := ask(t, http.MethodGet, PathRelayUsage, keyA, "")
	wantRelayError(t, r, http.StatusTooManyRequests, "rate_limit_error", "key_rate_limited")
	if s, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || s < 1 || s > 60 {
		t.Errorf("the 429's retry-after: %q", r.header.Get("Retry-After"))
	}
	if !strings.Contains(string(r.body), "rate limit") || strings.Contains(string(r.body), keyA) {
		t.Errorf("the 429's body: %s", r.body)
	}
	hits := up.Hits()
	wantRelayError(t, ask(t, http.MethodPost, "/v1/messages", keyA, degradeBody), http.StatusTooManyRequests, "rate_limit_error", "key_rate_limited")
	if up.Hits() != hits {
		t.Error("A's message over its rate reached the upstream")
	}
	for i := range 2 {
		if u := usageOf(t, ask, keyB); u.Name != "usage-rate-bravo" || *u.Limits.RateRemaining != int64(2-i) {
			t.Errorf("B's ask %d: %s", i+1, show(u))
		}
	}
	if r := ask(t, http.MethodPost, "/v1/messages", keyB, degradeBody); r.status != 200 {
		t.Errorf("B's message after A's polling: %d %s", r.status, r.body)
	}
}

// usagePage asks for a page of the key's usage (query, such as
// "limit=7&after_id=...") and decodes it.
func usagePage(t *testing.T, ask func(t *testing.T, method, path, key, body string, header ...string) reply, key, query string) usageAnswer {
	t.Helper()
	r := ask(t, http.MethodGet, PathRelayUsage+"?"+query, key, "")
	var u usageAnswer
	if err := json.Unmarshal(r.body, &u); r.status != 200 || err != nil {
		t.Fatalf("GET %s?%s: %d %s", PathRelayUsage, query, r.status, r.body)
	}
	return u
}

// TestUsagePagesSessionsNewestFirst runs 250 Claude Code sessions of one
// key, one after the other, on a running Caddy: its usage lists them
// newest first, 100 at most a page (fewer with limit), each page saying
// whether more follow and where it ends, so that following last_id with
// after_id walks every session once, and first_id with before_id walks
// back. A limit out of 1 to 100, a cursor that is not one, or both
// cursors at once are 400s.
func TestUsagePagesSessionsNewestFirst(t *testing.T) {
	var out atomic.Int64
	up := fakeupstream.New(t, meteredAnswer(&out))
	const key = "sk-usage-pages-0123456789abcdef"
	ask := oneConnection(t)
	startRelay(t, degradePricing+
		channelBlock("usage-pages-ch", up.URL, "models m-dg-big")+
		"\t\tkey "+key+" usage-pages {\n\t\t\tname usage-pages\n\t\t}\n"+
		"\t\tgroup usage-pages {\n\t\t\tchannels usage-pages-ch\n\t\t\tsession_budget 50usd/24h\n\t\t}\n")
	out.Store(1)
	const sessions = 250
	newest := make([]string, sessions) // the digests, newest first
	for i := range sessions {
		sid := fmt.Sprintf("5e551a00-0000-4000-8000-%012d", i)
		if r := ask(t, http.MethodPost, "/v1/messages", key, degradeBody, "X-Claude-Code-Session-Id", sid); r.status != 200 {
			t.Fatalf("session %d: %d %s", i, r.status, r.body)
		}
		newest[sessions-1-i] = sessionDigest(sid)
	}
	digests := func(u usageAnswer) []string {
		var d []string
		for _, s := range u.Sessions {
			d = append(d, s.Session)
		}
		return d
	}

	var seen []string
	query := ""
	for page := 1; ; page++ {
		u := usagePage(t, ask, key, query)
		want := newest[len(seen):min(len(seen)+maxUsageSessions, sessions)]
		if !slices.Equal(digests(u), want) || u.FirstID == nil || u.LastID == nil || u.HasMore != (len(seen)+len(want) < sessions) {
			t.Fatalf("page %d: %d sessions %v..., has_more %v, first_id %v, last_id %v; want %d from %s", page, len(u.Sessions), digests(u)[:min(3, len(u.Sessions))], u.HasMore, u.FirstID, u.LastID, len(want), want[0])
		}
		seen = append(seen, digests(u)...)
		if !u.HasMore {
			break
		}
		if page == 2 { // and back: the page before page 2 is page 1
			back := usagePage(t, ask, key, "before_id="+*u.FirstID)
			if !slices.Equal(digests(back), newest[:maxUsageSessions]) || back.HasMore {
				t.Errorf("before page 2: %d sessions from %v, has_more %v; want page 1 and no more", len(back.Sessions), back.FirstID, back.HasMore)
			}
		}
		query = "after_id=" + *u.LastID
	}
	if !slices.Equal(seen, newest) {
		t.Errorf("the pages listed %d sessions, want each of the %d once, newest first", len(seen), sessions)
	}

	u := usagePage(t, ask, key, "limit=7")
	if !slices.Equal(digests(u), newest[:7]) || !u.HasMore {
		t.Errorf("limit=7: %v, has_more %v", digests(u), u.HasMore)
	}
	u = usagePage(t, ask, key, "limit=7&after_id="+*u.LastID)
	if !slices.Equal(digests(u), newest[7:14]) {
		t.Errorf("the next 7: %v, want %v", digests(u), newest[7:14])
	}
	for _, bad := range []string{"limit=0", "limit=101", "limit=many", "after_id=sess_nothing", "after_id=" + newest[0], "before_id=%00", "after_id=" + *u.LastID + "&before_id=" + *u.FirstID} {
		wantRelayError(t, ask(t, http.MethodGet, PathRelayUsage+"?"+bad, key, ""), http.StatusBadRequest, "invalid_request_error", "")
	}
}

// BenchmarkUsageWith1000Sessions is one GET /v1/relay/usage of a key with
// 1,000 live sessions, the most a principal keeps in a group: the whole
// path of the call on the relay (its key found, its rate counted, its
// budgets read, its page of sessions built and written).
func BenchmarkUsageWith1000Sessions(b *testing.B) {
	const name = "bench-usage"
	r := &Relay{
		Keys: []*Key{{Secret: "sk-" + name, Group: name, KeyOptions: KeyOptions{Name: name, Rate: "1000000000/s",
			SessionLimits: SessionLimits{SessionBudget: "1000000usd/24h"}}}},
		Channels: []*Channel{{Name: name, UpstreamRaw: upstream("mock")}},
		Groups:   []*Group{{Name: name, Channels: []string{name}}},
	}
	provisionHandler(b, r)
	srv := &caddyhttp.Server{}
	serve := func(req *http.Request) int {
		w := &discardWriter{h: http.Header{}}
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, srv)
		if err := r.ServeHTTP(w, req, nil); err != nil {
			b.Fatal(err)
		}
		return cmp.Or(w.status, http.StatusOK)
	}
	for i := range maxSessions {
		req := newRequest(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "sk-"+name)
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("X-Claude-Code-Session-Id", fmt.Sprintf("bench-usage-session-%04d", i))
		if code := serve(req); code != http.StatusOK {
			b.Fatalf("session %d: %d", i, code)
		}
	}
	if n := len(r.sessionsOf(name)); n != maxSessions {
		b.Fatalf("%d live sessions, want %d", n, maxSessions)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		req := httptest.NewRequest(http.MethodGet, PathRelayUsage, nil)
		req.Header.Set("X-Api-Key", "sk-"+name)
		if code := serve(req); code != http.StatusOK {
			b.Fatalf("usage: %d", code)
		}
	}
}
