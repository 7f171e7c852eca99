package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/memtest"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// endUserBody is a message from the end user id.
func endUserBody(id string) string {
	return `{"model":"claude-sonnet-4-5","max_tokens":16,"metadata":{"user_id":` + fmt.Sprintf("%q", id) + `},"messages":[{"role":"user","content":"Hi"}]}`
}

func TestEndUsersOfAKeyHaveTheirOwnRate(t *testing.T) {
	r, clock := limitRelay(t, "eurate", Key{KeyOptions: KeyOptions{UserRate: "2/m"}}, "")
	send := func(body string) *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(body, "sk-eurate"))
		return w
	}
	for i := range 2 {
		if w := send(endUserBody("u1")); w.Code != 200 {
			t.Fatalf("u1, request %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	w := send(endUserBody("u1"))
	wantLimited(t, w, "user_rate_limited")
	if ra := w.Header().Get("Retry-After"); ra != "30" {
		t.Errorf("retry-after %q, want 30 (one request every 30s)", ra)
	}
	if strings.Contains(w.Body.String(), "u1") || !strings.Contains(w.Body.String(), "user_rate") {
		t.Errorf("the message should name the limit, never the client's id: %s", w.Body)
	}
	// another end user, and requests that name none, are not held by u1's
	for _, body := range []string{endUserBody("u2"), endUserBody("u2"), simpleBody, simpleBody, simpleBody} {
		if w := send(body); w.Code != 200 {
			t.Fatalf("%s: %d %s", body, w.Code, w.Body)
		}
	}
	clock.advance(30 * time.Second)
	if w := send(endUserBody("u1")); w.Code != 200 {
		t.Errorf("u1 after 30s: %d", w.Code)
	}
	if w := send(endUserBody("u1")); w.Code != 429 {
		t.Errorf("u1, and only one: %d", w.Code)
	}
}

func TestEndUsersOfAKeyHaveTheirOwnTokens(t *testing.T) {
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m", "x", fakeupstream.Usage{InputTokens: 10, OutputTokens: 600}))
	}))
	r, clock := limitRelay(t, "eutok", Key{KeyOptions: KeyOptions{UserTokens: "1000/m"}}, up.URL)
	send := func(id string) *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(endUserBody(id), "sk-eutok"))
		return w
	}
	// 1000 -> 390 -> -220: the second request puts u1 in debt
	for i := range 2 {
		if w := send("u1"); w.Code != 200 {
			t.Fatalf("request %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	w := send("u1")
	wantLimited(t, w, "user_rate_limited")
	if !strings.Contains(w.Body.String(), "user_tokens") {
		t.Errorf("the message should say user_tokens: %s", w.Body)
	}
	if w := send("u2"); w.Code != 200 {
		t.Errorf("u2: %d", w.Code)
	}
	clock.advance(14 * time.Second) // 221 tokens at 1000/60s
	if w := send("u1"); w.Code != 200 {
		t.Errorf("u1 after 14s: %d", w.Code)
	}
	if up.Hits() != 4 {
		t.Errorf("refused requests must not reach the upstream: %d hits", up.Hits())
	}
}

func TestEndUserLimitsAreCountedPerIdentity(t *testing.T) {
	r, _ := identityRelay(t, "eui", &User{ID: "*", Group: "eui-free", KeyOptions: KeyOptions{UserRate: "1/m"}})
	labels := gatherLabelValues(t, func() {
		for _, who := range []string{"bob-eui", "carol-eui"} {
			if w, _, _ := serveAs(t, r, who, "", endUserBody("same-end-user-eui")); w.Code != 200 {
				t.Fatalf("%s: %d", who, w.Code)
			}
			w, _, _ := serveAs(t, r, who, "", endUserBody("same-end-user-eui"))
			wantLimited(t, w, "user_rate_limited")
		}
	})
	for v := range labels {
		if strings.Contains(v, "same-end-user") || strings.Contains(v, "bob") {
			t.Errorf("a metric label holds a client's id: %q", v)
		}
	}
	if !labels["user:*"] || !labels["user_rate"] {
		t.Errorf("relay_rate_limited_total should count key=user:*, scope=user_rate: %v", labels)
	}
}

// gatherLabelValues runs f and returns every label value of the relay's
// metrics afterwards.
func gatherLabelValues(t *testing.T, f func()) map[string]bool {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := registerMetrics(reg); err != nil {
		t.Fatal(err)
	}
	f()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			for _, l := range m.Label {
				out[l.GetValue()] = true
			}
		}
	}
	return out
}

// TestAMillionEndUsersStayBounded is a hostile client of one key that
// names a new end user in every request: the limiters kept never number
// more than the cap, and the memory they hold stays bounded.
func TestAMillionEndUsersStayBounded(t *testing.T) {
	r, clock := limitRelay(t, "eumany", Key{KeyOptions: KeyOptions{UserRate: "5/m", UserTokens: "10000/m"}}, "")
	k := r.keys[digestOf("sk-eumany")]
	r.activate(k)  // as its first request does
	n := 1_000_000 // a hundred times the cap
	if testing.Short() || memtest.Race {
		n = 20 * maxEndUsers
	}
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	most := 0
	for i := range n {
		in := &inbound{route: routeMessages, who: requester{key: k, state: k.state, stateID: k.stateID}, ask: asked{estimate: 10, userID: fmt.Sprintf("hostile-%d-%s", i, strings.Repeat("x", i%200))}}
		if rerr := r.admitEndUser(in); rerr != nil {
			t.Fatalf("end user %d refused: %s", i, rerr.msg)
		}
		in.grant.endUser.Done(clock.now(), in.grant.endUserGrant, 10)
		if i%1000 == 0 {
			clock.advance(time.Millisecond)
		}
		most = max(most, k.state.endUsers.Load().Len())
	}
	if most > maxEndUsers {
		t.Fatalf("%d end user limiters kept at once, the cap is %d", most, maxEndUsers)
	}
	if most < maxEndUsers {
		t.Fatalf("at most %d kept: the test did not reach the cap", most)
	}
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	// about 1KB a limiter with its key; a million would be a gigabyte
	grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("heap grew by %d KiB", grew>>10)
	if grew > 64<<20 {
		t.Errorf("the heap grew by %d MiB for %d end users", grew>>20, n)
	}
	k.state.endUsers.Load().Each(func(id string, _ *limits.Limiter) {
		if len(id) > len(k.stateID)+1+maxIDLen {
			t.Fatalf("an end user is kept under %d bytes: ids must be bounded", len(id))
		}
	})
}

func digestOf(s string) [32]byte {
	d, _, _ := keyDigest(s)
	return d
}

func TestBoundedID(t *testing.T) {
	short := "user_0123"
	if boundedID(short) != short {
		t.Errorf("a short id is kept as it is")
	}
	long := strings.Repeat("a", 10_000)
	b := boundedID(long)
	if len(b) > maxIDLen || b != boundedID(long) || b == boundedID(long+"b") {
		t.Errorf("a long id must become a short, stable digest of it: %q", b)
	}
	// a client may send a digest as its id: it is never kept as itself
	if got := boundedID(b); got == b || !strings.HasPrefix(got, sha256Prefix) || len(got) > maxIDLen {
		t.Errorf("the id %q, spelled as a digest, is kept as %q: it must be a digest of its own", b, got)
	}
	if got := boundedID("sha256:x"); got == "sha256:x" {
		t.Errorf("a short id that looks like a digest is kept as it is")
	}
}

// TestAnIdSpelledAsAnothersDigestIsNotThatOne: a client that picks its
// identity, or its metadata.user_id, sends the digest under which a long id
// of another is kept; it must get limits of its own, not share the other's.
func TestAnIdSpelledAsAnothersDigestIsNotThatOne(t *testing.T) {
	victim := "victim-" + strings.Repeat("v", 100) // kept as its digest
	spelled := boundedID(victim)

	t.Run("identity", func(t *testing.T) {
		r, _ := identityRelay(t, "digid", &User{ID: "*", Group: "digid-free", KeyOptions: KeyOptions{Rate: "1/m"}})
		if w, _, _ := serveAs(t, r, victim, "", simpleBody); w.Code != 200 {
			t.Fatalf("the victim: %d %s", w.Code, w.Body)
		}
		if w, _, _ := serveAs(t, r, spelled, "", simpleBody); w.Code != 200 {
			t.Errorf("an identity spelled as the victim's digest shares its rate: %d %s", w.Code, w.Body)
		}
		if w, _, _ := serveAs(t, r, victim, "", simpleBody); w.Code != 429 {
			t.Errorf("the victim's own second request in the minute: %d, want 429", w.Code)
		}
	})
	t.Run("end user", func(t *testing.T) {
		r, _ := limitRelay(t, "digeu", Key{KeyOptions: KeyOptions{UserRate: "1/m"}}, "")
		send := func(id string) *httptest.ResponseRecorder {
			w, _ := serveHandler(t, r, newRequest(endUserBody(id), "sk-digeu"))
			return w
		}
		if w := send(victim); w.Code != 200 {
			t.Fatalf("the victim: %d %s", w.Code, w.Body)
		}
		if w := send(spelled); w.Code != 200 {
			t.Errorf("a metadata.user_id spelled as the victim's digest shares its rate: %d %s", w.Code, w.Body)
		}
		wantLimited(t, send(victim), "user_rate_limited")
	})
}

func TestALoadWithoutEndUserLimitsForgetsThem(t *testing.T) {
	r, _ := limitRelay(t, "euforget", Key{KeyOptions: KeyOptions{UserRate: "1/m"}}, "")
	if w, _ := serveHandler(t, r, newRequest(endUserBody("u1"), "sk-euforget")); w.Code != 200 {
		t.Fatal(w.Code)
	}
	st := r.keys[digestOf("sk-euforget")].state
	if st.endUsers.Load().Len() != 1 {
		t.Fatal("u1 is not kept")
	}
	st.configureEndUsers(stateSpec{}, time.Now())
	if st.endUsers.Load() != nil {
		t.Error("a key without end user limits keeps its end users")
	}
}

// TestEndUsersAndIdentitiesShareLimitsInAFleet runs two nodes' states
// against one Redis: an end user's and an identity's limits hold across
// them, and what an end user leaves in Redis expires and names no client.
func TestEndUsersAndIdentitiesShareLimitsInAFleet(t *testing.T) {
	srv := redistest.Start(t)
	now := time.Now()
	var nodes []*keyState
	for range 2 {
		f := testFleet(t, srv.Addr, "eu:", 0)
		st := newKeyState()
		st.configureEndUsers(stateSpec{limits: limits.Spec{Rate: limits.Rate{N: 3, Period: time.Minute}}, fleet: f}, now)
		st.configureIdentities(stateSpec{limits: limits.Spec{Rate: limits.Rate{N: 2, Period: time.Minute}}, fleet: f}, now)
		nodes = append(nodes, st)
	}
	admitted := 0
	for i := range 8 {
		l := nodes[i%2].endUser("user:bob\x00end-user-secret-id", now)
		if g, scope, _ := l.Take(now, -1); scope == limits.ScopeNone {
			admitted++
			l.Done(now, g, 0)
		}
	}
	if admitted != 3 {
		t.Errorf("one end user was admitted %d times across two nodes, want 3 (user_rate 3/m)", admitted)
	}
	admitted = 0
	for i := range 6 {
		l := nodes[i%2].identity("bob-fleet", now).limits
		if g, scope, _ := l.Take(now, -1); scope == limits.ScopeNone {
			admitted++
			l.Done(now, g, 0)
		}
	}
	if admitted != 2 {
		t.Errorf("one identity was admitted %d times across two nodes, want 2 (rate 2/m)", admitted)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "eu:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	var sawIdentity bool
	keys = slices.DeleteFunc(keys, func(k string) bool { return strings.HasPrefix(k, "eu:{nodes}") }) // heartbeats
	for _, k := range keys {
		if strings.Contains(k, "end-user-secret-id") {
			t.Errorf("redis key %q holds the client's user_id", k)
		}
		sawIdentity = sawIdentity || k == "eu:{u:bob-fleet}:rate"
		if ttl, err := rdb.PTTL(ctx, k).Result(); err != nil || ttl <= 0 {
			t.Errorf("redis key %q does not expire (pttl %v, %v)", k, ttl, err)
		}
	}
	if len(keys) != 2 || !sawIdentity {
		t.Errorf("redis keys %v, want an end user's rate and {u:bob-fleet}'s", keys)
	}
}

// admitOps counts the admissions the relay has asked Redis for so far.
func admitOps(t testing.TB) float64 {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := register(reg, fleet.Collectors()); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		byName[mf.GetName()] = mf
	}
	return math.Max(0, value(byName, "relay_storage_seconds", "op=admit"))
}

// TestAFleetAdmitsAnEndUserWithItsChannel runs requests whose key, end
// user and channel all have limits that a fleet keeps: each takes one
// round trip to Redis before its attempt (the key's, the end user's and
// the channel's limits together, with the first channel), and a request
// one of them refuses takes nothing from the others.
func TestAFleetAdmitsAnEndUserWithItsChannel(t *testing.T) {
	srv := redistest.Start(t)
	r := &Relay{
		Fleet: &Fleet{Redis: &FleetRedis{Address: []string{srv.Addr}, Prefix: "pair:"}},
		Keys: []*Key{{Secret: "sk-pair-0123456789abcdef", Group: "pair-g",
			KeyOptions: KeyOptions{Name: "pair-key", Rate: "1000/m", UserRate: "2/m"}}},
		Channels: []*Channel{{Name: "pair-ch", UpstreamRaw: upstream("mock"), Rate: "3/m"}},
		Groups:   []*Group{{Name: "pair-g", Channels: []string{"pair-ch"}}},
	}
	provisionHandler(t, r)
	send := func(user string) *httptest.ResponseRecorder {
		t.Helper()
		body := `{"model":"m","max_tokens":8,"metadata":{"user_id":"` + user + `"},"messages":[{"role":"user","content":"hi"}]}`
		w, _ := serveHandler(t, r, newRequest(body, "sk-pair-0123456789abcdef"))
		return w
	}
	before := admitOps(t)
	for i := range 2 {
		if w := send("alice-pair"); w.Code != 200 {
			t.Fatalf("alice's request %d: %d %s", i+1, w.Code, w.Body)
		}
	}
	if ops := admitOps(t) - before; ops != 2 {
		t.Errorf("two requests asked Redis %v times before their attempts, want 2 (one each)", ops)
	}
	// alice is over her user_rate: refused, and the channel's rate keeps
	// its third request for bob
	if w := send("alice-pair"); w.Code != 429 || !strings.Contains(w.Body.String(), `"code":"user_rate_limited"`) {
		t.Fatalf("alice's third request: %d %s", w.Code, w.Body)
	}
	if w := send("bob-pair"); w.Code != 200 {
		t.Fatalf("bob's request, the channel's third of 3/m: %d %s", w.Code, w.Body)
	}
}

// An id that a store would change (invalid UTF-8, which the spend store's
// JSON rewrites, so that a persisted identity's spend came back under
// another id) or refuse (a control character: Postgres takes no NUL in
// text) is kept as its digest; a plain id, Unicode included, as it is.
func TestBoundedIDOfIdsAStoreWouldChange(t *testing.T) {
	for _, id := range []string{"bob\xff", "\xc3", "a\x00b", "tab\tx", "del\x7f"} {
		if got := boundedID(id); !strings.HasPrefix(got, sha256Prefix) {
			t.Errorf("%q is kept as %q, not as its digest", id, got)
		}
		b, err := json.Marshal(map[string]int{userStateID(id): 1})
		if err != nil {
			t.Fatal(err)
		}
		var back map[string]int
		if err := json.Unmarshal(b, &back); err != nil || back[userStateID(id)] != 1 {
			t.Errorf("the state id of %q does not come back from the spend store's JSON: %s", id, b)
		}
	}
	for _, id := range []string{"alice@example.com", "ユーザー", "user_1 (ops)", "\ufffd"} {
		if got := boundedID(id); got != id {
			t.Errorf("the plain id %q is kept as %q", id, got)
		}
	}
}

func TestALimiterIsSettledOnceItWouldBeNew(t *testing.T) {
	l := new(limits.Limiter)
	l.Configure(limits.Spec{Rate: limits.Rate{N: 2, Period: time.Minute}, Tokens: limits.Rate{N: 1000, Period: time.Minute}}, testNow)
	if !l.Settled(testNow) {
		t.Fatal("a new limiter is settled")
	}
	g, scope, _ := l.Take(testNow, 100)
	if scope != limits.ScopeNone {
		t.Fatal(scope)
	}
	if l.Settled(testNow) {
		t.Error("a limiter with a request in flight is not settled")
	}
	l.Done(testNow, g, 1600) // 600 tokens in debt
	if l.Settled(testNow.Add(time.Minute)) {
		t.Error("a limiter whose token bucket is still refilling is not settled")
	}
	if !l.Settled(testNow.Add(97 * time.Second)) {
		t.Error("1600 tokens at 1000/m are back after 96s")
	}
}
