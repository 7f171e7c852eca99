package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-relay/relay/internal/redistest"
)

// TestCaddyfileFleet checks that the relay block reads `storage` into
// its Fleet, once; internal/fleet tests the block's options.
func TestCaddyfileFleet(t *testing.T) {
	r, err := parseRelay(t, `relay {
	key sk-test-0123456789abcdef g
	channel a {
		provider mock
	}
	group g {
		channels a
	}
	storage redis {
		address 10.0.0.1:6379
		prefix team-a:
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	if s := r.Fleet.Redis; strings.Join(s.Address, ",") != "10.0.0.1:6379" || s.Prefix != "team-a:" {
		t.Fatalf("parsed %+v", s)
	}
	src := "storage redis\n\tstorage redis"
	if _, err := parseRelay(t, "relay {\n\t"+src+"\n}"); err == nil || !strings.Contains(err.Error(), "storage is given twice") {
		t.Errorf("%q: error %v, want %q", src, err, "storage is given twice")
	}
	src = "storage memcached"
	if _, err := parseRelay(t, "relay {\n\t"+src+"\n}"); err == nil || !strings.Contains(err.Error(), `storage "memcached" is not known`) {
		t.Errorf("%q: error %v, want the storage's own error", src, err)
	}
}

// fleetBlock is a relay block whose state is in the Redis at addr, with
// a key limited to rate 3/m and a mock channel.
func fleetBlock(addr, onError, name string) string {
	return fmt.Sprintf(`		storage redis {
			address %s
			prefix %s:
			timeout 50ms
			on_error %s
		}
		key %s %s-g {
			name %s-key
			rate 3/m
		}
		channel %s-ch {
			provider mock
		}
		group %s-g {
			channels %s-ch
		}
`, addr, name, onError, clientKey, name, name, name, name, name)
}

func TestTheFleetSharesAKeysRate(t *testing.T) {
	srv := redistest.Start(t)
	startRelay(t, fleetBlock(srv.Addr, "local", "fleet-rate"))
	// another node of the fleet spent two of the key's three requests
	other := sharedLimiter(t, testFleet(t, srv.Addr, "fleet-rate:", 0), fleet.Tag("k:", "fleet-rate-key"), limits.Spec{Rate: limits.Rate{N: 3, Period: time.Minute}})
	for range 2 {
		if _, scope, _ := other.Take(time.Now(), -1); scope != limits.ScopeNone {
			t.Fatal(scope)
		}
	}
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("third request: %d %s", r.status, r.body)
	}
	r := message(t, simpleBody)
	wantRelayError(t, r, 429, "rate_limit_error", "key_rate_limited")
	mf, _ := scrape(t)
	if v := value(mf, "relay_storage_up"); v != 1 {
		t.Fatalf("relay_storage_up = %v, want 1", v)
	}
	if v := value(mf, "relay_storage_seconds", "op=admit"); v < 2 {
		t.Fatalf("relay_storage_seconds{op=admit} counted %v operations, want 2", v)
	}
}

func TestRedisDownServesOnLocalState(t *testing.T) {
	srv := redistest.Start(t)
	addr := srv.Addr
	srv.Kill() // nothing listens there: Redis is down from the start
	startRelay(t, fleetBlock(addr, "local", "fleet-down"))
	// the key's own limit still holds, on this node alone
	for i := range 4 {
		r := message(t, simpleBody)
		if want := 200; i == 3 {
			wantRelayError(t, r, 429, "rate_limit_error", "key_rate_limited")
		} else if r.status != want {
			t.Fatalf("request %d with Redis down: %d %s", i+1, r.status, r.body)
		}
	}
	mf, _ := scrape(t)
	if v := value(mf, "relay_storage_up"); v != 0 {
		t.Fatalf("relay_storage_up = %v, want 0", v)
	}
	if v := value(mf, "relay_storage_errors_total", "op=admit"); v < 1 {
		t.Fatalf("relay_storage_errors_total{op=admit} = %v", v)
	}
	// the fleet's nodes cannot be listed without Redis
	resp, err := client.Get(adminURL + "/relay/fleet")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(b), "did not answer") {
		t.Fatalf("GET /relay/fleet with Redis down: %d %s", resp.StatusCode, b)
	}
}

func TestRedisDownWithOnErrorDenyAnswers503(t *testing.T) {
	srv := redistest.Start(t)
	addr := srv.Addr
	srv.Kill()
	startRelay(t, fleetBlock(addr, "deny", "fleet-deny"))
	r := message(t, simpleBody)
	wantRelayError(t, r, 503, "relay_error", "storage_unavailable")
	if r.header.Get("Retry-After") == "" {
		t.Error("no retry-after")
	}
	mf, _ := scrape(t)
	if v := value(mf, "relay_requests_total", "code=503", "cause=relay"); v < 1 {
		t.Fatalf("relay_requests_total{code=503,cause=relay} = %v", v)
	}
}

// TestAFrozenRedisCostsNoMoreThanTheTimeout freezes Redis (SIGSTOP, as a
// partition: connections open, no answer): no request waits on it for
// longer than the timeout, the outage is logged once, and when Redis
// answers again the node says so once and shares again.
func TestAFrozenRedisCostsNoMoreThanTheTimeout(t *testing.T) {
	srv := redistest.Start(t)
	// a concurrency limit too small to lease in blocks (one relay up: a
	// block of 5 slots): every request asks Redis
	r := &Relay{
		Fleet:    &Fleet{Redis: &FleetRedis{Address: []string{srv.Addr}, Prefix: "frozen:", Timeout: caddy.Duration(50 * time.Millisecond)}},
		Keys:     []*Key{{Secret: "sk-frozen-0123456789abcdef", Group: "frozen-g", KeyOptions: KeyOptions{Concurrency: 50}}},
		Channels: []*Channel{{Name: "frozen-ch", UpstreamRaw: upstream("mock", "latency", "0s")}},
		Groups:   []*Group{{Name: "frozen-g", Channels: []string{"frozen-ch"}}},
	}
	provisionHandler(t, r)
	core, logs := observer.New(zapcore.InfoLevel)
	r.fleet.SetLogger(zap.New(core))
	serve := func() time.Duration {
		t.Helper()
		start := time.Now()
		w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-frozen-0123456789abcdef"))
		if w.Code != 200 {
			t.Fatalf("status %d: %s", w.Code, w.Body)
		}
		return time.Since(start)
	}
	serve() // warm: connections made
	srv.Stop()
	defer srv.Continue()
	// a late answer on a request's path is not an outage: the heartbeat
	// (every 2s, waiting up to 500ms) finds Redis gone; after that, three
	// late answers open the breaker, and requests no longer wait
	var slowest time.Duration
	waitFor(t, "the breaker opens", 6*time.Second, func() bool {
		slowest = max(slowest, serve())
		return r.fleet.BreakerState() == gobreaker.StateOpen
	})
	// the timeout, plus what the race detector and a noisy machine add
	if slowest > 50*time.Millisecond+150*time.Millisecond {
		t.Fatalf("a request took %v with Redis frozen; the timeout is 50ms", slowest)
	}
	if n := logs.FilterMessageSnippet("storage unreachable").Len(); n != 1 {
		t.Fatalf("%d lines say the storage is unreachable, want 1", n)
	}
	srv.Continue()
	waitFor(t, "the node rejoins", 5*time.Second, func() bool {
		serve()
		return r.fleet.Up()
	})
	if n := logs.FilterMessageSnippet("storage reachable again").Len(); n != 1 {
		for _, e := range logs.All() {
			t.Logf("%s %v", e.Message, e.ContextMap())
		}
		t.Fatalf("%d lines say the storage is back, want 1", n)
	}
}

func TestFleetRouteListsTheNodes(t *testing.T) {
	// without storage, the fleet is this node
	startRelay(t, "\t\tkey "+clientKey+" solo-g\n\t\tchannel solo-ch {\n\t\t\tprovider mock\n\t\t}\n\t\tgroup solo-g {\n\t\t\tchannels solo-ch\n\t\t}\n")
	nodes := fleetNodes(t)
	if len(nodes) != 1 || nodes[0].ID != fleet.ThisNode().ID || nodes[0].State != "up" || nodes[0].Version == "" ||
		!nodes[0].Self || !strings.HasSuffix(nodes[0].Address, ":9080") {
		t.Fatalf("nodes %+v; want this node alone, self, at its listen port 9080", nodes)
	}

	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	now, _ := rdb.Time(ctx).Result()
	// a node last seen a minute ago
	rdb.ZAdd(ctx, "fleet-list:{nodes}:seen", redis.Z{Score: float64(now.Add(-time.Minute).UnixMilli()), Member: "old-node"})
	rdb.HSet(ctx, "fleet-list:{nodes}:info", "old-node", `{"id":"old-node","address":"10.0.0.9","version":"v0.9.0"}`)
	startRelay(t, fleetBlock(srv.Addr, "local", "fleet-list"))
	waitFor(t, "this node's heartbeat", 2*time.Second, func() bool { return len(fleetNodes(t)) == 2 })
	for _, n := range fleetNodes(t) {
		switch n.ID {
		case fleet.ThisNode().ID:
			if n.State != "up" || !strings.HasSuffix(n.Address, ":9080") || !n.Self || time.Since(n.LastSeen) > 5*time.Second {
				t.Errorf("this node: %+v", n)
			}
		case "old-node":
			if n.State != "gone" || n.Address != "10.0.0.9" || n.Version != "v0.9.0" || n.Self {
				t.Errorf("the old node: %+v", n)
			}
		default:
			t.Errorf("unknown node %+v", n)
		}
	}
	// the password and the prefix's keys never show in the admin API
	resp, err := client.Post(adminURL+"/relay/fleet", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 || resp.Header.Get("Allow") != "GET" {
		t.Fatalf("POST /relay/fleet: %d Allow %q", resp.StatusCode, resp.Header.Get("Allow"))
	}
}

func fleetNodes(t *testing.T) []fleet.Node {
	t.Helper()
	resp, err := client.Get(adminURL + "/relay/fleet")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var nodes []fleet.Node
	if err := json.NewDecoder(resp.Body).Decode(&nodes); err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /relay/fleet: %d %v", resp.StatusCode, err)
	}
	return nodes
}

func TestThePasswordStaysAPlaceholder(t *testing.T) {
	srv := redistest.Start(t)
	t.Setenv("RELAY_TEST_REDIS_PASSWORD", "s3cret-redis-password")
	if reply, err := srv.Command("CONFIG", "SET", "requirepass", "s3cret-redis-password"); err != nil || reply != "+OK" {
		t.Fatalf("requirepass: %q %v", reply, err)
	}
	startRelay(t, strings.Replace(fleetBlock(srv.Addr, "deny", "fleet-pass"), "prefix", "password {env.RELAY_TEST_REDIS_PASSWORD}\n\t\t\tprefix", 1))
	// it authenticates (with on_error deny, a wrong password would be a 503)
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	resp, err := client.Get(adminURL + "/config/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Contains(string(b), "s3cret") || !strings.Contains(string(b), "{env.RELAY_TEST_REDIS_PASSWORD}") {
		t.Fatalf("GET /config/ shows the password or lost its placeholder:\n%s", b)
	}
}

// TestReloadsWithAFleetLeakNothing reloads a config with a fleet 50 times,
// each with other Redis options (a new connection each time), and
// counts goroutines and Redis connections before and after.
func TestReloadsWithAFleetLeakNothing(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	// the connections to Redis, and of them those subscribed: a fleet
	// left running keeps its subscriptions (health, signatures), while
	// the pool of the fleet in use may hold a few more idle connections
	// after 50 reloads than after one, as its background work overlapped
	// requests on a loaded machine
	clients := func() (all, subscribed int) {
		list, _ := rdb.ClientList(context.Background()).Result()
		for _, l := range strings.Split(strings.TrimSpace(list), "\n") {
			all++
			for _, f := range strings.Fields(l) {
				if v, ok := strings.CutPrefix(f, "sub="); ok && v != "0" {
					subscribed++
				}
			}
		}
		return all, subscribed
	}
	load := func(tester *caddytest.Tester, i int) {
		block := strings.Replace(fleetBlock(srv.Addr, "local", "fleet-reload"), "timeout 50ms", fmt.Sprintf("timeout %dms", 50+i%2), 1)
		block = strings.Replace(block, "rate 3/m", "rate 1000/m", 1)
		tester.InitServer(testGlobal+"http://localhost:9080 {\n\trelay {\n"+block+"\n\t}\n}\n", "caddyfile")
		client.CloseIdleConnections() // the old server closed them
	}
	tester := caddytest.NewTester(t)
	load(tester, 0)
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatal(r.status)
	}
	baseGoroutines := runtime.NumGoroutine()
	baseClients, baseSubscribed := clients()
	if baseSubscribed == 0 {
		t.Fatal("no connection to Redis is subscribed: the count cannot tell a fleet left running")
	}
	for i := 1; i <= 50; i++ {
		load(tester, i)
		if r := message(t, simpleBody); r.status != 200 { // through Redis: its own connection
			t.Fatal(r.status)
		}
	}
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatal(r.status)
	}
	var g, c, sub int
	defer func() { // what leaked, when something did
		if t.Failed() {
			var stacks bytes.Buffer
			_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
			t.Logf("after 50 reloads: %d goroutines (%d after the first config), %d Redis clients (%d), %d subscribed (%d); goroutines:\n%s",
				g, baseGoroutines, c, baseClients, sub, baseSubscribed, stacks.String())
		}
	}()
	waitFor(t, "goroutines and connections back to what one config uses", 5*time.Second, func() bool {
		g = runtime.NumGoroutine()
		c, sub = clients()
		return g <= baseGoroutines+5 && sub <= baseSubscribed && c <= baseClients+4
	})
}

// testFleet connects to the Redis at addr as one node of a fleet whose
// keys start with prefix; each call is another node (its own client,
// leases and background work).
func testFleet(t testing.TB, addr, prefix string, lease time.Duration) *member {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	f, err := newFleet(ctx, &FleetRedis{Address: []string{addr}, Prefix: prefix, Lease: caddy.Duration(lease), Timeout: caddy.Duration(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Destruct() })
	return f
}

// sharedLimiter is a limiter kept in fleet f under thing.
func sharedLimiter(t *testing.T, f *member, thing string, spec limits.Spec) *limits.Limiter {
	t.Helper()
	l := new(limits.Limiter)
	l.Configure(spec, time.Now())
	l.Share(f.limits, thing)
	if !l.InFleet() {
		t.Fatal("the limiter is not shared")
	}
	return l
}
