package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-relay/relay/internal/redistest"
)

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
		address 10.0.0.1:6379 10.0.0.2:6379
		username relay
		password {env.REDIS_PASSWORD}
		prefix team-a:
		timeout 20ms
		on_error deny
		lease 5s
		tls {
			server_name redis.internal
		}
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	s := r.Fleet.Redis
	if strings.Join(s.Address, ",") != "10.0.0.1:6379,10.0.0.2:6379" || s.Username != "relay" || s.Password != "{env.REDIS_PASSWORD}" ||
		s.Prefix != "team-a:" || time.Duration(s.Timeout) != 20*time.Millisecond || s.OnError != "deny" ||
		time.Duration(s.Lease) != 5*time.Second || s.TLS == nil || s.TLS.ServerName != "redis.internal" {
		t.Fatalf("parsed %+v", s)
	}

	for src, want := range map[string]string{
		"storage memcached":                                  `storage "memcached" is not known`,
		"storage redis {\n\t\ton_error maybe\n\t}":           `on_error must be local or deny`,
		"storage redis {\n\t\taddress localhost\n\t}":        `not host:port`,
		"storage redis {\n\t\tpool 10\n\t}":                  `unrecognized storage redis option "pool"`,
		"storage redis {\n\t\ttls {\n\t\t\tca x\n\t\t}\n\t}": `unrecognized storage redis tls option "ca"`,
		"storage redis\n\tstorage redis":                     `storage is given twice`,
		"storage redis {\n\t\ttimeout -1s\n\t}":              `must not be negative`,
	} {
		if _, err := parseRelay(t, "relay {\n\t"+src+"\n}"); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want %q", src, err, want)
		}
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
	other := sharedLimiter(t, testFleet(t, srv.Addr, "fleet-rate:", 0), tag("k:", "fleet-rate-key"), limits{rate: rateSpec{n: 3, period: time.Minute}})
	for range 2 {
		if _, scope, _ := other.take(time.Now(), -1); scope != scopeNone {
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
	r.fleet.logger.Store(zap.New(core))
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
		return r.fleet.breaker.State() == gobreaker.StateOpen
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
		return r.fleet.up.Load()
	})
	if n := logs.FilterMessageSnippet("storage reachable again").Len(); n != 1 {
		for _, e := range logs.All() {
			t.Logf("%s %v", e.Message, e.ContextMap())
		}
		t.Fatalf("%d lines say the storage is back, want 1", n)
	}
}

// quietFleet is a test fleet whose first heartbeat, which it sends as it
// starts, has answered: for two seconds nothing of its own succeeds
// between a test's operations, so the failures a test makes in a row are
// the breaker's failures in a row.
func quietFleet(t *testing.T, addr, prefix string) *fleet {
	f := testFleet(t, addr, prefix, 0)
	waitFor(t, "the fleet's first heartbeat", 2*time.Second, func() bool { return f.nodesUp.Load() > 0 })
	return f
}

// heldOperation starts an operation through run that has begun (it
// returns once it has) and answers, successfully, when release is closed;
// its outcome comes on slow.
func heldOperation(run func(string, func(context.Context) error) error) (release chan struct{}, slow chan error) {
	started := make(chan struct{})
	release, slow = make(chan struct{}), make(chan error, 1)
	go func() {
		slow <- run("renew", func(context.Context) error {
			close(started)
			<-release
			return nil
		})
	}()
	<-started
	return release, slow
}

// TestAnOperationThatAnswersWhileTheBreakerIsOpenDoesNotEndTheOutage: an
// operation begun after Redis was found unreachable, but before the
// breaker opened, that answers while it is open (a background one waits
// longer than the requests' time) does not say Redis is back: the
// operations after it would still be refused by the breaker and start a
// second outage. The breaker's probe ends the outage, with one line.
func TestAnOperationThatAnswersWhileTheBreakerIsOpenDoesNotEndTheOutage(t *testing.T) {
	srv := redistest.Start(t)
	f := quietFleet(t, srv.Addr, "straddle:")
	core, logs := observer.New(zapcore.InfoLevel)
	f.logger.Store(zap.New(core))
	fail := errors.New("no answer")
	if err := f.do("admit", func(context.Context) error { return fail }); err == nil || f.up.Load() {
		t.Fatalf("a failed operation: %v, up %v; want failed and down", err, f.up.Load())
	}
	release, slow := heldOperation(f.background)
	for range 2 { // with the first, three failures: the breaker opens
		_ = f.do("admit", func(context.Context) error { return fail })
	}
	if st := f.breaker.State(); st != gobreaker.StateOpen {
		t.Fatalf("after 3 failures the breaker is %v, want open", st)
	}
	close(release)
	if err := <-slow; err != nil {
		t.Fatalf("the operation begun before the breaker opened: %v", err)
	}
	if f.up.Load() || logs.FilterMessageSnippet("storage reachable again").Len() != 0 {
		t.Fatal("an operation that answered while the breaker was open ended the outage")
	}
	waitFor(t, "the breaker lets an operation try", 3*time.Second, func() bool { return f.breaker.State() == gobreaker.StateHalfOpen })
	if err := f.do("admit", func(context.Context) error { return nil }); err != nil || !f.up.Load() {
		t.Fatalf("the breaker's probe answered (err %v): up %v, want true", err, f.up.Load())
	}
	if n, m := logs.FilterMessageSnippet("storage unreachable").Len(), logs.FilterMessageSnippet("storage reachable again").Len(); n != 1 || m != 1 {
		t.Fatalf("%d lines say the storage is unreachable and %d that it is back, want 1 and 1", n, m)
	}
}

// TestASlowAnswerOnARequestsPathIsNotAnOutage: a request's operation that
// runs out of its time fails that request, and is counted, but neither
// opens the breaker nor declares Redis unreachable, however many in a
// row: on a saturated machine Redis answers late without being gone.
// Operations off the requests' paths that run out of theirs, which are
// longer, do both; then a request's operation fails at once, without
// being tried.
func TestASlowAnswerOnARequestsPathIsNotAnOutage(t *testing.T) {
	srv := redistest.Start(t)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	f, err := newFleet(ctx, &FleetRedis{Address: []string{srv.Addr}, Prefix: "slow:", Timeout: caddy.Duration(20 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Destruct() })
	if f.backgroundTimeout != 200*time.Millisecond {
		t.Fatalf("operations off the requests' paths wait %v, want 10 times the timeout", f.backgroundTimeout)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	f.logger.Store(zap.New(core))
	late := func(ctx context.Context) error { // Redis answers after the deadline
		<-ctx.Done()
		return ctx.Err()
	}
	errs := metricFleetErrors.WithLabelValues("slow_admit")
	before := testutil.ToFloat64(errs)
	for i := range 5 {
		start := time.Now()
		if err := f.do("slow_admit", late); !errors.Is(err, errFleetDown) {
			t.Fatalf("a late answer: %v, want the storage unavailable", err)
		}
		if took := time.Since(start); took > time.Second {
			t.Fatalf("a request's operation waited %v; its timeout is 20ms", took)
		}
		if st := f.breaker.State(); st != gobreaker.StateClosed || !f.up.Load() {
			t.Fatalf("after %d late answers: breaker %v, up %v; want closed and up", i+1, st, f.up.Load())
		}
	}
	// a late answer in the real client too: Redis frozen for one operation
	srv.Stop()
	err = f.do("slow_admit", func(ctx context.Context) error { return f.client.Get(ctx, "slow:x").Err() })
	srv.Continue()
	if !errors.Is(err, errFleetDown) || f.breaker.State() != gobreaker.StateClosed || !f.up.Load() {
		t.Fatalf("a frozen Redis's late answer: %v, breaker %v, up %v; want a failed request, closed and up", err, f.breaker.State(), f.up.Load())
	}
	if got := testutil.ToFloat64(errs) - before; got != 6 {
		t.Fatalf("relay_storage_errors_total{op=slow_admit} grew by %v, want 6", got)
	}
	if n := logs.FilterMessageSnippet("storage unreachable").Len(); n != 0 {
		t.Fatalf("%d lines say the storage is unreachable after late answers", n)
	}
	if err := f.do("slow_admit", func(ctx context.Context) error { return f.client.Get(ctx, "slow:x").Err() }); err != nil {
		t.Fatalf("Redis answered again: %v", err)
	}

	for range 3 { // what runs off the requests' paths finds Redis gone
		start := time.Now()
		if err := f.background("slow_renew", late); !errors.Is(err, errFleetDown) {
			t.Fatalf("a late answer off the requests' paths: %v", err)
		}
		if took := time.Since(start); took < 200*time.Millisecond {
			t.Fatalf("an operation off the requests' paths gave up after %v, want its longer timeout", took)
		}
	}
	if st := f.breaker.State(); st != gobreaker.StateOpen || f.up.Load() {
		t.Fatalf("after 3 late answers off the requests' paths: breaker %v, up %v; want open and down", st, f.up.Load())
	}
	if n := logs.FilterMessageSnippet("storage unreachable").Len(); n != 1 {
		t.Fatalf("%d lines say the storage is unreachable, want 1", n)
	}
	tried := false
	if err := f.do("slow_admit", func(context.Context) error { tried = true; return nil }); !errors.Is(err, errFleetDown) || tried {
		t.Fatalf("with the breaker open a request's operation: %v, tried %v; want failed at once", err, tried)
	}
}

func TestFleetRouteListsTheNodes(t *testing.T) {
	// without storage, the fleet is this node
	startRelay(t, "\t\tkey "+clientKey+" solo-g\n\t\tchannel solo-ch {\n\t\t\tprovider mock\n\t\t}\n\t\tgroup solo-g {\n\t\t\tchannels solo-ch\n\t\t}\n")
	nodes := fleetNodes(t)
	if len(nodes) != 1 || nodes[0].ID != thisNode().ID || nodes[0].State != "up" || nodes[0].Version == "" ||
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
		case thisNode().ID:
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

func TestModuleVersion(t *testing.T) {
	const module = "github.com/caddy-relay/relay"
	vcs := []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "true"}}
	for _, tt := range []struct {
		name string
		bi   *debug.BuildInfo
		want string
	}{
		{"no build info", nil, "(devel)"},
		{"a dependency (xcaddy)", &debug.BuildInfo{Main: debug.Module{Path: "caddy", Version: "(devel)"},
			Deps: []*debug.Module{{Path: module, Version: "v1.4.0"}}, Settings: vcs}, "v1.4.0"},
		{"a dependency replaced", &debug.BuildInfo{Deps: []*debug.Module{{Path: module, Version: "v1.4.0", Replace: &debug.Module{Path: "../relay", Version: ""}}}}, "v1.4.0"},
		{"the main module, stamped", &debug.BuildInfo{Main: debug.Module{Path: module, Version: "v1.5.0"}}, "v1.5.0"},
		{"the main module, its commit", &debug.BuildInfo{Main: debug.Module{Path: module, Version: "(devel)"}, Settings: vcs}, "0123456789ab+dirty"},
		{"go run", &debug.BuildInfo{Main: debug.Module{Path: module, Version: "(devel)"}}, "(devel)"},
	} {
		if got := moduleVersion(tt.bi); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

func fleetNodes(t *testing.T) []fleetNode {
	t.Helper()
	resp, err := client.Get(adminURL + "/relay/fleet")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var nodes []fleetNode
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

// TestAnOperationBegunBeforeAnOutageDoesNotEndIt: an operation that began
// while Redis was up and answers after the relay said it is unreachable
// (its breaker opened meanwhile) says nothing of now: the relay stays down,
// with one line, until an operation begun since answers.
func TestAnOperationBegunBeforeAnOutageDoesNotEndIt(t *testing.T) {
	srv := redistest.Start(t)
	f := quietFleet(t, srv.Addr, "flap:")
	core, logs := observer.New(zapcore.InfoLevel)
	f.logger.Store(zap.New(core))
	release, slow := heldOperation(f.do)
	fail := errors.New("no answer")
	for range 3 { // the breaker opens
		if err := f.do("admit", func(context.Context) error { return fail }); err == nil {
			t.Fatal("a failed operation succeeded")
		}
	}
	if f.up.Load() || f.breaker.State() != gobreaker.StateOpen {
		t.Fatalf("after 3 failures: up %v, breaker %v; want down and open", f.up.Load(), f.breaker.State())
	}
	close(release)
	if err := <-slow; err != nil {
		t.Fatalf("the operation begun before the outage: %v", err)
	}
	if f.up.Load() {
		t.Fatal("an operation begun before the outage ended it")
	}
	if n := logs.FilterMessageSnippet("storage reachable again").Len(); n != 0 {
		t.Fatalf("%d lines say the storage is back while its breaker is open", n)
	}
	waitFor(t, "the breaker lets an operation try", 3*time.Second, func() bool { return f.breaker.State() == gobreaker.StateHalfOpen })
	if err := f.do("renew", func(context.Context) error { return nil }); err != nil || !f.up.Load() {
		t.Fatalf("an operation begun since the outage answered (err %v): up %v, want true", err, f.up.Load())
	}
	if n := logs.FilterMessageSnippet("storage unreachable").Len(); n != 1 {
		t.Fatalf("%d lines say the storage is unreachable, want 1", n)
	}
	if n := logs.FilterMessageSnippet("storage reachable again").Len(); n != 1 {
		t.Fatalf("%d lines say the storage is back, want 1", n)
	}
}
