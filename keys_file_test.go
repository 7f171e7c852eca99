package relay

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// writeKeysFile writes a keys file into the test's temporary directory.
func writeKeysFile(t *testing.T, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "keys.json")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// reloadForced posts the running config back to /load, as
// `caddy reload --force` does: Caddy reloads a config it already runs only
// when told to.
func reloadForced(t *testing.T) (int, string) {
	t.Helper()
	code, cfg := adminDo(t, http.MethodGet, "/config/", "")
	if code != 200 {
		t.Fatalf("GET /config/: %d %s", code, cfg)
	}
	return adminDo(t, http.MethodPost, "/load", cfg, "Cache-Control", "must-revalidate")
}

func TestKeysFileServesItsKeysAndAReloadReadsItAgain(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("hi"))
	const (
		aKey = "sk-kf-alpha-0123456789abcdef"
		bKey = "sk-kf-bravo-0123456789abcdef"
		cKey = "sk-kf-charlie-0123456789abcde"
	)
	// an array; b's secret is written as it is
	path := writeKeysFile(t, fmt.Sprintf(`[
  {"secret": %q, "group": "kf", "name": "kf-a", "rate": "2/m"},
  {"secret": %q, "group": "kf"}
]`, sha256Secret(aKey), bKey))
	startRelay(t, channelBlock("kf-ch", up.URL)+keyAndGroup("kf", "kf-ch")+"\t\tkeys_file "+path+"\n")

	as := func(key string) reply { return send(t, http.MethodPost, "/v1/messages", key, simpleBody) }
	want := func(when, key string, status int) {
		t.Helper()
		if r := as(key); r.status != status {
			t.Fatalf("%s: %s... got %d, want %d: %s", when, key[:10], r.status, status, r.body)
		}
	}
	want("the config's key", clientKey, 200)
	want("a", aKey, 200)
	want("a", aKey, 200)
	wantRelayError(t, as(aKey), 429, "rate_limit_error", "key_rate_limited")
	want("b", bKey, 200)
	wantRelayError(t, as(cKey), 401, "authentication_error", "")
	if up.Hits() != 4 {
		t.Errorf("the upstream was called %d times, want 4", up.Hits())
	}

	rows, body := keyRows(t)
	if rows["kf-a"].Limits.Rate != "2/m" || rows["kf-a"].Group != "kf" {
		t.Errorf("GET /relay/keys: kf-a is %s", show(rows["kf-a"]))
	}
	if _, ok := rows[keyName(&Key{}, digestOf(bKey))]; !ok {
		t.Errorf("GET /relay/keys does not list b by its default name: %s", body)
	}
	_, config := adminDo(t, http.MethodGet, "/config/", "")
	for _, secret := range []string{aKey, bKey} {
		if strings.Contains(body, secret) || strings.Contains(config, secret) {
			t.Errorf("a secret of the keys file is shown by the admin API")
		}
	}

	// b goes, c comes, one object a line; a reload reads the file again,
	// and a, whose limit was in use, keeps its spent quota
	if err := os.WriteFile(path, fmt.Appendf(nil, "{\"secret\": %q, \"group\": \"kf\", \"name\": \"kf-a\", \"rate\": \"2/m\"}\n{\"secret\": %q, \"group\": \"kf\"}\n",
		sha256Secret(aKey), sha256Secret(cKey)), 0o600); err != nil {
		t.Fatal(err)
	}
	if code, body := reloadForced(t); code != 200 {
		t.Fatalf("reload: %d %s", code, body)
	}
	want("after the reload, c", cKey, 200)
	wantRelayError(t, as(bKey), 401, "authentication_error", "")
	wantRelayError(t, as(aKey), 429, "rate_limit_error", "key_rate_limited")
	want("after the reload, the config's key", clientKey, 200)

	// a file that does not read fails the reload; the running config stays
	if err := os.WriteFile(path, []byte(`[{"secret": "sk-kf-broken", "group": "nope"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	code, body := reloadForced(t)
	if code == 200 || !strings.Contains(body, `line 1: key #1 names unknown group \"nope\"`) {
		t.Errorf("a broken keys file: %d %s", code, body)
	}
	want("after a failed reload, c", cKey, 200)
}

// provisionError provisions r and returns its error, cleaning up either way.
func provisionError(t *testing.T, r *Relay) error {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	err := r.Provision(ctx)
	_ = r.Cleanup()
	return err
}

func TestKeysFileErrorsNameTheLine(t *testing.T) {
	const secret = "sk-kferr-0123456789abcdefghij"
	good := func(name string) string {
		return fmt.Sprintf(`{"secret": %q, "group": "g", "name": %q}`, sha256Secret(secret+name), name)
	}
	for _, tt := range []struct {
		name, file string
		noFile     bool
		configKeys []*Key
		want       string
	}{
		{name: "unknown group", file: "[\n" + good("a") + ",\n" + `{"secret": "sha256:` + strings.Repeat("ab", 32) + `", "group": "nope"}` + "\n]",
			want: `line 3: key #2 names unknown group "nope"`},
		{name: "unknown field", file: good("a") + "\n" + `{"secret": "` + secret + `", "group": "g", "rates": "1/m"}`,
			want: `line 2: key #2: "rates" is not a field of a key`},
		{name: "a number for a secret", file: `[{"secret": 1234567890123, "group": "g"}]`, want: `line 1: key #1: field "secret": a JSON number where a string belongs`},
		{name: "not an object", file: `["` + secret + `"]`, want: `line 1: key #1: not an object with the fields of a key`},
		{name: "bad rate", file: `[{"secret": "` + secret + `", "group": "g", "rate": "lots"}]`, want: "line 1: key #1: rate"},
		{name: "bad digest", file: `[{"secret": "sha256:abc", "group": "g"}]`, want: "sha256: must be followed by 64 hex digits"},
		{name: "not JSON", file: "name,secret\nx,y\n", want: "line 1:"},
		{name: "not closed", file: "[\n" + good("a") + ",\n", want: "line 3:"},
		{name: "something after", file: "[" + good("a") + "]\n{}", want: "line 2: something follows the array of keys"},
		{name: "a name twice", file: good("a") + "\n" + good("a"), want: `line 2: key "a" and key #1 of the file have the same name "a"`},
		{name: "a config key's name", file: good("cfg"), configKeys: []*Key{{Secret: sha256Secret("sk-kferr-config-0123456789ab"), Group: "g", KeyOptions: KeyOptions{Name: "cfg"}}},
			want: `line 1: key "cfg" and the config's key #1 have the same name "cfg"`},
		{name: "a config key's secret", file: `[{"secret": "` + secret + `", "group": "g"}]`, configKeys: []*Key{{Secret: sha256Secret(secret), Group: "g"}},
			want: "keys_file, line 1: key #1 has the same secret as an earlier key"},
		{name: "no key anywhere", file: "[]", want: "holds no key"},
		{name: "no file", noFile: true, want: "no such file"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "absent.json")
			if !tt.noFile {
				path = writeKeysFile(t, tt.file)
			}
			r := &Relay{KeysFile: path, Keys: tt.configKeys,
				Channels: []*Channel{{Name: "kferr-ch", UpstreamRaw: upstream("mock")}},
				Groups:   []*Group{{Name: "g", Channels: []string{"kferr-ch"}}}}
			err := provisionError(t, r)
			if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), "keys_file") {
				t.Fatalf("got %v, want an error about the keys file with %q", err, tt.want)
			}
			if strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), "1234567890123") {
				t.Errorf("the error shows a secret: %v", err)
			}
		})
	}

	// an empty array is fine next to the config's keys
	r := &Relay{KeysFile: writeKeysFile(t, " [ ] \n"), Keys: []*Key{{Secret: sha256Secret(secret), Group: "g"}},
		Channels: []*Channel{{Name: "kferr-ch", UpstreamRaw: upstream("mock")}},
		Groups:   []*Group{{Name: "g", Channels: []string{"kferr-ch"}}}}
	if err := provisionError(t, r); err != nil {
		t.Fatal(err)
	}
}

// TestKeysTakeTheirStateAtTheirFirstRequest: a key costs its record until it
// serves a request, but a key with budgets, and a key whose state the
// config before a reload had taken, take theirs when the config loads.
func TestKeysTakeTheirStateAtTheirFirstRequest(t *testing.T) {
	var lines []string
	for _, name := range []string{"lazy-a", "lazy-b"} {
		lines = append(lines, fmt.Sprintf(`{"secret": %q, "group": "lazy", "name": %q, "rate": "100/m"}`, "sk-"+name+"-0123456789abcdefgh", name))
	}
	lines = append(lines, `{"secret": "sk-lazy-budget-0123456789abcdef", "group": "lazy", "name": "lazy-budget", "budgets": ["5usd/day"]}`)
	path := writeKeysFile(t, strings.Join(lines, "\n"))
	newRelay := func() *Relay {
		r := &Relay{KeysFile: path,
			Channels: []*Channel{{Name: "lazy-ch", UpstreamRaw: upstream("mock")}},
			Groups:   []*Group{{Name: "lazy", Channels: []string{"lazy-ch"}}}}
		provisionHandler(t, r)
		return r
	}
	refs := func(name string) int { n, _ := keyStates.References(name); return n }

	r := newRelay()
	if refs("lazy-a") != 0 || refs("lazy-b") != 0 || refs("lazy-budget") != 1 {
		t.Fatalf("after loading: references a %d, b %d, budget %d; want 0, 0, 1", refs("lazy-a"), refs("lazy-b"), refs("lazy-budget"))
	}
	rows, _ := keyRows(t)
	if row := rows["lazy-a"]; row.Limits.RateRemaining == nil || *row.Limits.RateRemaining != 100 || row.SpendUSD["day"] != 0 {
		t.Errorf("a key that served nothing: %s", show(row))
	}
	for range 2 {
		if w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-lazy-a-0123456789abcdefgh")); w.Code != 200 {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
	}
	if refs("lazy-a") != 1 || refs("lazy-b") != 0 {
		t.Fatalf("after a's requests: references a %d, b %d; want 1, 0", refs("lazy-a"), refs("lazy-b"))
	}
	rows, _ = keyRows(t)
	if row := rows["lazy-a"]; row.Limits.RateRemaining == nil || *row.Limits.RateRemaining != 98 {
		t.Errorf("a after two requests: %s", show(row))
	}

	// a reload: the new config takes a's state as it loads, so a keeps its
	// spent quota when the old config lets go of it
	r2 := newRelay()
	if refs("lazy-a") != 2 || refs("lazy-b") != 0 || refs("lazy-budget") != 2 {
		t.Fatalf("during the reload: references a %d, b %d, budget %d; want 2, 0, 2", refs("lazy-a"), refs("lazy-b"), refs("lazy-budget"))
	}
	_ = r.Cleanup()
	if k := r2.keys[digestOf("sk-lazy-a-0123456789abcdefgh")]; !k.active.Load() || k.limits != r.keys[digestOf("sk-lazy-a-0123456789abcdefgh")].limits {
		t.Fatal("the reloaded config does not hold a's limits")
	}
	rows, _ = keyRows(t)
	if row := rows["lazy-a"]; row.Limits.RateRemaining == nil || *row.Limits.RateRemaining != 98 {
		t.Errorf("a after the reload: %s", show(row))
	}
}

func TestCaddyfileKeysFile(t *testing.T) {
	r, err := parseRelay(t, "relay {\n\tkeys_file {env.HOME}/keys.json\n}")
	if err != nil {
		t.Fatal(err)
	}
	if r.KeysFile != "{env.HOME}/keys.json" {
		t.Errorf("keys_file = %q", r.KeysFile)
	}
	for _, bad := range []string{"relay {\n\tkeys_file\n}", "relay {\n\tkeys_file a b\n}", "relay {\n\tkeys_file a\n\tkeys_file b\n}"} {
		if _, err := parseRelay(t, bad); err == nil {
			t.Errorf("%q parses", bad)
		}
	}
}
