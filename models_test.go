package relay

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/money"
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

// newPricebook is the relay's price table of configured prices: the
// configured rows over the built-in ones, named as Anthropic names them.
func newPricebook(configured map[string]Price) money.Pricebook {
	return money.NewPricebook(configured, anthropicName)
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
		m := modelInfoOf(pb, tt.id)
		if m.DisplayName != tt.want || m.ID != tt.id {
			t.Errorf("%s: id %q display_name %q, want %q", tt.id, m.ID, m.DisplayName, tt.want)
		}
	}
}

func TestThePriceTablesClaudeModelsNewestFirst(t *testing.T) {
	pb := money.Pricebook{}
	for _, m := range []string{"claude-3-haiku", "claude-opus-4", "claude-sonnet-4-5-20250929", "my-model", "claude-opus-4-1",
		"claude-3-7-sonnet", "claude-sonnet-4-5", "claude-haiku-4-5", "claude-custom", "claude-3-5-haiku", "claude-fable-5"} {
		pb[m] = &money.Rates{}
	}
	want := []string{"claude-fable-5", "claude-haiku-4-5", "claude-sonnet-4-5", "claude-sonnet-4-5-20250929", "claude-opus-4-1",
		"claude-opus-4", "claude-3-7-sonnet", "claude-3-5-haiku", "claude-3-haiku", "claude-custom"}
	for range 5 { // the map's order differs each time; the list's must not
		if got := claudeModels(pb); !slices.Equal(got, want) {
			t.Fatalf("got  %v\nwant %v", got, want)
		}
	}
	builtin := newPricebook(nil)
	all := claudeModels(builtin)
	if len(all) != len(builtin) || all[0] == "claude-3-haiku" || all[len(all)-1] != "claude-3-haiku" {
		t.Errorf("the built-in list, newest first: %v", all)
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
	c := newModelCatalog([]string{"a", "b", "c", "d", "e"}, false, newPricebook(nil))
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

// TestAChannelOfEveryModelListsThePriceTablesClaudeModels: a channel
// without a `models` line serves every model, so GET /v1/models lists,
// after the models the group's other channels list, the Claude models of
// the price table (built in and configured), with their names; Claude
// Code's discovery request (both credentials, limit=1000) gets it at once.
func TestAChannelOfEveryModelListsThePriceTablesClaudeModels(t *testing.T) {
	listing := fakeupstream.New(t, fakeupstream.Message("listing"))
	every := fakeupstream.New(t, fakeupstream.Message("every"))
	startRelay(t, "\t\tpricing {\n\t\t\tclaude-sonnet-4-5 input 3 output 15 display_name \"Sonnet (EU region)\"\n"+
		"\t\t\tclaude-lyric-7 input 1 output 2\n\t\t\tmy-finetune input 1 output 2\n\t\t}\n"+
		channelBlock("catalog-listing", listing.URL, "models my-alias=claude-haiku-4-5 claude-sonnet-4-5")+
		channelBlock("catalog-every", every.URL)+keyAndGroup("catalog", "catalog-listing catalog-every"))

	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	req, _ := http.NewRequest(http.MethodGet, relayURL+"/v1/models?limit=1000", nil)
	req.Header.Set("X-Api-Key", clientKey)
	req.Header.Set("Authorization", "Bearer "+clientKey)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	resp, err := noRedirect.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Data []struct {
			ID          string `json:"id"`
			DisplayName string `json:"display_name"`
			Type        string `json:"type"`
		} `json:"data"`
		HasMore bool `json:"has_more"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /v1/models?limit=1000 with both credentials: %d %v", resp.StatusCode, err)
	}
	var ids []string
	names := map[string]string{}
	for _, m := range list.Data {
		ids = append(ids, m.ID)
		names[m.ID] = m.DisplayName
	}
	want := append([]string{"my-alias", "claude-sonnet-4-5"}, slices.DeleteFunc(claudeModels(newPricebook(map[string]Price{"claude-lyric-7": {}})),
		func(m string) bool { return m == "claude-sonnet-4-5" })...)
	if !slices.Equal(ids, want) || list.HasMore {
		t.Fatalf("GET /v1/models: the listed models, then the price table's Claude models newest first:\n got  %v\nwant %v (has_more %v)", ids, want, list.HasMore)
	}
	if slices.Contains(ids, "my-finetune") {
		t.Error("a price row that is not a Claude model must not be listed")
	}
	for id, want := range map[string]string{
		"my-alias":          "my-alias", // the table does not know it: its id
		"claude-sonnet-4-5": "Sonnet (EU region)",
		"claude-lyric-7":    "Claude Lyric 7",
		"claude-opus-4-1":   "Claude Opus 4.1",
		"claude-3-5-haiku":  "Claude Haiku 3.5",
		"claude-fable-5-1":  "Claude Fable 5.1",
	} {
		if names[id] != want {
			t.Errorf("%s: display_name %q, want %q", id, names[id], want)
		}
	}

	// paging walks the same list
	var walked []string
	for after := ""; ; {
		r := send(t, http.MethodGet, "/v1/models?limit=7&after_id="+after, clientKey, "")
		var page struct {
			Data []struct {
				ID string `json:"id"`
			} `json:"data"`
			HasMore bool   `json:"has_more"`
			LastID  string `json:"last_id"`
		}
		if err := json.Unmarshal(r.body, &page); err != nil || r.status != 200 {
			t.Fatalf("page after %q: %d %s", after, r.status, r.body)
		}
		for _, m := range page.Data {
			walked = append(walked, m.ID)
		}
		if !page.HasMore {
			break
		}
		after = page.LastID
	}
	if !slices.Equal(walked, ids) {
		t.Errorf("pages of 7:\n got  %v\nwant %v", walked, ids)
	}

	for id, want := range map[string]string{
		"claude-sonnet-4-5-20250929": "Sonnet (EU region)", // a snapshot: the every-model channel serves it
		"claude-opus-4-1":            "Claude Opus 4.1",
		"my-alias":                   "my-alias",
	} {
		r := send(t, http.MethodGet, "/v1/models/"+id, clientKey, "")
		var m struct {
			ID          string `json:"id"`
			DisplayName string `json:"display_name"`
		}
		if err := json.Unmarshal(r.body, &m); err != nil || r.status != 200 || m.ID != id || m.DisplayName != want {
			t.Errorf("GET /v1/models/%s: %d %s, want display_name %q", id, r.status, r.body, want)
		}
	}
	wantRelayError(t, send(t, http.MethodGet, "/v1/models/gpt-4o", clientKey, ""), 404, "not_found_error", "")

	// a model only the every-model channel serves goes there; the lists
	// were answered locally
	if r := message(t, `{"model":"claude-opus-4-1","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 {
		t.Errorf("claude-opus-4-1: %d %s", r.status, r.body)
	}
	if listing.Hits() != 0 || every.Hits() != 1 {
		t.Errorf("upstream hits: listing %d, every %d; GET /v1/models must be answered locally", listing.Hits(), every.Hits())
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
	if err := long.Validate(); err == nil || !strings.Contains(err.Error(), "display_name") {
		t.Errorf("display_name inside long_prompt: %v", err)
	}
}
