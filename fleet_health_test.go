package relay

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// The health a fleet shares is internal/health's (its tests are there);
// these test that a relay in a fleet shares its channels' health.

// fleetRelay provisions a relay whose state is shared through the Redis at
// addr under prefix, with one mock channel named channel.
func fleetRelay(t *testing.T, addr, prefix, channel string) (*Relay, *channelHealth) {
	t.Helper()
	r := &Relay{
		Fleet:    &Fleet{Redis: &FleetRedis{Address: []string{addr}, Prefix: prefix}},
		Keys:     []*Key{{Secret: "sk-fleet-0123456789abcdef-" + channel, Group: channel + "-g"}},
		Channels: []*Channel{{Name: channel, UpstreamRaw: upstream("mock")}},
		Groups:   []*Group{{Name: channel + "-g", Channels: []string{channel}}},
	}
	provisionHandler(t, r)
	return r, findChannel(channel)
}

// pubsubDelivery bounds the wait for another node's change, which applies
// as soon as Redis delivers it. Alone the tests see it in milliseconds;
// under the whole suite with -race on two busy cores, a delivery took
// longer than 250ms once (CI on 2026-12-07), so the bound says "soon", not
// how soon.
const pubsubDelivery = 2 * time.Second

// TestARelaySharesItsChannelsHealth: a relay with storage shares each
// channel's health as it provisions it: an admin's action on it is
// published and stored, and another node's change applies to it, as the
// admin API shows.
func TestARelaySharesItsChannelsHealth(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	sub := rdb.Subscribe(ctx, "hw:health")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	_, h := fleetRelay(t, srv.Addr, "hw:", "fleet-wired")
	waitFor(t, "the node subscribes", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(ctx, "hw:health").Result()
		return n["hw:health"] == 2
	})

	req := httptest.NewRequest(http.MethodPost, "/relay/channels/fleet-wired/disable", nil)
	req.SetPathValue("name", "fleet-wired")
	req.SetPathValue("action", "disable")
	if err := (adminAPI{}).act(httptest.NewRecorder(), req); err != nil {
		t.Fatal(err)
	}
	msgCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	m, err := sub.ReceiveMessage(msgCtx)
	if err != nil {
		t.Fatalf("no health change published: %v", err)
	}
	if want := `"node":"` + fleet.ThisNode().ID + `","channel":"fleet-wired","kind":"disable"`; !strings.Contains(m.Payload, want) {
		t.Fatalf("published %s, want %s", m.Payload, want)
	}
	waitFor(t, "the disable stored", 2*time.Second, func() bool {
		v, _ := rdb.HGet(ctx, "hw:{c:fleet-wired}:health", "disabled").Result()
		return v == "1"
	})

	// another node's cooldown, as it publishes it
	other := `{"node":"another-node","channel":"fleet-wired","kind":"cool","until":30000,"error":"overloaded","reason":"status 529"}`
	if err := rdb.Publish(ctx, "hw:health", other).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "another node's cooldown", pubsubDelivery, func() bool {
		return h.status("fleet-wired", time.Now()).LastErrorReason == "status 529 (seen by another-node)"
	})
	h.Enable()
	if st := h.status("fleet-wired", time.Now()); st.State != stateCooldown || st.LastError != "overloaded" ||
		st.CooldownUntil == nil || time.Until(*st.CooldownUntil) < 25*time.Second {
		t.Fatalf("after another node's cooldown: %+v", st)
	}
}
