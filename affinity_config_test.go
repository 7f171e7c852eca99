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
