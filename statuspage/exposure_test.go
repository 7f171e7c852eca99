package statuspage

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"
	"golang.org/x/crypto/bcrypt"
)

// TestAnOpenStatusPageIsWarnedOfAtLoad: a relay_status that any client on
// the network may reach (its server listens beyond loopback) without an
// authentication handler on the way to it gets a warning when the config
// loads, naming its site; one behind basic_auth or forward_auth, or on a
// site bound to loopback, gets none. An authentication that covers other
// requests only (another path, or a matcher a client may dodge) does not
// count.
func TestAnOpenStatusPageIsWarnedOfAtLoad(t *testing.T) {
	hash, err := bcrypt.GenerateFromPassword([]byte("right-password"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	auth := "\tbasic_auth {\n\t\toncall " + string(hash) + "\n\t}\n"
	for _, c := range []struct {
		name, sites string
		warn        string // the site the warning names; "" for none
	}{
		{"public, no login", "http://status.example:9180 {\n\trelay_status\n}\n", "http://status.example:9180"},
		{"public, no host, under a path", ":9180 {\n\trelay_status /status/*\n}\n", ":9180"},
		{"behind basic_auth", "http://status.example:9180 {\n" + auth + "\trelay_status\n}\n", ""},
		{"behind basic_auth in a handle block", "http://status.example:9180 {\n\thandle /status/* {\n" + auth + "\t\trelay_status\n\t}\n}\n", ""},
		{"behind basic_auth of the same path", "http://status.example:9180 {\n\tbasic_auth /status/* {\n\t\toncall " + string(hash) + "\n\t}\n\trelay_status /status/*\n}\n", ""},
		{"behind forward_auth", "http://status.example:9180 {\n\tforward_auth 127.0.0.1:9 {\n\t\turi /verify\n\t}\n\trelay_status\n}\n", ""},
		{"basic_auth of another path", "http://status.example:9180 {\n\tbasic_auth /other/* {\n\t\toncall " + string(hash) + "\n\t}\n\trelay_status\n}\n", "http://status.example:9180"},
		{"basic_auth a client may dodge", "http://status.example:9180 {\n\t@signin header Authorization \"Basic *\"\n\tbasic_auth @signin {\n\t\toncall " + string(hash) + "\n\t}\n\trelay_status\n}\n", "http://status.example:9180"},
		{"bound to 127.0.0.1", "http://status.example:9180 {\n\tbind 127.0.0.1\n\trelay_status\n}\n", ""},
		{"bound to localhost", ":9180 {\n\tbind localhost\n\trelay_status\n}\n", ""},
		{"bound to 127.0.0.1 and a public address", ":9180 {\n\tbind 127.0.0.1 0.0.0.0\n\trelay_status\n}\n", "0.0.0.0:9180 127.0.0.1:9180"},
	} {
		t.Run(c.name, func(t *testing.T) {
			warnings := statusWarnings(t, c.sites)
			switch {
			case c.warn == "" && len(warnings) > 0:
				t.Errorf("warned of a guarded page: %v", warnings)
			case c.warn != "" && len(warnings) != 1:
				t.Errorf("%d warnings of an open page, want 1: %v", len(warnings), warnings)
			case c.warn != "":
				w := warnings[0]
				if site, _ := w["site"].(string); site != c.warn {
					t.Errorf("the warning names site %q, want %q: %v", site, c.warn, w)
				}
				if msg, _ := w["msg"].(string); !strings.Contains(msg, c.warn) || !strings.Contains(msg, "basic_auth") {
					t.Errorf("the warning's message does not name the site and a remedy: %q", msg)
				}
			}
		})
	}
}

// statusWarnings loads sites (Caddyfile site blocks) into a running Caddy
// whose log goes to a file, and returns the status page's warnings of an
// open page, decoded. Its ports (admin 2998, sites 9180) are not the root
// package's (2999, 9080): go test ./... runs both packages at once.
func statusWarnings(t *testing.T, sites string) []map[string]any {
	t.Helper()
	caddyLog := filepath.Join(t.TempDir(), "caddy.log")
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: 2998})
	tester.InitServer("{\n\tadmin localhost:2998\n\thttp_port 9180\n\thttps_port 9543\n\tskip_install_trust\n\tgrace_period 1ns\n"+
		"\tlog {\n\t\toutput file "+caddyLog+"\n\t\tformat json\n\t}\n}\n"+sites, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	raw, err := os.ReadFile(caddyLog)
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	for line := range strings.SplitSeq(string(raw), "\n") {
		var e map[string]any
		if json.Unmarshal([]byte(line), &e) != nil {
			continue
		}
		if e["logger"] == "http.handlers.relay_status" && e["level"] == "warn" {
			out = append(out, e)
		}
	}
	return out
}
