package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestAProviderFromAnotherRepositoryBuildsIn builds this binary with one
// more import, the example provider examples/provider/echo (a package that
// uses only the relay's provider package), as xcaddy's --with would, and
// serves a request through it from a Caddyfile channel. The import is laid
// over the package with -overlay, so nothing is written to the checkout
// and the build needs nothing but the module cache.
func TestAProviderFromAnotherRepositoryBuildsIn(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs a caddy binary")
	}
	dir := t.TempDir()
	here, err := filepath.Abs("with_echo.go")
	if err != nil {
		t.Fatal(err)
	}
	withEcho := filepath.Join(dir, "with_echo.go")
	if err := os.WriteFile(withEcho, []byte("package main\n\nimport _ \"github.com/caddy-relay/relay/examples/provider/echo\"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	overlay, _ := json.Marshal(map[string]any{"Replace": map[string]string{here: withEcho}})
	overlayFile := filepath.Join(dir, "overlay.json")
	if err := os.WriteFile(overlayFile, overlay, 0o600); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "caddy")
	if out, err := exec.Command("go", "build", "-overlay", overlayFile, "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build with the echo provider: %v\n%s", err, out)
	}
	if out, err := exec.Command(bin, "list-modules").CombinedOutput(); err != nil || !strings.Contains(string(out), "http.handlers.relay.providers.echo\n") {
		t.Fatalf("caddy list-modules lacks the echo provider (%v):\n%s", err, out)
	}

	site, admin := freePort(t), freePort(t)
	config := filepath.Join(dir, "Caddyfile")
	src := fmt.Sprintf(`{
	admin %s
}
http://%s {
	relay {
		key sk-echo-0123456789abcdef echo
		channel parrot {
			provider echo
			prefix "parrot: "
		}
		group echo {
			channels parrot
			expose_channel
		}
	}
}
`, admin, site)
	if err := os.WriteFile(config, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	runCaddy(t, bin, config)

	req, _ := http.NewRequest(http.MethodPost, "http://"+site+"/v1/messages",
		strings.NewReader(`{"model":"claude-sonnet-5-5","max_tokens":16,"messages":[{"role":"user","content":[{"type":"text","text":"Polly wants a cracker"}]}]}`))
	req.Header.Set("X-Api-Key", "sk-echo-0123456789abcdef")
	req.Header.Set("Anthropic-Version", "2023-06-01")
	req.Header.Set("Content-Type", "application/json")
	resp, err := fleetClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var msg struct {
		Type    string `json:"type"`
		Content []struct{ Text string }
		Usage   struct {
			OutputTokens int `json:"output_tokens"`
		}
	}
	if err := json.Unmarshal(body, &msg); err != nil || resp.StatusCode != 200 || msg.Type != "message" ||
		len(msg.Content) != 1 || msg.Content[0].Text != "parrot: Polly wants a cracker" || msg.Usage.OutputTokens == 0 {
		t.Fatalf("%d %s (%v)", resp.StatusCode, body, err)
	}
	if ch := resp.Header.Get("X-Relay-Channel"); ch != "parrot" {
		t.Errorf("served by %q, want the echo channel", ch)
	}

	// what the provider cannot carry is the client's 400, not a failure
	// of the channel
	req, _ = http.NewRequest(http.MethodPost, "http://"+site+"/v1/messages",
		strings.NewReader(`{"model":"claude-sonnet-5-5","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`))
	req.Header = resp.Request.Header.Clone()
	resp, err = fleetClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ = io.ReadAll(resp.Body)
	if resp.StatusCode != 400 || !strings.Contains(string(body), "(provider echo) answers whole messages only") {
		t.Errorf("a stream: %d %s", resp.StatusCode, body)
	}
}
