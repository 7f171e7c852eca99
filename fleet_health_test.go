package relay

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
)

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

// publishAs publishes a health change as another node would.
func publishAs(t *testing.T, rdb *redis.Client, prefix string, c healthChange) {
	t.Helper()
	c.Node = "another-node"
	msg, _ := json.Marshal(c)
	if err := rdb.Publish(context.Background(), prefix+"health", msg).Err(); err != nil {
		t.Fatal(err)
	}
}

// pubsubDelivery bounds the wait for another node's change, which applies
// as soon as Redis delivers it. Alone the tests see it in milliseconds;
// under the whole suite with -race on two busy cores, a delivery took
// longer than 250ms once (CI on 2026-12-07), so the bound says "soon", not
// how soon.
const pubsubDelivery = 2 * time.Second

func TestHealthChangesOfOtherNodesApplyAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	_, h := fleetRelay(t, srv.Addr, "hp:", "fleet-apply")
	waitFor(t, "the node subscribes", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(context.Background(), "hp:health").Result()
		return n["hp:health"] == 1
	})

	sent := time.Now()
	publishAs(t, rdb, "hp:", healthChange{Channel: "fleet-apply", Kind: changeCool, Until: 5000, Error: "overloaded", Reason: "529 overloaded_error"})
	waitFor(t, "a cooldown from another node", pubsubDelivery, func() bool { return h.state(time.Now()) == stateCooldown })
	if until := time.Unix(0, h.until.Load()); until.Before(sent.Add(4900*time.Millisecond)) || until.After(time.Now().Add(5*time.Second)) {
		t.Fatalf("cooldown until %v, want 5s after it was sent", until)
	}
	if st := h.status("fleet-apply", time.Now()); st.LastError != "overloaded" || st.LastErrorReason != "529 overloaded_error (seen by another-node)" {
		t.Fatalf("last error %q %q", st.LastError, st.LastErrorReason)
	}

	publishAs(t, rdb, "hp:", healthChange{Channel: "fleet-apply", Kind: changeReset})
	waitFor(t, "a reset from another node", pubsubDelivery, func() bool { return h.state(time.Now()) == stateHealthy })

	publishAs(t, rdb, "hp:", healthChange{Channel: "fleet-apply", Kind: changeDisable})
	waitFor(t, "a disable from another node", pubsubDelivery, func() bool { return h.state(time.Now()) == stateDisabled })
	publishAs(t, rdb, "hp:", healthChange{Channel: "fleet-apply", Kind: changeEnable})
	waitFor(t, "an enable from another node", pubsubDelivery, func() bool { return h.state(time.Now()) == stateHealthy })

	publishAs(t, rdb, "hp:", healthChange{Channel: "fleet-apply", Kind: changeOpen, Open: 30000})
	waitFor(t, "a breaker opened by another node", pubsubDelivery, func() bool { return h.state(time.Now()) == stateOpen })
	if ok, _ := h.available(time.Now()); ok {
		t.Fatal("a channel whose breaker another node opened is still available")
	}
	publishAs(t, rdb, "hp:", healthChange{Channel: "fleet-apply", Kind: changeClosed})
	waitFor(t, "a breaker closed by another node", pubsubDelivery, func() bool { return h.state(time.Now()) == stateHealthy })
	if ok, _ := h.available(time.Now()); !ok {
		t.Fatal("a channel whose breaker another node closed is not available")
	}

	// its own changes coming back do not apply twice, and garbage is ignored
	if err := rdb.Publish(context.Background(), "hp:health", "{not json").Err(); err != nil {
		t.Fatal(err)
	}
	publishAs(t, rdb, "hp:", healthChange{Channel: "no-such-channel", Kind: changeDisable})
}

func TestHealthChangesArePublishedAndStored(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	sub := rdb.Subscribe(context.Background(), "hs:health")
	defer sub.Close()
	if _, err := sub.Receive(context.Background()); err != nil {
		t.Fatal(err)
	}
	_, h := fleetRelay(t, srv.Addr, "hs:", "fleet-pub")
	next := func() healthChange {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		for {
			m, err := sub.ReceiveMessage(ctx)
			if err != nil {
				t.Fatalf("no health change published: %v", err)
			}
			var c healthChange
			if err := json.Unmarshal([]byte(m.Payload), &c); err != nil {
				t.Fatal(err)
			}
			if c.Channel == "fleet-pub" {
				return c
			}
		}
	}

	// a 529 on this node
	h.record(verdict{outcome: outcomeOverloaded, reason: "529"}, cooldownPolicy{base: 3 * time.Second, max: time.Minute}, time.Now(), 0)
	c := next()
	if c.Kind != changeCool || c.Until != 3000 || c.Error != "overloaded" || c.Node != fleet.ThisNode().ID {
		t.Fatalf("published %+v", c)
	}
	left, err := rdb.HGet(context.Background(), "hs:{c:fleet-pub}:health", "until").Int64()
	if err != nil {
		t.Fatal(err)
	}
	redisNow, _ := rdb.Time(context.Background()).Result()
	if d := time.Duration(left-redisNow.UnixMilli()) * time.Millisecond; d < 2*time.Second || d > 3*time.Second {
		t.Fatalf("stored cooldown ends in %v, want about 3s on Redis's clock", d)
	}
	why, _ := rdb.HMGet(context.Background(), "hs:{c:fleet-pub}:health", "error", "reason").Result()
	if len(why) != 2 || why[0] != "overloaded" || why[1] != "529 (seen by "+fleet.ThisNode().ID+")" {
		t.Fatalf("stored why: %v", why)
	}

	// an admin action
	req := httptest.NewRequest(http.MethodPost, "/relay/channels/fleet-pub/disable", nil)
	req.SetPathValue("name", "fleet-pub")
	req.SetPathValue("action", "disable")
	if err := (adminAPI{}).act(httptest.NewRecorder(), req); err != nil {
		t.Fatal(err)
	}
	if c := next(); c.Kind != changeDisable {
		t.Fatalf("published %+v, want disable", c)
	}
	if v, _ := rdb.HGet(context.Background(), "hs:{c:fleet-pub}:health", "disabled").Result(); v != "1" {
		t.Fatalf("stored disabled = %q", v)
	}

	// a quota the upstream says is spent
	hdr := http.Header{}
	hdr.Set("anthropic-ratelimit-requests-remaining", "0")
	hdr.Set("anthropic-ratelimit-requests-reset", time.Now().Add(20*time.Second).UTC().Format(time.RFC3339))
	until, reason := spentQuota(hdr, time.Now(), time.Minute)
	h.quotaSpent("haiku", until, reason, time.Now())
	if c := next(); c.Kind != changeCool || c.Class != "haiku" || c.Until < 18000 || c.Until > 20000 || c.Limited != c.Until ||
		c.Reason != "anthropic-ratelimit-requests-remaining: 0" {
		t.Fatalf("published %+v, want the quota's reset for the class", c)
	}
}

func TestANodeTakesTheStoredStateWhenItJoins(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	now, _ := rdb.Time(ctx).Result()
	// what earlier nodes stored: a cooldown for 20s and why, and disabled
	rdb.HSet(ctx, "hj:{c:fleet-join}:health", "until", now.UnixMilli()+20000, "disabled", 1,
		"error", "overloaded", "reason", "529 overloaded_error (seen by node-a)")
	_, h := fleetRelay(t, srv.Addr, "hj:", "fleet-join")
	waitFor(t, "the stored state applied", 2*time.Second, func() bool { return h.disabled.Load() && h.until.Load() > time.Now().Add(15*time.Second).UnixNano() })
	if st := h.status("fleet-join", time.Now()); st.LastError != "overloaded" || st.LastErrorReason != "529 overloaded_error (seen by node-a)" {
		t.Fatalf("a joining node says the channel is out because %q %q", st.LastError, st.LastErrorReason)
	}
}

func TestANodeBringsItsStateBackAfterRedisRestarts(t *testing.T) {
	srv := redistest.Start(t)
	_, h := fleetRelay(t, srv.Addr, "hr:", "fleet-restart")
	h.record(verdict{outcome: outcomeOverloaded, reason: "529"}, cooldownPolicy{base: 30 * time.Second, max: time.Minute}, time.Now(), 0)

	srv.Kill() // a crash: the data is gone
	srv.Restart()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	waitFor(t, "the cooldown stored again", 5*time.Second, func() bool {
		v, err := rdb.HGet(context.Background(), "hr:{c:fleet-restart}:health", "until").Int64()
		return err == nil && v > 0
	})
}

func TestAClassCooldownIsSharedByTheFleet(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	sub := rdb.Subscribe(ctx, "hc:health")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	_, h := fleetRelay(t, srv.Addr, "hc:", "fleet-class")
	waitFor(t, "the node subscribes", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(ctx, "hc:health").Result()
		return n["hc:health"] == 2
	})
	next := func() healthChange {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		for {
			m, err := sub.ReceiveMessage(ctx)
			if err != nil {
				t.Fatalf("no health change published: %v", err)
			}
			var c healthChange
			if err := json.Unmarshal([]byte(m.Payload), &c); err != nil {
				t.Fatal(err)
			}
			if c.Channel == "fleet-class" && c.Node == fleet.ThisNode().ID {
				return c
			}
		}
	}
	key := "hc:{c:fleet-class}:health"

	// an opus 429 on this node: published with its class, stored in the
	// class's fields; the channel's own times are untouched, and its last
	// error says which class (so a node that joins later can say why)
	h.record(verdict{outcome: outcomeRateLimited, wait: 20 * time.Second, reason: "status 429", class: "opus"},
		cooldownPolicy{base: time.Second, max: time.Minute}, time.Now(), 0)
	if c := next(); c.Kind != changeCool || c.Class != "opus" || c.Until != 20000 || c.Limited != 20000 || c.Error != "rate_limited" || c.Reason != "status 429" {
		t.Fatalf("published %+v", c)
	}
	redisNow, _ := rdb.Time(ctx).Result()
	stored, _ := rdb.HGetAll(ctx, key).Result()
	if left := time.Duration(atoi(stored["cu:opus"])-redisNow.UnixMilli()) * time.Millisecond; left < 19*time.Second || left > 20*time.Second ||
		stored["cl:opus"] != stored["cu:opus"] || stored["cr:opus"] != "status 429 (seen by "+fleet.ThisNode().ID+")" || stored["until"] != "" ||
		stored["error"] != "rate_limited" || stored["reason"] != "status 429 (class opus) (seen by "+fleet.ThisNode().ID+")" {
		t.Fatalf("stored %v", stored)
	}
	if h.until.Load() != 0 {
		t.Fatal("an opus 429 cooled the channel")
	}

	// another node's sonnet 529 applies to the sonnet class alone
	publishAs(t, rdb, "hc:", healthChange{Channel: "fleet-class", Kind: changeCool, Class: "sonnet", Until: 5000, Error: "overloaded", Reason: "status 529"})
	waitFor(t, "a class's cooldown from another node", pubsubDelivery, func() bool { return h.coolingClasses(time.Now())["sonnet"].until > 0 })
	st := h.status("fleet-class", time.Now())
	if s := st.Classes["sonnet"]; s.Reason != "status 529 (seen by another-node)" || time.Until(s.Until) < 4500*time.Millisecond ||
		st.LastError != "overloaded" || st.LastErrorReason != "status 529 (class sonnet) (seen by another-node)" ||
		h.channelState(time.Now()) != stateHealthy || st.State != stateCooldown {
		t.Fatalf("after another node's sonnet 529: %+v", st)
	}
	// and this node knows the cooldown is an overload: its refusals say 529
	if by := h.coolingClasses(time.Now())["sonnet"].outBy(); by != outOverload {
		t.Errorf("another node's 529 cools sonnet here as %d, want an overload (%d)", by, outOverload)
	}

	// a reset ends them everywhere, in Redis too
	steerChannel("fleet-class", "reset")
	if c := next(); c.Kind != changeReset {
		t.Fatalf("published %+v, want reset", c)
	}
	waitFor(t, "the reset stored", 2*time.Second, func() bool {
		stored, _ := rdb.HGetAll(ctx, key).Result()
		for f := range stored {
			if strings.HasPrefix(f, "c") && strings.Contains(f, ":") {
				return false
			}
		}
		return true
	})
	if h.classCooling(time.Now()) {
		t.Fatal("a class still cools after the reset")
	}
}

func TestANodeTakesTheStoredClassCooldownsWhenItJoins(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	now, _ := rdb.Time(ctx).Result()
	// what earlier nodes stored: opus cooling for 20s, haiku's ended
	key := "hk:{c:fleet-class-join}:health"
	rdb.HSet(ctx, key, "cu:opus", now.UnixMilli()+20000, "cl:opus", now.UnixMilli()+20000, "cr:opus", "status 429 (seen by node-a)",
		"cu:haiku", now.UnixMilli()-1000, "cr:haiku", "status 529 (seen by node-a)",
		"error", "rate_limited", "reason", "status 429 (class opus) (seen by node-a)")
	_, h := fleetRelay(t, srv.Addr, "hk:", "fleet-class-join")
	waitFor(t, "the stored class applied", 2*time.Second, func() bool { return h.classCooling(time.Now()) })
	cl := h.coolingClasses(time.Now())
	if c := cl["opus"]; len(cl) != 1 || c.reason != "status 429 (seen by node-a)" || c.limited != c.until ||
		time.Until(time.Unix(0, c.until)) < 15*time.Second {
		t.Fatalf("a joining node's classes: %+v", cl)
	}
	// the channel does not cool, but why its class does is its last error
	h.mu.Lock()
	last, why := h.lastError.String(), h.lastReason
	h.mu.Unlock()
	if last != "rate_limited" || why != "status 429 (class opus) (seen by node-a)" {
		t.Errorf("a joining node's last error: %q %q", last, why)
	}
	if ok, _ := rdb.HExists(ctx, key, "cu:haiku").Result(); ok {
		t.Error("an ended class's fields are still stored")
	}
}

func atoi(s string) int64 {
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}
