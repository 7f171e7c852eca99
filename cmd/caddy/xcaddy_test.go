package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// xcaddyVersion is the xcaddy the test installs: pinned, so that a new
// xcaddy release cannot change what the test checks.
const xcaddyVersion = "v0.4.5"

// TestXcaddyBuildsTheLocalCheckout runs the xcaddy command that
// docs/operations.md gives for a local checkout, as written, in the
// repository root, and checks the binary it builds. It needs the Go module
// proxy and takes minutes on a cold build cache (seconds on a warm one), so
// it runs only when CI=true (CI sets it) or RELAY_TEST_XCADDY=1.
func TestXcaddyBuildsTheLocalCheckout(t *testing.T) {
	if testing.Short() {
		t.Skip("builds Caddy with xcaddy")
	}
	if os.Getenv("CI") != "true" && os.Getenv("RELAY_TEST_XCADDY") != "1" {
		t.Skip("set RELAY_TEST_XCADDY=1 to build the checkout with xcaddy (CI=true does too)")
	}

	// The command, from the documentation.
	ops, err := os.ReadFile(filepath.Join(repoRoot, "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`(?m)^xcaddy build \S+ --with github\.com/caddy-relay/relay@\S+=\.$`).Find(ops)
	if line == nil {
		t.Fatal("docs/operations.md has no `xcaddy build <caddy version> --with github.com/caddy-relay/relay@<version>=.` line")
	}
	args := strings.Fields(string(line))[1:]

	// The Caddy version it pins must be the one go.mod builds with.
	goMod, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	caddy := regexp.MustCompile(`(?m)^\s*github\.com/caddyserver/caddy/v2 (\S+)`).FindSubmatch(goMod)
	if caddy == nil {
		t.Fatal("go.mod does not require github.com/caddyserver/caddy/v2")
	}
	if args[1] != string(caddy[1]) {
		t.Fatalf("docs/operations.md builds Caddy %s, go.mod requires %s: update the docs", args[1], caddy[1])
	}

	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	dir := t.TempDir()
	install := exec.CommandContext(ctx, "go", "install", "github.com/caddyserver/xcaddy/cmd/xcaddy@"+xcaddyVersion)
	install.Env = append(os.Environ(), "GOBIN="+dir)
	if out, err := install.CombinedOutput(); err != nil {
		t.Fatalf("go install xcaddy: %v\n%s", err, out)
	}

	bin := filepath.Join(dir, "caddy")
	start := time.Now()
	build := exec.CommandContext(ctx, filepath.Join(dir, "xcaddy"), append(args, "--output", bin)...)
	build.Dir = repoRoot
	build.WaitDelay = 10 * time.Second
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("xcaddy %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	t.Logf("xcaddy %s: %v", strings.Join(args, " "), time.Since(start).Round(time.Second))

	out, err := exec.Command(bin, "list-modules").CombinedOutput()
	if err != nil {
		t.Fatalf("caddy list-modules: %v\n%s", err, out)
	}
	// the status page and its check of an open page are a package of the
	// relay's own, which the relay imports
	for _, m := range []string{"http.handlers.relay", "admin.api.relay", "http.handlers.relay.providers.mock", "http.handlers.relay_status", "relay_status_exposure"} {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(m) + `$`).Match(out) {
			t.Errorf("the xcaddy binary lacks the module %s:\n%s", m, out)
		}
	}
	version, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(version), string(caddy[1])) {
		t.Errorf("caddy version: %v %s, want %s", err, version, caddy[1])
	}
}
