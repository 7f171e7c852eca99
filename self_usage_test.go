package relay

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

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
// 401; another method: 405. Asking spends none of the key's rate limit and
// reaches no upstream.
func TestUsageAnswersOnlyTheKeysOwn(t *testing.T) {
	var out atomic.Int64
	up := fakeupstream.New(t, meteredAnswer(&out))
	const keyA, keyB = "sk-usage-alpha-0123456789abcdef", "sk-usage-bravo-0123456789abcdef"
	ask := oneConnection(t)
	startRelay(t, degradePricing+
		channelBlock("usage-own-ch", up.URL, "models m-dg-big m-dg-small")+
		"\t\tkey "+keyA+" usage-own {\n\t\t\tname usage-alpha\n\t\t\trate 2/m\n\t\t\tbudget 10usd/day\n\t\t\tbudget_degrade 5% cheaper\n\t\t}\n"+
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

	// more asks than A's rate of 2 a minute: none is refused, none spends it
	var a usageAnswer
	for range 4 {
		a = usageOf(t, ask, keyA)
	}
	if a.Kind != "key" || a.Name != "usage-alpha" || a.Group != "usage-own" || a.Identity != "" {
		t.Errorf("A is %s", show(a))
	}
	if a.Limits.Rate != "2/m" || a.Limits.RateRemaining == nil || *a.Limits.RateRemaining != 1 {
		t.Errorf("A's limits: %s; want rate 2/m with 1 left (its message spent one, its usage asks none)", show(a.Limits))
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
	if body := raw(keyB); strings.Contains(body, "usage-alpha") || strings.Contains(body, "2/m") {
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
	// A's one request left of its rate is still there
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
