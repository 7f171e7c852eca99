package relay

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-relay/relay/internal/redistest"
)

// TestTheFleetRouteStatesEachNodesBlocks: GET /relay/fleet stays an array
// of nodes, each with the blocks it held at its last heartbeat and the
// error each allows the fleet.
func TestTheFleetRouteStatesEachNodesBlocks(t *testing.T) {
	srv := redistest.Start(t)
	block := strings.Replace(fleetBlock(srv.Addr, "local", "fleet-leases"), "rate 3/m", "rate 60000/m", 1)
	startRelay(t, block)
	// the next heartbeat, now: first so that the relays up are known and
	// the key's block is sized, then so that the block is listed
	beat := func() { fleets.Range(func(_, v any) bool { v.(*member).Beat(); return true }) }
	beat()
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	beat()
	resp, err := client.Get(adminURL + "/relay/fleet")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var nodes []map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&nodes); err != nil || len(nodes) != 1 {
		t.Fatalf("GET /relay/fleet: %d nodes, %v", len(nodes), err)
	}
	for _, field := range []string{"id", "address", "version", "last_seen", "state", "leases"} {
		if _, ok := nodes[0][field]; !ok {
			t.Errorf("a node has no %q: %v", field, nodes[0])
		}
	}
	leases, _ := nodes[0]["leases"].([]any)
	if len(leases) != 1 {
		t.Fatalf("leases %v, want the key's rate's block", nodes[0]["leases"])
	}
	// alone in its fleet: a block of 60000 / 10 requests, the whole error
	b := leases[0].(map[string]any)
	if b["limit"] != "k:fleet-leases-key" || b["kind"] != "requests" || b["block"] != 6000.0 || b["left"] != 5999.0 ||
		b["nodes"] != 1.0 || b["max_fleet_error"] != 6000.0 || b["until"] == "" {
		t.Fatalf("block %v", b)
	}
}

// TestAClusterPipelinesItsAdmissions: in a Redis Cluster one script
// cannot touch a key's and a channel's limits (two slots): each is a
// script of its own, sent in one pipeline, and what one took is given
// back when the other refused.
func TestAClusterPipelinesItsAdmissions(t *testing.T) {
	srv := redistest.StartCluster(t)
	r := &Relay{
		// two addresses make a cluster client, here of a one-node cluster
		Fleet: &Fleet{Redis: &FleetRedis{Address: []string{srv.Addr, srv.Addr}, Prefix: "cl:"}},
		Keys: []*Key{{Secret: "sk-cluster-0123456789abcdef", Group: "cl-g",
			KeyOptions: KeyOptions{Name: "cl-key", Concurrency: 10, UserRate: "100/m"}}},
		Channels: []*Channel{{Name: "cl-ch", UpstreamRaw: upstream("mock"), Rate: "1/h"}},
		Groups:   []*Group{{Name: "cl-g", Channels: []string{"cl-ch"}, MaxQueue: -1}}, // a busy channel is an answer, not a wait
	}
	provisionHandler(t, r)
	if !r.fleet.Cluster {
		t.Fatal("not a cluster client")
	}
	body := `{"model":"m","max_tokens":8,"metadata":{"user_id":"carol"},"messages":[{"role":"user","content":"hi"}]}`
	send := func() int {
		w, _ := serveHandler(t, r, newRequest(body, "sk-cluster-0123456789abcdef"))
		return w.Code
	}
	before := admitOps(t)
	if code := send(); code != 200 {
		t.Fatalf("first request: %d", code)
	}
	if ops := admitOps(t) - before; ops != 1 {
		t.Fatalf("the key's, the end user's and the channel's limits took %v round trips, want 1 (a pipeline)", ops)
	}
	// the channel's rate is spent: the key's slot and the end user's
	// request, taken in the same pipeline, go back
	if code := send(); code == 200 {
		t.Fatal("second request admitted past the channel's rate of 1/h")
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	waitFor(t, "the key's slot given back", 2*time.Second, func() bool {
		n, err := rdb.ZCard(context.Background(), "cl:{k:cl-key}:leases").Result()
		return err == nil && n == 0
	})
}

// TestALeasedKeyAsksRedisNothing: a request whose key's limits are all
// leased, and whose channel has none, asks Redis nothing once the key's
// blocks are taken, a large concurrency limit's block of slots among them;
// a key with a concurrency limit too small to lease asks once per request,
// with its channel's limits and its end user's in the same script.
func TestALeasedKeyAsksRedisNothing(t *testing.T) {
	srv := redistest.Start(t)
	r := &Relay{
		Fleet: &Fleet{Redis: &FleetRedis{Address: []string{srv.Addr}, Prefix: "leasedkey:"}},
		Keys: []*Key{
			{Secret: "sk-leased-0123456789abcdef", Group: "leased-g", KeyOptions: KeyOptions{Name: "leased", Rate: "100000/m", Tokens: "100000000/m"}},
			{Secret: "sk-slots-0123456789abcdefgh", Group: "leased-g", KeyOptions: KeyOptions{Name: "slots", Rate: "100000/m", Concurrency: 100}},
			// alone in its fleet, a block of 99 slots would be 9: not leased
			{Secret: "sk-counted-0123456789abcdef", Group: "leased-g", KeyOptions: KeyOptions{Name: "counted", Rate: "100000/m", Concurrency: 99}},
		},
		Channels: []*Channel{{Name: "leased-ch", UpstreamRaw: upstream("mock"), Rate: "100000/m"}},
		Groups:   []*Group{{Name: "leased-g", Channels: []string{"leased-ch"}}},
	}
	provisionHandler(t, r)
	r.fleet.Beat()
	send := func(key string) {
		t.Helper()
		w, _ := serveHandler(t, r, newRequest(simpleBody, key))
		if w.Code != http.StatusOK {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
		if w.Header().Get("Anthropic-Ratelimit-Requests-Remaining") == "" {
			t.Fatal("no rate limit headers")
		}
	}
	send("sk-leased-0123456789abcdef") // takes the blocks
	before := admitOps(t)
	for range 20 {
		send("sk-leased-0123456789abcdef")
	}
	if ops := admitOps(t) - before; ops != 0 {
		t.Errorf("20 requests of a key and a channel with leased limits asked Redis %v times, want none", ops)
	}
	before = admitOps(t)
	for range 20 {
		send("sk-slots-0123456789abcdefgh")
	}
	if ops := admitOps(t) - before; ops != 1 {
		t.Errorf("20 requests of a key with a leased concurrency limit asked Redis %v times, want 1: its block of 10 slots", ops)
	}
	before = admitOps(t)
	for range 20 {
		send("sk-counted-0123456789abcdef")
	}
	if ops := admitOps(t) - before; ops != 20 {
		t.Errorf("20 requests of a key with a concurrency limit of 99 asked Redis %v times, want 20", ops)
	}
}

// TestTheGateRefusesWhatRedisRefused: once Redis refused a key's rate,
// its next requests are refused before their bodies, without asking
// Redis, until the rate lifts.
func TestTheGateRefusesWhatRedisRefused(t *testing.T) {
	srv := redistest.Start(t)
	r := &Relay{
		Fleet:    &Fleet{Redis: &FleetRedis{Address: []string{srv.Addr}, Prefix: "gate:"}},
		Keys:     []*Key{{Secret: "sk-gate-0123456789abcdefgh", Group: "gate-g", KeyOptions: KeyOptions{Name: "gate", Rate: "2/h"}}},
		Channels: []*Channel{{Name: "gate-ch", UpstreamRaw: upstream("mock")}},
		Groups:   []*Group{{Name: "gate-g", Channels: []string{"gate-ch"}}},
	}
	provisionHandler(t, r)
	send := func() int {
		w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-gate-0123456789abcdefgh"))
		return w.Code
	}
	before := admitOps(t)
	for i, want := range []int{200, 200, 429} {
		if got := send(); got != want {
			t.Fatalf("request %d: %d, want %d", i+1, got, want)
		}
	}
	if ops := admitOps(t) - before; ops != 3 {
		t.Fatalf("3 requests asked Redis %v times, want 3", ops)
	}
	for range 5 {
		if got := send(); got != 429 {
			t.Fatalf("after a refusal: %d, want 429", got)
		}
	}
	if ops := admitOps(t) - before; ops != 3 {
		t.Fatalf("refused again, the requests asked Redis %v more times, want none", ops-3)
	}
}
