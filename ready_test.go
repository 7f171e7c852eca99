package relay

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddytest"
)

// TestAStartSaysWhatItLoaded: a config load logs, for each relay, how many
// channels, groups and keys it loaded, and where the status page listens.
func TestAStartSaysWhatItLoaded(t *testing.T) {
	caddyLog := filepath.Join(t.TempDir(), "caddy.log")
	tester := caddytest.NewTester(t)
	tester.InitServer(`{
	admin localhost:2999
	http_port 9080
	https_port 9443
	skip_install_trust
	grace_period 1ns
	log {
		output file `+caddyLog+`
	}
}
http://localhost:9080 {
	relay {
		key sk-ready-one-0123456789abcdef ready
		key sk-ready-two-0123456789abcdef ready
		channel ready-a {
			provider mock
		}
		channel ready-b {
			provider mock
		}
		group ready {
			channels ready-a ready-b
		}
	}
}
http://127.0.0.1:9080 {
	relay_status
}
`, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	b, err := os.ReadFile(caddyLog)
	if err != nil {
		t.Fatal(err)
	}
	logs := string(b)
	for _, want := range []string{
		`"msg":"relay ready: 2 channels, 1 group, 2 keys","channels":2,"groups":1,"keys":2`,
		`"msg":"relay status page at http://localhost:9080/"`,
	} {
		if !strings.Contains(logs, want) {
			t.Errorf("the start's log lacks %s:\n%s", want, logs)
		}
	}
	if strings.Contains(logs, "sk-ready") {
		t.Error("the start's log shows a key")
	}
}
