package relay

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/affinity"
	"github.com/caddy-relay/relay/internal/memtest"
)

// sharedSystem is a system prompt long enough to cache (about 1,500
// tokens by the relay's and the fake upstream's measure).
var sharedSystem = strings.Repeat("You are the team's coding assistant. Follow the style guide. ", 100)

// cachedBody is a Messages request with the shared tools and a system
// prompt marked for caching, then the messages given (JSON).
func cachedBody(system, messages string, extra ...string) string {
	sys, _ := json.Marshal(system)
	return `{"model":"claude-sonnet-4-5","max_tokens":16,` + strings.Join(extra, "") +
		`"tools":[{"name":"read_file","description":"Reads a file","input_schema":{"type":"object"}}],` +
		`"system":[{"type":"text","text":` + string(sys) + `,"cache_control":{"type":"ephemeral"}}],` +
		`"messages":` + messages + `}`
}

// reordered is cachedBody with its fields in another order.
func reordered(system, messages string) string {
	sys, _ := json.Marshal(system)
	return `{"messages":` + messages + `,"system":[{"type":"text","text":` + string(sys) + `,"cache_control":{"type":"ephemeral"}}],` +
		`"tools":[{"name":"read_file","description":"Reads a file","input_schema":{"type":"object"}}],"max_tokens":16,"model":"claude-sonnet-4-5"}`
}

func userTurn(text string) string {
	t, _ := json.Marshal(text)
	return `[{"role":"user","content":[{"type":"text","text":` + string(t) + `}]}]`
}

// inspected runs inspect on body for a group with affinity, and digests
// its prefixes with a fixed seed; nil when it has none worth a key.
func inspected(t *testing.T, body string) *cachePrefix {
	t.Helper()
	in := &inbound{route: routeMessages, who: requester{key: &key{group: &group{name: "g", affinity: true}}},
		ask: asked{body: []byte(body)}}
	if rerr := in.inspect(); rerr != nil {
		t.Fatalf("inspect: %+v", rerr)
	}
	p := in.ask.prefix
	if p == nil || !p.Digest(42, "g", in.ask.model, in.ask.body) {
		return nil
	}
	return p
}

func TestPrefixDigestsFollowTheBreakpoints(t *testing.T) {
	base := inspected(t, cachedBody(sharedSystem, userTurn("first question")))
	if base == nil || base.N != 1 || base.TTL1h[0] {
		t.Fatalf("a system breakpoint: %+v", base)
	}
	longMessage := strings.Repeat("the file says this and that. ", 300)
	for _, c := range []struct {
		name string
		body string
		same bool // its last key is base's
	}{
		{"another question after the breakpoint", cachedBody(sharedSystem, userTurn("another question")), true},
		{"fields in another order around it", reordered(sharedSystem, userTurn("x")), true},
		{"another system prompt", cachedBody(sharedSystem+"!", userTurn("first question")), false},
		{"another model", strings.Replace(cachedBody(sharedSystem, userTurn("first question")), "claude-sonnet-4-5", "claude-opus-4-1", 1), false},
		{"other tools", strings.Replace(cachedBody(sharedSystem, userTurn("q")), "Reads a file", "Reads files", 1), false},
	} {
		p := inspected(t, c.body)
		if p == nil {
			t.Errorf("%s: no key", c.name)
			continue
		}
		if got := p.Keys[0] == base.Keys[0]; got != c.same {
			t.Errorf("%s: same key %v, want %v", c.name, got, c.same)
		}
	}

	// a breakpoint on a message: two keys, the system's first
	two := inspected(t, cachedBody(sharedSystem, `[{"role":"user","content":[{"type":"text","text":"`+longMessage+`","cache_control":{"type":"ephemeral","ttl":"1h"}}]}]`))
	if two == nil || two.N != 2 || two.Keys[0] != base.Keys[0] || two.TTL1h[0] || !two.TTL1h[1] {
		t.Fatalf("system and message breakpoints: %+v", two)
	}
	// a tool result's content block may be marked too
	nested := inspected(t, cachedBody(sharedSystem, `[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"`+longMessage+`","cache_control":{"type":"ephemeral"}}]}]}]`))
	if nested == nil || nested.N != 2 {
		t.Fatalf("a tool result's block: %+v", nested)
	}
	// automatic caching: the whole prompt
	auto := inspected(t, cachedBody(sharedSystem, userTurn("q"), `"cache_control":{"type":"ephemeral"},`))
	if auto == nil || auto.N != 2 || auto.Keys[0] != base.Keys[0] {
		t.Fatalf("a top-level cache_control: %+v", auto)
	}
	// a tool marked: the tools alone are too short to cache
	tool := inspected(t, strings.Replace(cachedBody(sharedSystem, userTurn("q")), `"input_schema":{"type":"object"}`, `"input_schema":{"type":"object"},"cache_control":{"type":"ephemeral"}`, 1))
	if tool == nil || tool.N != 1 || tool.Keys[0] == base.Keys[0] {
		t.Fatalf("a short tool breakpoint and the system's: %+v", tool)
	}

	for _, c := range []struct{ name, body string }{
		{"a short prompt", cachedBody("Be brief.", userTurn("q"))},
		{"no breakpoint", strings.Replace(cachedBody(sharedSystem, userTurn("q")), `,"cache_control":{"type":"ephemeral"}`, "", 1)},
		{"a null cache_control", strings.Replace(cachedBody(sharedSystem, userTurn("q")), `{"type":"ephemeral"}`, "null", 1)},
		{"five breakpoints", cachedBody(sharedSystem, `[{"role":"user","content":[`+strings.Repeat(`{"type":"text","text":"x","cache_control":{"type":"ephemeral"}},`, 4)+`{"type":"text","text":"y"}]}]`)},
	} {
		if p := inspected(t, c.body); p != nil {
			t.Errorf("%s: keys %+v", c.name, p)
		}
	}
}

func TestARequestWithoutBreakpointsHasNoPrefix(t *testing.T) {
	body := []byte(`{"model":"claude-sonnet-4-5","max_tokens":16,"system":"` + sharedSystem + `","messages":` + userTurn("q") + `}`)
	g := &group{name: "g", affinity: true}
	in := &inbound{route: routeMessages, who: requester{key: &key{group: g}}}
	allocs := func() float64 {
		return testing.AllocsPerRun(100, func() {
			in.ask = asked{body: body}
			if rerr := in.inspect(); rerr != nil || in.ask.prefix != nil {
				t.Fatal("inspect", rerr)
			}
		})
	}
	on := allocs()
	g.affinity = false
	if off := allocs(); on != off && !memtest.Race { // the race detector allocates for itself
		t.Fatalf("inspect allocates %v times with affinity on, %v off, for a body without breakpoints", on, off)
	}
}

func TestAffinityTableExpiresAndRoutes(t *testing.T) {
	p := inspected(t, cachedBody(sharedSystem, userTurn("q")))
	tbl := affinity.NewTable(1024)
	a, b := &channel{name: "a", priority: 1, weight: 1}, &channel{name: "b", priority: 1, weight: 1}
	now := testNow
	if ch := tbl.Warm(&p.Prompt, now, nil); ch != "" {
		t.Fatalf("an empty table has %q", ch)
	}
	tbl.Record(&p.Prompt, "b", now, nil)
	if ch := tbl.Warm(&p.Prompt, now.Add(affinity.CacheTTL-time.Second), nil); ch != "b" {
		t.Fatalf("warm on %q before its TTL, want b", ch)
	}
	if ch := tbl.Warm(&p.Prompt, now.Add(affinity.CacheTTL), nil); ch != "" {
		t.Fatalf("warm on %q after its TTL", ch)
	}
	// a hit refreshes it, as the API refreshes its cache
	tbl.Record(&p.Prompt, "b", now.Add(4*time.Minute), nil)
	if ch := tbl.Warm(&p.Prompt, now.Add(8*time.Minute), nil); ch != "b" {
		t.Fatal("a refreshed record expired")
	}

	p.warm = "b"
	sel := &selection{model: p.Model}
	if ch := p.route([]*channel{a, b}, sel); ch != b || p.result != affinityWarm {
		t.Fatalf("routed to %v (%s), want b warm", ch, p.result)
	}
	if ch := p.route([]*channel{a}, sel); ch != nil || p.result != affinityMoved {
		t.Fatalf("routed to %v (%s) without b in the tier, want moved", ch, p.result)
	}
	sel.tried = []*channel{b}
	if ch := p.route([]*channel{a, b}, sel); ch != nil {
		t.Fatal("a failover went back to the channel it tried")
	}
	sel.tried, sel.model = nil, "claude-haiku-4-5"
	if ch := p.route([]*channel{a, b}, sel); ch != nil {
		t.Fatal("a fallback model went by the requested model's records")
	}
	p.warm = ""
	sel.model = p.Model
	if ch := p.route([]*channel{a, b}, sel); ch != nil || p.result != affinityCold {
		t.Fatalf("routed to %v (%s) without a record, want cold", ch, p.result)
	}
}

// BenchmarkAffinityLookup is the affinity's cost on the request path once
// the prefixes are digested: a lookup of a request's three prefixes in a
// full table (the longest misses, the next hits) and the first pick's
// routing among a tier of four channels. At most 2 µs.
func BenchmarkAffinityLookup(b *testing.B) {
	tbl := affinity.NewTable(affinity.MaxEntries)
	now := testNow
	var mix uint64 = 0x9e3779b97f4a7c15
	for i := range affinity.MaxEntries {
		tbl.Set(affinity.KeyOf(uint64(i)*mix, 5000+i), fmt.Sprintf("ch-%d", i%4), now.Add(time.Hour).UnixNano())
	}
	p := &cachePrefix{}
	p.N, p.Model = 3, "claude-sonnet-4-5"
	p.Keys[0], p.Keys[1], p.Keys[2] = affinity.KeyOf(1, 4100), affinity.KeyOf(7*mix, 5007), affinity.KeyOf(2, 90000)
	tier := []*channel{{name: "ch-0"}, {name: "ch-1"}, {name: "ch-2"}, {name: "ch-3"}}
	sel := &selection{model: p.Model}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		p.warm = tbl.Warm(&p.Prompt, now, nil)
		if p.route(tier, sel) == nil {
			b.Fatal("not warm")
		}
	}
}

// TestCacheReadRatioDropAlertOnSeries runs the alert of the rules file in
// promtool: a channel whose cache read ratio falls from 90% to 10% pages
// after 15 minutes below half its past level; one that holds 90% does not.
func TestCacheReadRatioDropAlertOnSeries(t *testing.T) {
	promtoolRulesTest(t, `rule_files: [%q]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'relay_tokens_total{group="g",channel="a",model="claude-sonnet-4-5",kind="cache_read"}'
        values: '0+900x400 360000+100x60'
      - series: 'relay_tokens_total{group="g",channel="a",model="claude-sonnet-4-5",kind="input"}'
        values: '0+100x400 40000+900x60'
      - series: 'relay_tokens_total{group="g",channel="b",model="claude-sonnet-4-5",kind="cache_read"}'
        values: '0+900x460'
      - series: 'relay_tokens_total{group="g",channel="b",model="claude-sonnet-4-5",kind="input"}'
        values: '0+100x460'
    alert_rule_test:
      - eval_time: 410m
        alertname: RelayCacheReadRatioDrop
        exp_alerts: []
      - eval_time: 455m
        alertname: RelayCacheReadRatioDrop
        exp_alerts:
          - exp_labels:
              severity: warning
              channel: a
            exp_annotations:
              summary: "Channel a: the prompt cache read ratio fell to 10%%, under half its level of the last six hours"
              description: "Prompts that read the cache now write it again, at 1.25 times the input price. relay_cache_affinity_total and relay_cache_miss_usd_total by reason tell whether the relay's routing moved them; otherwise the clients' prompts changed."
`)
}

// BenchmarkPrefixDigest is the digest of a coding agent's prompt (about
// 15,000 tokens of tools and system prompt, two breakpoints) before its
// first pick: one pass of xxhash over the prefix's bytes.
func BenchmarkPrefixDigest(b *testing.B) {
	in := &inbound{route: routeMessages, who: requester{key: &key{group: &group{name: "g", affinity: true}}},
		ask: asked{body: []byte(cachedBody(strings.Repeat(sharedSystem, 10), `[{"role":"user","content":[{"type":"text","text":"q","cache_control":{"type":"ephemeral"}}]}]`))}}
	if rerr := in.inspect(); rerr != nil {
		b.Fatal(rerr)
	}
	p := in.ask.prefix
	b.SetBytes(int64(len(in.ask.body)))
	b.ReportAllocs()
	for range b.N {
		if !p.Digest(42, "g", in.ask.model, in.ask.body) {
			b.Fatal("no key")
		}
	}
}

// TestHasBreakpointMark finds "cache_control" wherever it is, and nothing
// else that ends like it.
func TestHasBreakpointMark(t *testing.T) {
	for body, want := range map[string]bool{
		`"cache_control"`:                    true,
		`{"a":"b","cache_control":{}}`:       true,
		`{"x_control":1,"cache_control":{}}`: true,
		`{"my_control":1}`:                   false,
		`_control"`:                          false,
		`{"text":"cache_contro"}`:            false,
		`"cache__control"`:                   false,
		``:                                   false,
		`{"a":"` + strings.Repeat("_", 99) + `"}`: false,
	} {
		if got := hasBreakpointMark([]byte(body)); got != want {
			t.Errorf("hasBreakpointMark(%q) = %v", body, got)
		}
	}
}

// BenchmarkBreakpointMark is the search for a breakpoint in a 10 KB body
// without one, the cost every Messages request of a group with affinity
// pays.
func BenchmarkBreakpointMark(b *testing.B) {
	body := []byte(strings.Repeat(`{"type":"text","text":"the quick brown fox jumps"},`, 200))
	b.Run("hasBreakpointMark", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		for b.Loop() {
			if hasBreakpointMark(body) {
				b.Fatal("found")
			}
		}
	})
	b.Run("bytes.Contains", func(b *testing.B) { // what it replaced
		b.SetBytes(int64(len(body)))
		for b.Loop() {
			if bytes.Contains(body, breakpointMark) {
				b.Fatal("found")
			}
		}
	})
}
