package main

// A fleet as users run it: several relay processes (the built binary) that
// share one real redis-server, behind no load balancer but the test itself,
// which spreads requests over the nodes.

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

const fleetKey = "sk-fleet-client-0123456789abcdef"

// fleetNode is one relay process of a test's fleet.
type fleetNode struct {
	site, admin string // host:port
	stop        func() // kills the process (SIGKILL)
}

// fleetConfig is the Caddyfile of one node: storage in the Redis at
// redisAddr, key `app` with keyOpts, and the channels (name -> url, in
// priority order) in one group.
type fleetConfig struct {
	redisAddr string
	prefix    string
	storage   string            // more storage options
	keyOpts   string            // options of the key
	channels  []string          // name=url, first is priority 1, next 2...
	channel   string            // more options of every channel
	options   map[string]string // more options of the channel of that name
	extra     string            // more lines of the relay block
	group     string            // more options of the group
	sameTier  bool              // every channel is of priority 1
}

func (c fleetConfig) caddyfile(site, admin string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "{\n\tadmin %s\n\tgrace_period 1ns\n}\nhttp://%s {\n\trelay {\n", admin, site)
	fmt.Fprintf(&b, "\t\tstorage redis {\n\t\t\taddress %s\n\t\t\tprefix %s\n%s\t\t}\n", c.redisAddr, c.prefix, c.storage)
	fmt.Fprintf(&b, "\t\tkey %s fleet {\n\t\t\tname app\n%s\t\t}\n%s", fleetKey, c.keyOpts, c.extra)
	var names []string
	for i, ch := range c.channels {
		name, url, _ := strings.Cut(ch, "=")
		names = append(names, name)
		prio := i + 1
		if c.sameTier {
			prio = 1
		}
		fmt.Fprintf(&b, "\t\tchannel %s {\n\t\t\turl %s\n\t\t\tapi_key %s\n\t\t\tpriority %d\n%s%s\t\t}\n", name, url, fakeupstream.Key, prio, c.channel, c.options[name])
	}
	fmt.Fprintf(&b, "\t\tgroup fleet {\n\t\t\tchannels %s\n\t\t\tretries 2\n%s\t\t}\n\t}\n}\n", strings.Join(names, " "), c.group)
	return b.String()
}

// startFleet starts n relay processes with the config.
func startFleet(t *testing.T, n int, c fleetConfig) []*fleetNode {
	t.Helper()
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	nodes := make([]*fleetNode, n)
	for i := range nodes {
		nodes[i] = startNode(t, c)
	}
	return nodes
}

func startNode(t *testing.T, c fleetConfig) *fleetNode {
	t.Helper()
	site, admin := freePort(t), freePort(t)
	file := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(file, []byte(c.caddyfile(site, admin)), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := runCaddy(t, caddyBin, file)
	return &fleetNode{site: site, admin: admin, stop: func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }}
}

var fleetClient = &http.Client{Timeout: 30 * time.Second}

// send sends one small message to the node and returns the status.
func (n *fleetNode) send(t *testing.T) int {
	t.Helper()
	status, _ := n.sendBody(t)
	return status
}

func (n *fleetNode) sendBody(t *testing.T) (int, string) {
	t.Helper()
	return n.sendAs(t, fleetKey)
}

// sendAs sends one small message with key and returns the status and body.
func (n *fleetNode) sendAs(t *testing.T, key string) (int, string) {
	t.Helper()
	status, body, err := n.attempt(key)
	if err != nil {
		t.Errorf("request to %s: %v", n.site, err)
	}
	return status, body
}

// attempt sends one small message with key.
func (n *fleetNode) attempt(key string) (int, string, error) {
	return n.attemptBody(key, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
}

// channel is the node's view of one channel, from GET /relay/channels.
func (n *fleetNode) channel(t *testing.T, name string) map[string]any {
	t.Helper()
	resp, err := fleetClient.Get("http://" + n.admin + "/relay/channels")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r["name"] == name {
			return r
		}
	}
	t.Fatalf("node %s has no channel %q", n.site, name)
	return nil
}

func (n *fleetNode) post(t *testing.T, path string) {
	t.Helper()
	resp, err := fleetClient.Post("http://"+n.admin+path, "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("POST %s: %d", path, resp.StatusCode)
	}
}

// within polls cond until it holds, failing after bound.
func within(t *testing.T, what string, bound time.Duration, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > bound {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Since(start)
}

func TestFleetSharesAKeysRate(t *testing.T) {
	srv := redistest.Start(t)
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	nodes := startFleet(t, 3, fleetConfig{redisAddr: srv.Addr, prefix: "rate:", keyOpts: "\t\t\trate 30/m\n", channels: []string{"up=" + up.URL}})
	counts := map[int]int{}
	for i := range 60 {
		counts[nodes[i%3].send(t)]++
	}
	if counts[200] < 29 || counts[200] > 31 || counts[200]+counts[429] != 60 {
		t.Fatalf("answers %v to 60 requests over 3 nodes with rate 30/m, want 30 (±1) 200s, the rest 429", counts)
	}
	if hits := up.Hits(); hits != counts[200] {
		t.Fatalf("the upstream saw %d requests, %d were admitted", hits, counts[200])
	}
}

func TestFleetSharesACooldown(t *testing.T) {
	srv := redistest.Start(t)
	primary := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	fallback := fakeupstream.New(t, fakeupstream.Message("from the fallback"))
	nodes := startFleet(t, 3, fleetConfig{redisAddr: srv.Addr, prefix: "cool:", storage: "",
		channels: []string{"primary=" + primary.URL, "fallback=" + fallback.URL}, channel: "\t\t\tcooldown 30s\n"})

	// a 529 on node 1: it fails over, and cools the primary
	if status := nodes[0].send(t); status != 200 || primary.Hits() != 1 || fallback.Hits() != 1 {
		t.Fatalf("node 1: status %d, primary hit %d times, fallback %d", status, primary.Hits(), fallback.Hits())
	}
	// nodes 2 and 3 know it within 250ms...
	for _, n := range nodes[1:] {
		took := within(t, "the cooldown reaches node "+n.site, 250*time.Millisecond, func() bool {
			return n.channel(t, "primary")["state"] == "cooldown"
		})
		t.Logf("node %s saw the cooldown after %v", n.site, took)
	}
	// ...and go straight to the fallback
	for _, n := range nodes[1:] {
		if status := n.send(t); status != 200 {
			t.Fatalf("node %s: %d", n.site, status)
		}
	}
	if primary.Hits() != 1 || fallback.Hits() != 3 {
		t.Fatalf("primary hit %d times, fallback %d: the other nodes did not skip the cooling channel", primary.Hits(), fallback.Hits())
	}
	// why, on every node
	if r := nodes[2].channel(t, "primary"); r["last_error"] != "overloaded" {
		t.Fatalf("node 3's view of the primary: %v", r)
	}
}

// TestFleetSharesAClassCooldown: an Opus 429 on one node cools Opus on
// that channel for the whole fleet, and only Opus: every node still sends
// Sonnet there.
func TestFleetSharesAClassCooldown(t *testing.T) {
	srv := redistest.Start(t)
	opus := `{"model":"claude-opus-4-1","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	sonnet := `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	var primaryOpus, primarySonnet atomic.Int64
	limited := fakeupstream.Error(429, "rate_limit_error", "rate limited", "Retry-After", "60")
	served := fakeupstream.Message("from the primary")
	primary := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if strings.Contains(string(b), `"claude-opus-4-1"`) {
			primaryOpus.Add(1)
			limited(w, r)
			return
		}
		primarySonnet.Add(1)
		served(w, r)
	}))
	fallback := fakeupstream.New(t, fakeupstream.Message("from the fallback"))
	nodes := startFleet(t, 2, fleetConfig{redisAddr: srv.Addr, prefix: "class:",
		channels: []string{"primary=" + primary.URL, "fallback=" + fallback.URL}})

	// an Opus 429 on node 1: it fails over, and cools Opus on the primary
	if status, body, err := nodes[0].attemptBody(fleetKey, opus); err != nil || status != 200 || !strings.Contains(body, "from the fallback") {
		t.Fatalf("node 1, opus: %d %s %v", status, body, err)
	}
	// node 2 knows it within 250ms...
	took := within(t, "the class cooldown reaches node 2", 250*time.Millisecond, func() bool {
		classes, _ := nodes[1].channel(t, "primary")["classes"].(map[string]any)
		return classes["opus"] != nil
	})
	t.Logf("node 2 saw the class cooldown after %v", took)
	row := nodes[1].channel(t, "primary")
	opusRow, _ := row["classes"].(map[string]any)["opus"].(map[string]any)
	until, err := time.Parse(time.RFC3339Nano, fmt.Sprint(opusRow["until"]))
	if row["state"] != "cooldown" || opusRow["state"] != "cooldown" || err != nil || time.Until(until) < 55*time.Second ||
		!strings.HasPrefix(fmt.Sprint(opusRow["reason"]), "status 429 (seen by ") || len(row["classes"].(map[string]any)) != 1 {
		t.Fatalf("node 2's view of the primary: %v", row)
	}
	// ...skips the primary for Opus, and still sends it Sonnet
	if status, body, _ := nodes[1].attemptBody(fleetKey, opus); status != 200 || !strings.Contains(body, "from the fallback") {
		t.Fatalf("node 2, opus: %d %s", status, body)
	}
	if status, body, _ := nodes[1].attemptBody(fleetKey, sonnet); status != 200 || !strings.Contains(body, "from the primary") {
		t.Fatalf("node 2, sonnet: %d %s", status, body)
	}
	if primaryOpus.Load() != 1 || primarySonnet.Load() != 1 || fallback.Hits() != 2 {
		t.Fatalf("the primary saw opus %d times and sonnet %d, the fallback %d requests", primaryOpus.Load(), primarySonnet.Load(), fallback.Hits())
	}
	// and its gauge says so
	resp, err := fleetClient.Get("http://" + nodes[1].admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	metrics, _ := io.ReadAll(resp.Body)
	var left float64
	for line := range strings.Lines(string(metrics)) {
		if rest, ok := strings.CutPrefix(line, `relay_channel_class_cooling{channel="primary",class="opus"} `); ok {
			left, _ = strconv.ParseFloat(strings.TrimSpace(rest), 64)
		}
	}
	if left < 55 || left > 60 {
		t.Errorf("node 2's relay_channel_class_cooling{channel=primary,class=opus} = %v, want about 60", left)
	}
}

func TestFleetDisableAppliesEverywhere(t *testing.T) {
	srv := redistest.Start(t)
	primary := fakeupstream.New(t, fakeupstream.Message("primary"))
	fallback := fakeupstream.New(t, fakeupstream.Message("fallback"))
	nodes := startFleet(t, 3, fleetConfig{redisAddr: srv.Addr, prefix: "disable:", channels: []string{"primary=" + primary.URL, "fallback=" + fallback.URL}})

	nodes[0].post(t, "/relay/channels/primary/disable")
	for _, n := range nodes {
		within(t, "disabled on node "+n.site, 250*time.Millisecond, func() bool { return n.channel(t, "primary")["state"] == "disabled" })
	}
	for _, n := range nodes {
		n.send(t)
	}
	if primary.Hits() != 0 || fallback.Hits() != 3 {
		t.Fatalf("primary hit %d times while disabled, fallback %d", primary.Hits(), fallback.Hits())
	}
	// a node that joins later learns it from Redis
	late := startNode(t, fleetConfig{redisAddr: srv.Addr, prefix: "disable:", channels: []string{"primary=" + primary.URL, "fallback=" + fallback.URL}})
	within(t, "disabled on the late node", 2*time.Second, func() bool { return late.channel(t, "primary")["state"] == "disabled" })

	nodes[2].post(t, "/relay/channels/primary/enable")
	for _, n := range append(nodes, late) {
		within(t, "enabled on node "+n.site, 250*time.Millisecond, func() bool { return n.channel(t, "primary")["state"] == "healthy" })
	}
	nodes[1].send(t)
	if primary.Hits() != 1 {
		t.Fatalf("primary hit %d times once enabled, want 1", primary.Hits())
	}
}

// concurrencyProbe is an upstream that holds each request until released
// and records the most requests it held at once.
type concurrencyProbe struct {
	held, most atomic.Int64
	release    chan struct{}
}

func (p *concurrencyProbe) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := p.held.Add(1)
	for cur := p.most.Load(); n > cur && !p.most.CompareAndSwap(cur, n); cur = p.most.Load() {
	}
	select {
	case <-p.release:
	case <-r.Context().Done():
	}
	p.held.Add(-1)
	fakeupstream.Message("held")(w, r)
}

func TestFleetKeyConcurrencyHoldsAcrossNodes(t *testing.T) {
	srv := redistest.Start(t)
	probe := &concurrencyProbe{release: make(chan struct{})}
	up := fakeupstream.New(t, probe)
	nodes := startFleet(t, 3, fleetConfig{redisAddr: srv.Addr, prefix: "conc:", keyOpts: "\t\t\tconcurrency 2\n", channels: []string{"up=" + up.URL}})

	var wg sync.WaitGroup
	var answered atomic.Int32
	statuses := make([]int, 12)
	for i := range statuses {
		wg.Go(func() { statuses[i] = nodes[i%3].send(t); answered.Add(1) })
	}
	within(t, "two requests at the upstream", 5*time.Second, func() bool { return probe.held.Load() == 2 })
	// the other ten are answered while the two are held: none reached it
	within(t, "the other ten answered", 5*time.Second, func() bool { return answered.Load() == 10 })
	close(probe.release)
	wg.Wait()
	counts := map[int]int{}
	for _, s := range statuses {
		counts[s]++
	}
	if probe.most.Load() != 2 || counts[200] != 2 || counts[429] != 10 {
		t.Fatalf("at most %d at the upstream, answers %v: want 2 at once, 2 served and 10 refused", probe.most.Load(), counts)
	}
}

func TestFleetFreesTheSlotsOfAKilledNode(t *testing.T) {
	srv := redistest.Start(t)
	probe := &concurrencyProbe{release: make(chan struct{})}
	defer close(probe.release)
	up := fakeupstream.New(t, probe)
	const lease = 2 * time.Second
	cfg := fleetConfig{redisAddr: srv.Addr, prefix: "kill:", storage: "\t\t\tlease 2s\n", keyOpts: "\t\t\tconcurrency 2\n", channels: []string{"up=" + up.URL}}
	nodes := startFleet(t, 2, cfg)

	// node 1 holds both slots, then dies (its clients see the connection
	// drop)
	for range 2 {
		go func() { _, _, _ = nodes[0].attempt(fleetKey) }()
	}
	within(t, "node 1 holds both slots", 5*time.Second, func() bool { return probe.held.Load() == 2 })
	time.Sleep(lease) // well past a renewal: the slots are renewed while node 1 lives
	if status := nodes[1].send(t); status != 429 {
		t.Fatalf("node 2 while node 1 holds both slots: %d, want 429", status)
	}
	nodes[0].stop()
	killed := time.Now()
	within(t, "node 2 gets a slot", lease+time.Second, func() bool {
		status := make(chan int, 1)
		go func() { s, _, _ := nodes[1].attempt(fleetKey); status <- s }()
		select {
		case s := <-status:
			return s == 200
		case <-time.After(200 * time.Millisecond): // admitted: held at the upstream
			return true
		}
	})
	if took := time.Since(killed); took > lease+500*time.Millisecond {
		t.Fatalf("the killed node's slots were free %v after, the lease is %v", took, lease)
	}
}

// TestFleetRidesOutARedisRestart runs steady load over two nodes while
// Redis is killed and started again: no request fails or waits on Redis
// for longer than its timeout, and once Redis is back the limits are
// shared again.
func TestFleetRidesOutARedisRestart(t *testing.T) {
	srv := redistest.Start(t)
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	const afterKey = "sk-fleet-after-0123456789abcdef"
	cfg := fleetConfig{redisAddr: srv.Addr, prefix: "chaos:", storage: "\t\t\ttimeout 50ms\n", keyOpts: "\t\t\trate 100000/m\n", channels: []string{"up=" + up.URL},
		extra: "\t\tkey " + afterKey + " fleet {\n\t\t\tname after\n\t\t\trate 4/m\n\t\t}\n"}
	nodes := startFleet(t, 2, cfg)

	var failed, served atomic.Int64
	var slowest atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				start := time.Now()
				status, body := nodes[w%2].sendBody(t)
				d := int64(time.Since(start))
				for cur := slowest.Load(); d > cur && !slowest.CompareAndSwap(cur, d); cur = slowest.Load() {
				}
				if status != 200 {
					failed.Add(1)
					t.Errorf("node %d: %d %s", w%2+1, status, body)
				} else {
					served.Add(1)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
	// each phase lasts until the nodes have served a few dozen requests in it
	moreServed := func(what string) {
		t.Helper()
		from := served.Load()
		within(t, what, 10*time.Second, func() bool { return served.Load() >= from+40 })
	}
	bothUp := func(up bool) func() bool {
		return func() bool { return storageUp(t, nodes[0]) == up && storageUp(t, nodes[1]) == up }
	}
	moreServed("load before the outage")
	srv.Kill()
	within(t, "both nodes see Redis gone", 10*time.Second, bothUp(false))
	moreServed("load while Redis is gone")
	srv.Restart()
	within(t, "both nodes back on Redis", 10*time.Second, bothUp(true))
	moreServed("load after Redis is back")
	close(stop)
	wg.Wait()
	if failed.Load() != 0 || served.Load() < 120 {
		t.Fatalf("%d requests failed, %d served", failed.Load(), served.Load())
	}
	// the upstream answers at once: what a request took beyond that is
	// the relay's, and Redis may cost it one timeout at most
	if d := time.Duration(slowest.Load()); d > 50*time.Millisecond+250*time.Millisecond {
		t.Fatalf("the slowest request took %v; Redis's timeout is 50ms", d)
	}
	// the limits are shared again: a key whose rate is 4/m admits 4
	// requests over the two nodes, not 4 each
	ok := 0
	for i := range 8 {
		if status, _ := nodes[i%2].sendAs(t, afterKey); status == 200 {
			ok++
		}
	}
	if ok != 4 {
		t.Fatalf("a key with rate 4/m admitted %d of 8 requests over two nodes after Redis came back, want 4", ok)
	}
}

// storageUp reads relay_storage_up from the node's metrics.
func storageUp(t *testing.T, n *fleetNode) bool {
	t.Helper()
	resp, err := fleetClient.Get("http://" + n.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return strings.Contains(string(b), "\nrelay_storage_up 1\n")
}

func TestFleetListsItsNodes(t *testing.T) {
	srv := redistest.Start(t)
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	nodes := startFleet(t, 3, fleetConfig{redisAddr: srv.Addr, prefix: "list:", channels: []string{"up=" + up.URL}})
	list := func() []map[string]any {
		resp, err := fleetClient.Get("http://" + nodes[1].admin + "/relay/fleet")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			// a Redis round trip that timed out on a loaded machine: 503
			// saying so, and the next look asks again
			b, _ := io.ReadAll(resp.Body)
			t.Logf("GET /relay/fleet: %d %s", resp.StatusCode, b)
			return nil
		}
		var rows []map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
			t.Fatal(err)
		}
		return rows
	}
	within(t, "three nodes up", 5*time.Second, func() bool {
		rows := list()
		up := 0
		for _, r := range rows {
			if r["state"] == "up" && r["id"] != "" && r["version"] != "" && r["address"] != "" && r["last_seen"] != "" {
				up++
			}
		}
		return len(rows) == 3 && up == 3
	})
	// each node gives the port it serves on, and the one asked says so
	ports := map[string]bool{}
	for _, n := range nodes {
		ports[n.site[strings.LastIndex(n.site, ":"):]] = true
	}
	for _, r := range list() {
		addr, _ := r["address"].(string)
		port := addr[max(strings.LastIndex(addr, ":"), 0):]
		if !ports[port] || r["self"] != (port == nodes[1].site[strings.LastIndex(nodes[1].site, ":"):]) {
			t.Errorf("node %v: address %q, self %v; want one of the nodes' ports, self on the node asked (%s)", r["id"], addr, r["self"], nodes[1].site)
		}
		delete(ports, port)
	}
	nodes[2].stop()
	within(t, "the killed node gone", 10*time.Second, func() bool {
		gone := 0
		for _, r := range list() {
			if r["state"] == "gone" {
				gone++
			}
		}
		return gone == 1
	})
}

// TestFleetExampleRunsAsTwoNodes runs examples/fleet.Caddyfile as its
// comment says, twice on one Redis: both relays list each other, and the
// key's 10 requests a minute hold for the two together.
func TestFleetExampleRunsAsTwoNodes(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	srv := redistest.Start(t)
	t.Setenv("REDIS_ADDRESS", srv.Addr)
	var nodes []*fleetNode
	for range 2 {
		site, admin := freePort(t), freePort(t)
		_, sitePort, _ := strings.Cut(site, ":")
		_, adminPort, _ := strings.Cut(admin, ":")
		t.Setenv("SITE", sitePort)
		t.Setenv("ADMIN", adminPort)
		runCaddy(t, caddyBin, "../../examples/fleet.Caddyfile")
		nodes = append(nodes, &fleetNode{site: site, admin: "localhost:" + adminPort})
	}
	within(t, "both relays listed", 5*time.Second, func() bool {
		resp, err := fleetClient.Get("http://" + nodes[0].admin + "/relay/fleet")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var rows []map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&rows)
		return len(rows) == 2 && rows[0]["state"] == "up" && rows[1]["state"] == "up"
	})
	ok, limited := 0, 0
	for i := range 16 {
		req, _ := http.NewRequest(http.MethodPost, "http://"+nodes[i%2].site+"/v1/messages",
			strings.NewReader(`{"model":"claude-haiku-5-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("X-Api-Key", "sk-relay-fleet-demo-key")
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("Content-Type", "application/json")
		resp, err := fleetClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		switch resp.StatusCode {
		case http.StatusOK:
			ok++
		case http.StatusTooManyRequests:
			limited++
		default:
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
	}
	// (an 11th may pass if the requests took over the 6s that earn one)
	if ok < 10 || ok > 11 {
		t.Errorf("16 requests over two relays with a key of 10/m: %d served, %d limited; want 10 served", ok, limited)
	}
}
