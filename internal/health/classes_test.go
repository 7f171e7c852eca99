package health

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestAClassCoolsAloneAndSaysWhatKeepsItOut(t *testing.T) {
	h := newTestHealth(DefaultBreaker)
	policy := CooldownPolicy{Base: 10 * time.Second, Max: time.Minute, Auth: time.Hour}
	if d := h.Record(Verdict{Outcome: RateLimited, Wait: 30 * time.Second, Reason: "status 429", Class: "opus"}, policy, testNow, 0); d != 30*time.Second {
		t.Fatalf("an opus 429 cooled for %v, want its wait", d)
	}
	if ok, _ := h.Available(testNow); !ok || h.ChannelState(testNow) != StateHealthy || h.State(testNow) != StateCooldown {
		t.Fatalf("after an opus 429 the channel itself is out (%s), or reads healthy (%s)", h.ChannelState(testNow), h.State(testNow))
	}
	if out, until, by := h.ClassOut("opus", testNow); !out || !until.Equal(testNow.Add(30*time.Second)) || by != OutReset {
		t.Errorf("opus: out %v until %v by %d, want out 30s by the upstream's reset", out, until, by)
	}
	if out, _, _ := h.ClassOut("sonnet", testNow); out {
		t.Error("sonnet cools after an opus 429")
	}
	h.Record(Verdict{Outcome: Overloaded, Reason: "status 529", Class: "sonnet"}, policy, testNow, 0)
	if out, until, by := h.ClassOut("sonnet", testNow); !out || !until.Equal(testNow.Add(10*time.Second)) || by != OutOverload {
		t.Errorf("sonnet after a 529: out %v until %v by %d, want out for the base cooldown, overloaded", out, until, by)
	}
	h.QuotaSpent("haiku", testNow.Add(20*time.Second), "anthropic-ratelimit-tokens-remaining: 0", testNow)
	if c := h.CoolingClasses(testNow)["haiku"]; c.OutBy() != OutReset || c.Reason != "anthropic-ratelimit-tokens-remaining: 0" ||
		c.Until != testNow.Add(20*time.Second).UnixNano() {
		t.Errorf("haiku after its quota was spent: %+v", c)
	}
	if last, reason, _ := h.LastError(); last != Overloaded || reason != "status 529 (class sonnet)" {
		t.Errorf("last error %v %q, want the sonnet 529 and its class", last, reason)
	}
	if h.ClassCooling(testNow.Add(30*time.Second)) || len(h.CoolingClasses(testNow.Add(30*time.Second))) != 0 {
		t.Error("a class still cools after every cooldown ended")
	}
	h.Reset()
	if h.ClassCooling(testNow) {
		t.Error("a class still cools after a reset")
	}
}

// TestClassCooldownsAreBounded: what the other nodes of a fleet could
// publish is bounded, in number and in the length of a class's name.
func TestClassCooldownsAreBounded(t *testing.T) {
	h := new(Channel)
	h.mu.Lock()
	for i := range 10_000 {
		h.coolClass(fmt.Sprintf("published-%d", i), testNow.Add(time.Hour).UnixNano(), 0, 0, "", testNow)
	}
	long := strings.Repeat("x", MaxClassLen+1)
	h.coolClass(long, testNow.Add(time.Hour).UnixNano(), 0, 0, "", testNow)
	h.mu.Unlock()
	if n := len(h.CoolingClasses(testNow)); n != maxClassCooldowns {
		t.Fatalf("%d classes kept, want at most %d", n, maxClassCooldowns)
	}
	if _, ok := h.CoolingClasses(testNow)[long]; ok {
		t.Error("a class whose name is longer than a model id is kept")
	}
}

// TestSetAsideIsBounded: the models and features a channel sets aside are
// the clients' names, so they are bounded, the first to end making room.
func TestSetAsideIsBounded(t *testing.T) {
	h := new(Channel)
	policy := CooldownPolicy{Capability: time.Hour}
	for i := range 2 * maxSetAside {
		h.Record(Verdict{Outcome: ModelRefused, Reason: "model refused", Model: fmt.Sprint("m-", i)}, policy, testNow.Add(time.Duration(i)), 0)
	}
	if n := len(h.Refused()); n != maxSetAside {
		t.Fatalf("%d models set aside, want %d", n, maxSetAside)
	}
	last := testNow.Add(time.Duration(2*maxSetAside - 1))
	if refused, until := h.Refuses(fmt.Sprint("m-", 2*maxSetAside-1), last); !refused || !until.Equal(last.Add(time.Hour)) {
		t.Errorf("the last model refused: %v until %v", refused, until)
	}
	if refused, _ := h.Refuses("m-0", last); refused {
		t.Error("the first model refused was kept over the newest")
	}
	if ok, _ := h.Available(last); !ok || h.Failures() != 0 {
		t.Error("a refused model cooled the channel")
	}
	h.Record(Verdict{Outcome: LacksFeature, Reason: "lacks x", Features: []string{"x"}}, policy, testNow, 0)
	if until, ok := h.Lacking()["x"]; !ok || until != testNow.Add(time.Hour).UnixNano() {
		t.Errorf("the lacking feature: %v %v", until, ok)
	}
}
