package main

// The binary as a user runs it: built once (TestMain), started with the
// README's quickstart config, spoken to with the official Anthropic Go SDK.

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
)

// caddyBin is the binary TestMain builds from this package, the one the
// README tells users to run.
var caddyBin string

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "caddy-relay-bin")
	if err != nil {
		panic(err)
	}
	caddyBin = filepath.Join(dir, "caddy")
	if !testing.Short() {
		if out, err := exec.Command("go", "build", "-o", caddyBin, ".").CombinedOutput(); err != nil {
			fmt.Fprintf(os.Stderr, "go build ./cmd/caddy: %v\n%s", err, out)
			os.Exit(1)
		}
	}
	// the relays the tests start keep their data (the keys' spend) in a
	// directory of their own, not the user's
	_ = os.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// runCaddy starts `caddy run --config <file>` and returns once Caddy logs
// that it serves the config; the process is stopped when the test ends.
func runCaddy(t *testing.T, bin, config string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, "run", "--config", config)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	ready := make(chan struct{})
	var log strings.Builder
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			line := sc.Text()
			if log.Len() < 1<<16 {
				log.WriteString(line + "\n")
			}
			if strings.Contains(line, "serving initial configuration") {
				close(ready)
			}
		}
	}()
	select {
	case <-ready:
	case <-time.After(30 * time.Second):
		t.Fatalf("caddy did not start within 30s:\n%s", log.String())
	}
	return cmd
}

// TestQuickstartServesAnthropicSDK runs the README's first command (the
// built binary with examples/quickstart.Caddyfile, on free ports) and talks
// to it with the official Anthropic Go SDK.
func TestQuickstartServesAnthropicSDK(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	src, err := os.ReadFile("../../examples/quickstart.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	site, admin := freePort(t), freePort(t)
	port := site[strings.LastIndex(site, ":"):] // ":<port>": same form as ":8080", plain HTTP
	cfg := string(src)
	for old, repl := range map[string]string{":8080 {": port + " {", "admin localhost:2019": "admin " + admin} {
		if !strings.Contains(cfg, old) {
			t.Fatalf("quickstart.Caddyfile no longer contains %q; update this test", old)
		}
		cfg = strings.Replace(cfg, old, repl, 1)
	}
	file := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	runCaddy(t, caddyBin, file)

	sdk := anthropic.NewClient(option.WithBaseURL("http://"+site), option.WithAPIKey("sk-relay-quickstart-demo"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	params := anthropic.MessageNewParams{
		Model:     anthropic.ModelClaudeSonnet5_5,
		MaxTokens: 64,
		Messages:  []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hello"))},
	}

	// Several streams, so that the flaky channel's 529s are failed over too.
	for i := 0; i < 10; i++ {
		stream := sdk.Messages.NewStreaming(ctx, params)
		var msg anthropic.Message
		events := 0
		for stream.Next() {
			events++
			if err := msg.Accumulate(stream.Current()); err != nil {
				t.Fatalf("accumulate: %v", err)
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
		if events < 5 || len(msg.Content) != 1 || !strings.HasPrefix(msg.Content[0].Text, "mock-") ||
			msg.StopReason != anthropic.StopReasonEndTurn || msg.Usage.OutputTokens != 16 {
			t.Fatalf("stream %d: %d events, message %+v", i, events, msg)
		}
	}

	msg, err := sdk.Messages.New(ctx, params)
	if err != nil {
		t.Fatalf("non-streaming: %v", err)
	}
	if msg.Model != anthropic.ModelClaudeSonnet5_5 || !strings.Contains(msg.Content[0].Text, "mock") {
		t.Errorf("non-streaming reply: %+v", msg)
	}

	page, err := sdk.Models.List(ctx, anthropic.ModelListParams{})
	if err != nil || len(page.Data) != 2 || page.Data[0].ID != "claude-sonnet-5-5" || page.Data[1].ID != "claude-haiku-5-5" {
		t.Errorf("models: %v %+v", err, page)
	}

	bad := anthropic.NewClient(option.WithBaseURL("http://"+site), option.WithAPIKey("sk-wrong"), option.WithMaxRetries(0))
	_, err = bad.Messages.New(ctx, params)
	var apiErr *anthropic.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 401 || apiErr.Type() != "authentication_error" {
		t.Errorf("wrong key: %v", err)
	}
}
