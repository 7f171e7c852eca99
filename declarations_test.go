package relay

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddytest"
)

// twoSites renders a Caddyfile with a relay in two sites of one config.
func twoSites(first, second string) string {
	return testGlobal + "http://localhost:9080 {\n\trelay {\n" + first + "\t}\n}\nhttp://127.0.0.1:9080 {\n\trelay {\n" + second + "\t}\n}\n"
}

func TestTwoSitesThatDeclareAChannelAlikeShareItsState(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Error(500, "api_error", "down"))
	block := channelBlock("own-shared", up.URL, "concurrency 3") + keyAndGroup("own", "own-shared")
	caddytest.NewTester(t).InitServer(twoSites(block, block), "caddyfile")

	// a failure seen through one site cools the channel for the other: one
	// credential, one health
	if r := message(t, simpleBody); r.status != 500 {
		t.Fatalf("first site: %d %s", r.status, r.body)
	}
	req, _ := http.NewRequest(http.MethodPost, "http://127.0.0.1:9080/v1/messages", strings.NewReader(simpleBody))
	req.Header.Set("X-Api-Key", clientKey)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || up.Hits() != 1 {
		t.Errorf("second site: %d after the first site's failure (upstream hits %d); the cooldown is shared", resp.StatusCode, up.Hits())
	}
	if st := channels(t)["own-shared"]; st.State != stateCooldown || len(st.Groups) != 1 {
		t.Errorf("own-shared: %+v", st)
	}
}

func TestTwoSitesThatDeclareANameDifferentlyFailTheLoad(t *testing.T) {
	a := channelBlock("own-clash", "http://127.0.0.1:1", "concurrency 1") + keyAndGroup("own-g", "own-clash")
	b := channelBlock("own-clash", "http://127.0.0.1:1", "concurrency 50") + keyAndGroup("own-g", "own-clash")
	// adapting names the channel, both blocks' lines and the field
	_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(twoSites(a, b)), map[string]any{"filename": "Caddyfile"})
	if err == nil {
		t.Fatal("a config whose sites declare channel own-clash differently adapted")
	}
	for _, want := range []string{`channel own-clash`, "the relay block at Caddyfile:9", "the relay block at Caddyfile:23", "they differ in concurrency"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}

	// loading JSON (as POST /load does) names the handlers; groups and
	// keys are held to the same rule, and a secret is never quoted
	const (
		keys     = `{"secret":"sk-one-secret-0123456789","group":"own-y","name":"own-k"}`
		channels = `{"name":"own-x","upstream":{"provider":"mock"}}`
		groups   = `{"name":"own-y","channels":["own-x"]}`
	)
	handler := func(keys, channels, groups string) string {
		return `{"handler":"relay","keys":[` + keys + `],"channels":[` + channels + `],"groups":[` + groups + `]}`
	}
	for name, second := range map[string]string{
		"channel own-x": handler(keys, `{"name":"own-x","upstream":{"provider":"mock","fail_rate":0.5}}`, groups),
		"group own-y":   handler(keys, channels, `{"name":"own-y","channels":["own-x"],"retries":0}`),
		"key own-k":     handler(`{"secret":"sk-the-other-secret-0123456789","group":"own-y","name":"own-k"}`, channels, groups),
	} {
		cfg := `{"apps":{"http":{"servers":{"s":{"listen":[":9080"],"routes":[{"handle":[` +
			handler(keys, channels, groups) + `,` + second + `]}]}}}}}`
		err := caddy.Validate(mustConfig(t, cfg))
		if err == nil {
			t.Errorf("%s: two handlers declaring it differently validated", name)
			continue
		}
		for _, want := range []string{name, "relay handler #1", "relay handler #2", "they differ in"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not say %q", err, want)
			}
		}
		if strings.Contains(err.Error(), "sk-") {
			t.Errorf("error %q quotes a secret", err)
		}
	}
	// the same declarations in both handlers are no conflict
	same := `{"apps":{"http":{"servers":{"s":{"listen":[":9080"],"routes":[{"handle":[` +
		handler(keys, channels, groups) + `,` + handler(keys, channels, groups) + `]}]}}}}}`
	if err := caddy.Validate(mustConfig(t, same)); err != nil {
		t.Errorf("identical declarations: %v", err)
	}
}

func mustConfig(t *testing.T, s string) *caddy.Config {
	t.Helper()
	var cfg caddy.Config
	if err := json.Unmarshal([]byte(s), &cfg); err != nil {
		t.Fatal(err)
	}
	return &cfg
}
