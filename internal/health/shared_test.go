package health

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// sharedClient is one node's client of the fleet on the Redis at addr
// under prefix, its health shared, stopped when the test ends.
func sharedClient(t *testing.T, addr, prefix string) *Shared {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	c, err := fleet.New(ctx, &fleet.Config{Address: []string{addr}, Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	s := NewShared(c)
	t.Cleanup(func() { c.Stop(); _ = c.Close() })
	return s
}

// fleetChannel is the health of a channel named channel, configured as a
// relay configures it and shared through the Redis at addr under prefix.
func fleetChannel(t *testing.T, addr, prefix, channel string) *Channel {
	t.Helper()
	h := NewChannel(channel)
	h.Configure(DefaultBreaker)
	h.Share(sharedClient(t, addr, prefix))
	return h
}

// waitFor waits for cond, at most bound.
func waitFor(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// publishAs publishes a health change as another node would.
func publishAs(t *testing.T, rdb *redis.Client, prefix string, c change) {
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
	h := fleetChannel(t, srv.Addr, "hp:", "fleet-apply")
	waitFor(t, "the node subscribes", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(context.Background(), "hp:health").Result()
		return n["hp:health"] == 1
	})

	sent := time.Now()
	publishAs(t, rdb, "hp:", change{Channel: "fleet-apply", Kind: changeCool, Until: 5000, Error: "overloaded", Reason: "529 overloaded_error"})
	waitFor(t, "a cooldown from another node", pubsubDelivery, func() bool { return h.State(time.Now()) == StateCooldown })
	if until := time.Unix(0, h.until.Load()); until.Before(sent.Add(4900*time.Millisecond)) || until.After(time.Now().Add(5*time.Second)) {
		t.Fatalf("cooldown until %v, want 5s after it was sent", until)
	}
	if last, reason, _ := h.LastError(); last != Overloaded || reason != "529 overloaded_error (seen by another-node)" {
		t.Fatalf("last error %q %q", last, reason)
	}

	publishAs(t, rdb, "hp:", change{Channel: "fleet-apply", Kind: changeReset})
	waitFor(t, "a reset from another node", pubsubDelivery, func() bool { return h.State(time.Now()) == StateHealthy })

	publishAs(t, rdb, "hp:", change{Channel: "fleet-apply", Kind: changeDisable})
	waitFor(t, "a disable from another node", pubsubDelivery, func() bool { return h.State(time.Now()) == StateDisabled })
	publishAs(t, rdb, "hp:", change{Channel: "fleet-apply", Kind: changeEnable})
	waitFor(t, "an enable from another node", pubsubDelivery, func() bool { return h.State(time.Now()) == StateHealthy })

	publishAs(t, rdb, "hp:", change{Channel: "fleet-apply", Kind: changeOpen, Open: 30000})
	waitFor(t, "a breaker opened by another node", pubsubDelivery, func() bool { return h.State(time.Now()) == StateOpen })
	if ok, _ := h.Available(time.Now()); ok {
		t.Fatal("a channel whose breaker another node opened is still available")
	}
	publishAs(t, rdb, "hp:", change{Channel: "fleet-apply", Kind: changeClosed})
	waitFor(t, "a breaker closed by another node", pubsubDelivery, func() bool { return h.State(time.Now()) == StateHealthy })
	if ok, _ := h.Available(time.Now()); !ok {
		t.Fatal("a channel whose breaker another node closed is not available")
	}

	// its own changes coming back do not apply twice, and garbage is ignored
	if err := rdb.Publish(context.Background(), "hp:health", "{not json").Err(); err != nil {
		t.Fatal(err)
	}
	publishAs(t, rdb, "hp:", change{Channel: "no-such-channel", Kind: changeDisable})
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
	h := fleetChannel(t, srv.Addr, "hs:", "fleet-pub")
	next := func() change {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		for {
			m, err := sub.ReceiveMessage(ctx)
			if err != nil {
				t.Fatalf("no health change published: %v", err)
			}
			var c change
			if err := json.Unmarshal([]byte(m.Payload), &c); err != nil {
				t.Fatal(err)
			}
			if c.Channel == "fleet-pub" {
				return c
			}
		}
	}

	// a 529 on this node
	h.Record(Verdict{Outcome: Overloaded, Reason: "529"}, CooldownPolicy{Base: 3 * time.Second, Max: time.Minute}, time.Now(), 0)
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
	h.Disable()
	if c := next(); c.Kind != changeDisable {
		t.Fatalf("published %+v, want disable", c)
	}
	if v, _ := rdb.HGet(context.Background(), "hs:{c:fleet-pub}:health", "disabled").Result(); v != "1" {
		t.Fatalf("stored disabled = %q", v)
	}

	// a quota the upstream says is spent
	h.QuotaSpent("haiku", time.Now().Add(20*time.Second).Truncate(time.Second), "anthropic-ratelimit-requests-remaining: 0", time.Now())
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
	h := fleetChannel(t, srv.Addr, "hj:", "fleet-join")
	waitFor(t, "the stored state applied", 2*time.Second, func() bool { return h.disabled.Load() && h.until.Load() > time.Now().Add(15*time.Second).UnixNano() })
	if last, reason, _ := h.LastError(); last != Overloaded || reason != "529 overloaded_error (seen by node-a)" {
		t.Fatalf("a joining node says the channel is out because %q %q", last, reason)
	}
}

func TestANodeBringsItsStateBackAfterRedisRestarts(t *testing.T) {
	srv := redistest.Start(t)
	h := fleetChannel(t, srv.Addr, "hr:", "fleet-restart")
	h.Record(Verdict{Outcome: Overloaded, Reason: "529"}, CooldownPolicy{Base: 30 * time.Second, Max: time.Minute}, time.Now(), 0)

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
	h := fleetChannel(t, srv.Addr, "hc:", "fleet-class")
	waitFor(t, "the node subscribes", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(ctx, "hc:health").Result()
		return n["hc:health"] == 2
	})
	next := func() change {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		for {
			m, err := sub.ReceiveMessage(ctx)
			if err != nil {
				t.Fatalf("no health change published: %v", err)
			}
			var c change
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
	h.Record(Verdict{Outcome: RateLimited, Wait: 20 * time.Second, Reason: "status 429", Class: "opus"},
		CooldownPolicy{Base: time.Second, Max: time.Minute}, time.Now(), 0)
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
	publishAs(t, rdb, "hc:", change{Channel: "fleet-class", Kind: changeCool, Class: "sonnet", Until: 5000, Error: "overloaded", Reason: "status 529"})
	waitFor(t, "a class's cooldown from another node", pubsubDelivery, func() bool { return h.CoolingClasses(time.Now())["sonnet"].Until > 0 })
	s := h.CoolingClasses(time.Now())["sonnet"]
	if last, reason, _ := h.LastError(); s.Reason != "status 529 (seen by another-node)" || time.Until(time.Unix(0, s.Until)) < 4500*time.Millisecond ||
		last != Overloaded || reason != "status 529 (class sonnet) (seen by another-node)" ||
		h.ChannelState(time.Now()) != StateHealthy || h.State(time.Now()) != StateCooldown {
		t.Fatalf("after another node's sonnet 529: %+v, last error %v %q", s, last, reason)
	}
	// and this node knows the cooldown is an overload: its refusals say 529
	if by := s.OutBy(); by != OutOverload {
		t.Errorf("another node's 529 cools sonnet here as %d, want an overload (%d)", by, OutOverload)
	}

	// a reset ends them everywhere, in Redis too
	h.Reset()
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
	if h.ClassCooling(time.Now()) {
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
	h := fleetChannel(t, srv.Addr, "hk:", "fleet-class-join")
	waitFor(t, "the stored class applied", 2*time.Second, func() bool { return h.ClassCooling(time.Now()) })
	cl := h.CoolingClasses(time.Now())
	if c := cl["opus"]; len(cl) != 1 || c.Reason != "status 429 (seen by node-a)" || c.Limited != c.Until ||
		time.Until(time.Unix(0, c.Until)) < 15*time.Second {
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

// TestAChannelNoLongerSharedIsLeftAlone: a channel that no config shares
// with the fleet any more (the relay drops it, or its storage) neither
// takes the other nodes' changes nor publishes its own, and another
// channel of its name may take its place.
func TestAChannelNoLongerSharedIsLeftAlone(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	s := sharedClient(t, srv.Addr, "hn:")
	old := NewChannel("fleet-gone")
	old.Configure(DefaultBreaker)
	old.Share(s)
	waitFor(t, "the node subscribes", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(ctx, "hn:health").Result()
		return n["hn:health"] == 1
	})
	old.Share(nil)
	if s.channel("fleet-gone") != nil {
		t.Fatal("a channel no longer shared is still the fleet's")
	}
	old.Disable()
	time.Sleep(100 * time.Millisecond)
	if n, _ := rdb.Exists(ctx, "hn:{c:fleet-gone}:health").Result(); n != 0 {
		t.Fatal("a channel no longer shared published its change")
	}

	// another node's change reaches the channel of that name shared now,
	// not one that was: a late release of one that was leaves it shared
	stale := NewChannel("fleet-gone")
	stale.Configure(DefaultBreaker)
	stale.Share(s)
	h := NewChannel("fleet-gone")
	h.Configure(DefaultBreaker)
	h.Share(s)
	stale.Drop()
	publishAs(t, rdb, "hn:", change{Channel: "fleet-gone", Kind: changeCool, Until: 5000, Error: "transient", Reason: "status 500"})
	waitFor(t, "a cooldown from another node", pubsubDelivery, func() bool { return h.State(time.Now()) == StateCooldown })
	if old.until.Load() != 0 || stale.until.Load() != 0 {
		t.Error("a channel no longer shared took another node's change")
	}
}

func TestHealthKeys(t *testing.T) {
	s := &Shared{c: &fleet.Client{Prefix: "p:"}}
	if got := s.healthKey("x"); got != "p:{c:x}:health" {
		t.Fatal(got)
	}
	// a brace in a name would end the cluster hash tag early
	if got := s.healthKey("a}b"); got == "p:{c:a}b}:health" || len(got) != len("p:{c:}:health")+16 {
		t.Fatalf("the health key of a name with a brace: %q", got)
	}
	if got := s.healthTopic(); got != "p:health" {
		t.Fatal(got)
	}
}
