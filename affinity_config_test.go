package relay

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestCacheAffinityAdapts reads cache_affinity from the Caddyfile into
// the JSON config, which provisions a group with affinity on by default
// and off with `cache_affinity off`.
func TestCacheAffinityAdapts(t *testing.T) {
	out, err := adaptCaddyfile(`:8080 {
	relay {
		key sk-aff-adapt-0123456789 on
		key sk-aff-adapt-9876543210 off
		channel aff-adapt {
			provider mock
		}
		group on {
			channels aff-adapt
		}
		group off {
			channels aff-adapt
			cache_affinity off
		}
	}
}
`)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	groups := findHandler(cfg, "relay")["groups"].([]any)
	if _, set := groups[0].(map[string]any)["cache_affinity"]; set {
		t.Errorf("a group without the option has cache_affinity in its JSON: %v", groups[0])
	}
	if v, set := groups[1].(map[string]any)["cache_affinity"]; !set || v != false {
		t.Errorf("cache_affinity off adapts to %v, want false", groups[1])
	}

	var r Relay
	b, _ := json.Marshal(findHandler(cfg, "relay"))
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	provisionHandler(t, &r)
	if g := r.groups["on"]; !g.affinity || g.table == nil {
		t.Error("a group is provisioned without affinity by default")
	}
	if g := r.groups["off"]; g.affinity || g.table != nil {
		t.Error("a group with cache_affinity off is provisioned with affinity")
	}

	for _, bad := range []string{"cache_affinity", "cache_affinity no", "cache_affinity off on"} {
		_, err := parseRelay(t, "relay {\n\tkey k g\n\tchannel a {\n\t\tapi_key x\n\t}\n\tgroup g {\n\t\tchannels a\n\t\t"+bad+"\n\t}\n}")
		if err == nil || !strings.Contains(err.Error(), "cache_affinity takes on or off") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

// inspectVerdict is inspect's answer to body for a group with affinity on
// or off: "" when it takes it (and then its prefixes are digested).
func inspectVerdict(body []byte, on bool) string {
	in := &inbound{route: routeMessages, who: requester{key: &key{group: &group{name: "g", affinity: on}}}, ask: asked{body: body}}
	if rerr := in.inspect(); rerr != nil {
		return rerr.msg
	}
	if p := in.ask.prefix; p != nil {
		p.Digest(1, "g", in.ask.model, in.ask.body) // must not panic, whatever the body
	}
	return ""
}

// breakpointBodies are bodies with cache_control, valid and not, that the
// walk into system and messages must judge as the scan without it does.
var breakpointBodies = []string{
	`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}]}]}`,
	`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"},"text":"b"}]}]}`,
	`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"a","cache_control":{"type":"ephemeral"}}]}`,
	`{"model":"m","max_tokens":1,"messages":{"cache_control":1},"system":7}`,
	`{"model":"m","max_tokens":1,"system":[{"cache_control":{"type":"ephemeral"},"cache_control":null}],"messages":[]}`,
	`{"model":"m","max_tokens":1,"system":[1,"x",null,{"cache_control":[]}],"messages":[[[]],{"content":[{"content":[{"content":[{"cache_control":{}}]}]}]}]}`,
	`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"\ud800","cache_control":{"type":"ephemeral"}}]}]}`,
	`{"model":"m","max_tokens":1,"messages":[],"cache_control":{"type":"ephemeral","ttl":"1h"}} {}`,
	`{"model":"m","max_tokens":1,"tools":[{"name":"t","cache_control":{"type":"ephemeral"},"name":"u"}],"messages":[]}`,
}

func TestBreakpointWalkJudgesBodiesAsTheScanDoes(t *testing.T) {
	for _, b := range breakpointBodies {
		if on, off := inspectVerdict([]byte(b), true), inspectVerdict([]byte(b), false); on != off {
			t.Errorf("%s: with affinity %q, without %q", b, on, off)
		}
	}
}

// FuzzBreakpointWalk holds the walk into system and messages to the same
// verdict as the scan without it, on any body.
func FuzzBreakpointWalk(f *testing.F) {
	for _, b := range breakpointBodies {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if on, off := inspectVerdict(body, true), inspectVerdict(body, false); on != off {
			t.Errorf("%q: with affinity %q, without %q", body, on, off)
		}
	})
}
