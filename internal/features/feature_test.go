package features

import (
	"net/http"
	"slices"
	"strings"
	"testing"
)

// TestFeatureTable checks the table against the code that reads requests:
// every field row is found by OfField, every tool row by its prefix,
// the known rows come first and fit the set, and every beta row has a
// beta's shape.
func TestFeatureTable(t *testing.T) {
	if numKnown > 32 {
		t.Fatalf("%d known features do not fit a Set", numKnown)
	}
	seen := map[string]bool{}
	for i, r := range table {
		if seen[r.name] {
			t.Errorf("%s is in the table twice", r.name)
		}
		seen[r.name] = true
		if KindOf(r.name) != r.kind || Names()[i] != r.name {
			t.Errorf("%s: KindOf or Names does not read the table's row %d", r.name, i)
		}
		if (i < numKnown) != (r.kind != KindBeta) {
			t.Errorf("%s: the known features must come before the betas", r.name)
		}
		switch r.kind {
		case KindField:
			if OfField(r.name) != 1<<i {
				t.Errorf("OfField(%q) = %b, want bit %d", r.name, OfField(r.name), i)
			}
		case KindTool:
			if OfTool(r.prefix+"20250101") != 1<<i || !strings.HasSuffix(r.prefix, "_") {
				t.Errorf("OfTool of %s's prefix %q is not its bit", r.name, r.prefix)
			}
		case KindBeta:
			if !datedBeta(r.name) {
				t.Errorf("%s has not the shape of a beta", r.name)
			}
		}
		if r.kind != KindBeta && isBetaName(r.name) {
			t.Errorf("%s looks like a beta", r.name)
		}
	}
	for _, name := range []string{"model", "stream", "metadata", "tools", "temperature", "messages"} {
		if OfField(name) != 0 {
			t.Errorf("%s is no feature", name)
		}
	}
	if OfTool("custom") != 0 || OfTool("bash_20250124") != 0 || OfTool("web_search") != 0 {
		t.Error("only a server tool's versioned type is a feature")
	}
}

func TestDatedBeta(t *testing.T) {
	for name, want := range map[string]bool{
		"context-1m-2025-08-07": true, "claude-code-20250219": true, "x-2030-01-01": true,
		"mcp-servers": false, "context-1m-2025-08": false, "context-1m-2025-08-0x": false, "a-2025021": false,
		"Context-1m-2025-08-07": false, "-2025-08-07": false, "2025-08-07": false, "web_search": false,
	} {
		if got := datedBeta(name); got != want {
			t.Errorf("datedBeta(%q) = %v, want %v", name, got, want)
		}
	}
}

func TestReadBetas(t *testing.T) {
	var n Needs
	h := http.Header{"Anthropic-Beta": {" a-1 ,b-2,, a-1", "c-3"}}
	if !n.ReadBetas(h) || !slices.Equal(n.Betas, []string{"a-1", "b-2", "c-3"}) {
		t.Errorf("betas = %q, want a-1 b-2 c-3, each once", n.Betas)
	}
	if !n.HasBeta("b-2") || n.HasBeta("d-4") {
		t.Error("hasBeta is wrong")
	}
}

func TestStripBody(t *testing.T) {
	body := []byte(`{"model":"m","mcp_servers":[{"url":"u"}],"tools":[{"type":"web_search_20250305","name":"w"},{"name":"f","input_schema":{}},{"type":"web_fetch_20250910"}],"max_tokens":1}`)
	out, err := StripBody(body, Bit("mcp_servers")|Bit("web_search")|Bit("web_fetch"))
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"model":"m","tools":[{"name":"f","input_schema":{}}],"max_tokens":1}`; string(out) != want {
		t.Errorf("stripped:\n%s\nwant\n%s", out, want)
	}
	out, _ = StripBody(out, Bit("web_search")|Bit("mcp_servers"))
	if want := `{"model":"m","tools":[{"name":"f","input_schema":{}}],"max_tokens":1}`; string(out) != want {
		t.Errorf("stripping what is not there changed the body: %s", out)
	}
	only := []byte(`{"model":"m","tools":[{"type":"code_execution_20250825","name":"c"}]}`)
	if out, _ := StripBody(only, Bit("code_execution")); string(out) != `{"model":"m"}` {
		t.Errorf("a tools array left empty goes: %s", out)
	}
	h := StripBetas(http.Header{"Anthropic-Beta": {"a-1,b-2", "c-3, b-2"}, "X-Api-Key": {"k"}}, []string{"b-2"})
	if got := h.Values("Anthropic-Beta"); !slices.Equal(got, []string{"a-1,c-3"}) || h.Get("X-Api-Key") != "k" {
		t.Errorf("stripped header = %v", h)
	}
}
