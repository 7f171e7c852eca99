package relay

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestAnthropicNameOfAModelID(t *testing.T) {
	for _, tt := range []struct{ id, want string }{
		{"claude-sonnet-4-5", "Claude Sonnet 4.5"},
		{"claude-sonnet-4-5-20250929", "Claude Sonnet 4.5"},
		{"claude-sonnet-4-5@20250929", "Claude Sonnet 4.5"},
		{"claude-sonnet-4-5[1m]", "Claude Sonnet 4.5"},
		{"claude-opus-4", "Claude Opus 4"},
		{"claude-opus-4-1", "Claude Opus 4.1"},
		{"claude-3-5-haiku", "Claude Haiku 3.5"},
		{"claude-3-5-haiku-20241022", "Claude Haiku 3.5"},
		{"claude-3-7-sonnet", "Claude Sonnet 3.7"},
		{"claude-3-haiku", "Claude Haiku 3"},
		{"claude-fable-5-1", "Claude Fable 5.1"},
		{"claude-mythos-5", "Claude Mythos 5"},
		{"claude-2-1", "Claude 2.1"},
		// not a Claude id of that shape: no name of its own
		{"my-finetune", ""},
		{"gpt-4o", ""},
		{"claude", ""},
		{"claude-instant", ""},
		{"claude-sonnet-4-5-thinking", ""},
		{"claude-3-haiku-4", ""},
		{"claude-sonnet-v2", ""},
		{"claude-sonnet-4-123", ""},
		{"claude--4", ""},
		{"Claude-Sonnet-4", ""},
		{"anthropic.claude-sonnet-4-5-20250929-v1:0", ""},
	} {
		if got := anthropicName(tt.id); got != tt.want {
			t.Errorf("anthropicName(%q) = %q, want %q", tt.id, got, tt.want)
		}
	}
}

func TestDisplayNameComesFromThePriceTable(t *testing.T) {
	pb := newPricebook(map[string]Price{
		"claude-sonnet-4-5": {Input: 3, Output: 15, DisplayName: "Sonnet (EU region)"},
		"claude-lyric-7":    {Input: 1, Output: 2},
		"my-finetune":       {Input: 1, Output: 2},
		"my-alias":          {Input: 1, Output: 2, DisplayName: "My Alias"},
	})
	for _, tt := range []struct{ id, want string }{
		{"claude-opus-4-1", "Claude Opus 4.1"},
		{"claude-opus-4-1-20250805", "Claude Opus 4.1"}, // a snapshot takes its row's name
		{"claude-haiku-4-5@20251001", "Claude Haiku 4.5"},
		{"claude-3-7-sonnet", "Claude Sonnet 3.7"},
		{"claude-sonnet-4-5", "Sonnet (EU region)"}, // the override
		{"claude-sonnet-4-5-20250929", "Sonnet (EU region)"},
		{"claude-sonnet-4-6", "Claude Sonnet 4.6"}, // not overridden: a row of its own
		{"claude-lyric-7", "Claude Lyric 7"},       // a configured row
		{"my-alias", "My Alias"},
		{"my-finetune", "my-finetune"},         // known, but no name of its own
		{"claude-opus-4-9", "claude-opus-4-9"}, // a newer version the table does not know
		{"gpt-4o", "gpt-4o"},
	} {
		m := pb.info(tt.id)
		if m.DisplayName != tt.want || m.ID != tt.id {
			t.Errorf("%s: id %q display_name %q, want %q", tt.id, m.ID, m.DisplayName, tt.want)
		}
	}
}

// listModels asks a catalog for GET /v1/models with query.
func listModels(t *testing.T, c *modelCatalog, query string) (ids []string, hasMore bool, first, last string) {
	t.Helper()
	in := &inbound{route: routeModels}
	in.who.key = &key{group: &group{catalog: c}}
	w := httptest.NewRecorder()
	if err := serveModels(w, httptest.NewRequest(http.MethodGet, "/v1/models?"+query, nil), in); err != nil {
		t.Fatalf("%s: %s", query, err.msg)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
		HasMore bool    `json:"has_more"`
		FirstID *string `json:"first_id"`
		LastID  *string `json:"last_id"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &list); err != nil || list.Data == nil {
		t.Fatalf("%s: %v: %s", query, err, w.Body)
	}
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if list.FirstID != nil {
		first, last = *list.FirstID, *list.LastID
	}
	return ids, list.HasMore, first, last
}

func TestModelsPagesForwardAndBackward(t *testing.T) {
	c := newModelCatalog([]string{"a", "b", "c", "d", "e"}, newPricebook(nil))
	for _, tt := range []struct {
		query   string
		want    string
		hasMore bool
	}{
		{"", "a b c d e", false},
		{"limit=2", "a b", true},
		{"limit=2&after_id=b", "c d", true},
		{"limit=2&after_id=d", "e", false},
		{"after_id=e", "", false},
		{"limit=2&before_id=e", "c d", true},
		{"limit=2&before_id=c", "a b", false},
		{"before_id=a", "", false},
		{"after_id=a&before_id=d", "b c", false},
		{"after_id=unknown", "a b c d e", false},
	} {
		ids, hasMore, first, last := listModels(t, c, tt.query)
		if strings.Join(ids, " ") != tt.want || hasMore != tt.hasMore {
			t.Errorf("%q: %v has_more %v, want %q has_more %v", tt.query, ids, hasMore, tt.want, tt.hasMore)
		}
		if len(ids) > 0 && (first != ids[0] || last != ids[len(ids)-1]) {
			t.Errorf("%q: first_id %q last_id %q of %v", tt.query, first, last, ids)
		}
	}
}

func TestPricingDisplayNameInTheCaddyfile(t *testing.T) {
	const rest = "\tchannel c {\n\t\tprovider mock\n\t}\n\tkey sk-relay-display-name-0123456789 g\n\tgroup g {\n\t\tchannels c\n\t}\n}"
	pricing := func(lines string) string { return "relay {\n\tpricing {\n" + lines + "\t}\n" + rest }
	r, err := parseRelay(t, pricing("\t\tclaude-sonnet-4-5 input 3 display_name \"Sonnet (EU region)\" output 15 above 200000 input 6 output 22.5\n"+
		"\t\tmy-alias display_name \"My Alias\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	if p := r.Pricing["claude-sonnet-4-5"]; p.DisplayName != "Sonnet (EU region)" || p.Output != 15 || p.LongPrompt == nil || p.LongPrompt.DisplayName != "" {
		t.Errorf("parsed %+v", p)
	}
	if p := r.Pricing["my-alias"]; p.DisplayName != "My Alias" {
		t.Errorf("a model the built-in list does not price may be named alone: %+v", p)
	}
	for line, want := range map[string]string{
		// renaming a listed model alone would price it at 0
		`claude-sonnet-4-5 display_name "Sonnet"`:              "give its input and output with display_name",
		`claude-sonnet-4-5-20250929 display_name "Sonnet"`:     "give its input and output with display_name",
		`m input 1 output 1 display_name`:                      `"display_name" needs a value`,
		`m input 1 output 1 display_name ""`:                   "display_name takes a name, once",
		`m input 1 output 1 display_name "a" display_name "b"`: "display_name takes a name, once",
	} {
		if _, err := parseRelay(t, pricing("\t\t"+line+"\n")); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error saying %q", line, err, want)
		}
	}
	long := Price{Input: 1, Output: 1, LongPrompt: &LongPromptPrice{Above: 10, Price: Price{Input: 2, Output: 2, DisplayName: "x"}}}
	if err := long.validate(); err == nil || !strings.Contains(err.Error(), "display_name") {
		t.Errorf("display_name inside long_prompt: %v", err)
	}
}
