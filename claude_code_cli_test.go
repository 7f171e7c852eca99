package relay

// The real Claude Code CLI, installed from npm, through the relay in a real
// Caddy to a strict fake upstream: what its gateway contract promises has
// to hold for the client it was written for, release after release. The
// newest release is installed once per version under the user's cache
// directory; without npm the test is skipped (under CI=true it fails).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tidwall/gjson"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

const (
	claudeCodePackage = "@anthropic-ai/claude-code"
	installNPM        = "apt-get install -y nodejs npm"
)

// unavailable skips t for want of something on the machine, or under
// CI=true fails it: CI must have what its tests need.
func unavailable(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}

// claudeCodeCLI returns the path of the native claude binary of the newest
// release on npm, and that version. It is installed once per version in
// <user cache dir>/caddy-relay-tests/claude-code/<version>; when the
// registry cannot be reached, outside CI the newest installed version
// serves.
func claudeCodeCLI(t *testing.T) (bin, version string) {
	t.Helper()
	npm := needTool(t, "npm", installNPM)
	cache, err := os.UserCacheDir()
	if err != nil {
		unavailable(t, "no cache directory to install Claude Code in: %v", err)
	}
	root := filepath.Join(cache, "caddy-relay-tests", "claude-code")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// without retries npm answers at once offline: from its own cache, or
	// with an error
	out, err := exec.CommandContext(ctx, npm, "view", "--fetch-retries=0", claudeCodePackage, "version").Output()
	version = strings.TrimSpace(string(out))
	if err != nil || version == "" {
		why := fmt.Sprintf("the npm registry did not answer `npm view %s version` (%v)", claudeCodePackage, err)
		if os.Getenv("CI") != "true" {
			if version = newestInstalled(root); version != "" {
				t.Logf("%s: testing the newest installed version, %s", why, version)
				return claudeBinary(filepath.Join(root, version)), version
			}
		}
		unavailable(t, "%s, and no version is installed in %s", why, root)
	}

	dir := filepath.Join(root, version)
	if bin = claudeBinary(dir); bin != "" {
		return bin, version
	}
	t.Logf("installing %s@%s in %s", claudeCodePackage, version, dir)
	start := time.Now()
	tmp, err := os.MkdirTemp(root, ".install-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp) // gone after the rename below, unless it failed
	// a package.json of its own, or npm installs into the first directory
	// above that has one
	if err := os.WriteFile(filepath.Join(tmp, "package.json"), []byte(`{"private": true}`), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	install := exec.CommandContext(ctx, npm, "install", "--no-audit", "--no-fund", claudeCodePackage+"@"+version)
	install.Dir = tmp
	if out, err := install.CombinedOutput(); err != nil {
		unavailable(t, "npm install %s@%s: %v\n%s", claudeCodePackage, version, err, out)
	}
	if claudeBinary(tmp) == "" {
		unavailable(t, "%s@%s has no native binary for %s/%s (looked in %s)", claudeCodePackage, version, runtime.GOOS, runtime.GOARCH,
			filepath.Join(tmp, "node_modules", "@anthropic-ai"))
	}
	// another test process may have installed it meanwhile: either copy is whole
	if err := os.Rename(tmp, dir); err != nil && claudeBinary(dir) == "" {
		t.Fatalf("keeping the install: %v", err)
	}
	t.Logf("installed in %v", time.Since(start).Round(time.Second))
	return claudeBinary(dir), version
}

// claudeBinary is the native binary of an install in dir for this host,
// from the platform package npm chose (@anthropic-ai/claude-code-linux-x64,
// -linux-arm64-musl, ...); "" when there is none.
func claudeBinary(dir string) string {
	goos := map[string]string{"linux": "linux", "darwin": "darwin", "windows": "win32"}[runtime.GOOS]
	arch := map[string]string{"amd64": "x64", "arm64": "arm64"}[runtime.GOARCH]
	name := "claude"
	if runtime.GOOS == "windows" {
		name = "claude.exe"
	}
	libcs := []string{"", "-musl"}
	if musl, _ := filepath.Glob("/lib/ld-musl-*.so.1"); len(musl) > 0 {
		libcs = []string{"-musl", ""}
	}
	for _, libc := range libcs {
		p := filepath.Join(dir, "node_modules", "@anthropic-ai", "claude-code-"+goos+"-"+arch+libc, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p
		}
	}
	return ""
}

// newestInstalled is the version of the install in root made last; "":
// none.
func newestInstalled(root string) string {
	entries, _ := os.ReadDir(root)
	newest, when := "", time.Time{}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".") || claudeBinary(filepath.Join(root, e.Name())) == "" {
			continue
		}
		if fi, err := e.Info(); err == nil && fi.ModTime().After(when) {
			newest, when = e.Name(), fi.ModTime()
		}
	}
	return newest
}

// cliModel scripts the model's side of a Claude Code run: the main
// conversation (the request with the tools that carries prompt) asks for
// one Read of file, then, given its result, answers a text with marker;
// any side request (a title, a classifier) gets a short text, and
// count_tokens a count. Its thinking blocks are signed for secret, as the
// upstream account's (fakeupstream.Account) are.
type cliModel struct {
	secret, prompt, toolID, file, marker string
}

func (m cliModel) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var body bytes.Buffer
	_, _ = body.ReadFrom(r.Body)
	req := gjson.ParseBytes(body.Bytes())
	switch r.URL.Path {
	case "/v1/messages/count_tokens":
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"input_tokens":%d}`, 1+body.Len()/4)
		return
	case "/v1/messages":
	default:
		fakeupstream.Error(http.StatusNotFound, "not_found_error", "Not found")(w, r)
		return
	}

	var blocks []map[string]any
	if t := req.Get("thinking.type").Str; t == "enabled" || t == "adaptive" {
		// its text omitted, as Claude Code asks (thinking.display), but
		// signed: the next turn must send it back as it came
		blocks = append(blocks, map[string]any{"type": "thinking", "thinking": "", "signature": fakeupstream.Signature(m.secret, "")})
	}
	stop := "end_turn"
	switch {
	case !m.mainTurn(req):
		blocks = append(blocks, map[string]any{"type": "text", "text": "Relay test"})
	case m.toolResult(req).Exists():
		blocks = append(blocks, map[string]any{"type": "text", "text": "The note is read: " + m.marker})
	default:
		blocks = append(blocks, map[string]any{"type": "tool_use", "id": m.toolID, "name": "Read", "input": map[string]any{"file_path": m.file}})
		stop = "tool_use"
	}
	writeReply(w, req.Get("model").Str, req.Get("stream").Bool(), stop, blocks)
}

// mainTurn reports whether req is a turn of the conversation the prompt
// started: it offers Read and carries the prompt.
func (m cliModel) mainTurn(req gjson.Result) bool {
	offersRead := false
	for _, t := range req.Get("tools").Array() {
		offersRead = offersRead || t.Get("name").Str == "Read"
	}
	return offersRead && strings.Contains(req.Get("messages").Raw, m.prompt)
}

// toolResult is the tool_result of the Read the model asked for in the
// last user message of req.
func (m cliModel) toolResult(req gjson.Result) gjson.Result {
	msgs := req.Get("messages").Array()
	if len(msgs) == 0 || msgs[len(msgs)-1].Get("role").Str != "user" {
		return gjson.Result{}
	}
	for _, b := range msgs[len(msgs)-1].Get("content").Array() {
		if b.Get("type").Str == "tool_result" && b.Get("tool_use_id").Str == m.toolID {
			return b
		}
	}
	return gjson.Result{}
}

// writeReply writes a reply of blocks in Anthropic's wire format: a message, or
// its event stream, each block's start, deltas and stop, as the API sends
// them.
func writeReply(w http.ResponseWriter, model string, stream bool, stop string, blocks []map[string]any) {
	usage := fakeupstream.Usage{InputTokens: 120, OutputTokens: 30}
	if !stream {
		b, _ := json.Marshal(map[string]any{"id": "msg_cli", "type": "message", "role": "assistant", "model": model,
			"content": blocks, "stop_reason": stop, "stop_sequence": nil, "usage": usage})
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(b)
		return
	}
	js := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	start := usage
	start.OutputTokens = 1
	evs := []string{
		fakeupstream.Event("message_start", js(map[string]any{"type": "message_start", "message": map[string]any{
			"id": "msg_cli", "type": "message", "role": "assistant", "model": model, "content": []any{},
			"stop_reason": nil, "stop_sequence": nil, "usage": start}})),
		fakeupstream.Event("ping", `{"type": "ping"}`),
	}
	for i, b := range blocks {
		delta := func(d map[string]any) {
			evs = append(evs, fakeupstream.Event("content_block_delta", js(map[string]any{"type": "content_block_delta", "index": i, "delta": d})))
		}
		var empty map[string]any
		switch b["type"] {
		case "thinking":
			empty = map[string]any{"type": "thinking", "thinking": "", "signature": ""}
		case "text":
			empty = map[string]any{"type": "text", "text": ""}
		case "tool_use":
			empty = map[string]any{"type": "tool_use", "id": b["id"], "name": b["name"], "input": map[string]any{}}
		}
		evs = append(evs, fakeupstream.Event("content_block_start", js(map[string]any{"type": "content_block_start", "index": i, "content_block": empty})))
		switch b["type"] {
		case "thinking":
			if b["thinking"] != "" {
				delta(map[string]any{"type": "thinking_delta", "thinking": b["thinking"]})
			}
			delta(map[string]any{"type": "signature_delta", "signature": b["signature"]})
		case "text":
			delta(map[string]any{"type": "text_delta", "text": b["text"]})
		case "tool_use":
			delta(map[string]any{"type": "input_json_delta", "partial_json": js(b["input"])})
		}
		evs = append(evs, fakeupstream.Event("content_block_stop", js(map[string]any{"type": "content_block_stop", "index": i})))
	}
	evs = append(evs,
		fakeupstream.Event("message_delta", js(map[string]any{"type": "message_delta",
			"delta": map[string]any{"stop_reason": stop, "stop_sequence": nil}, "usage": map[string]any{"output_tokens": usage.OutputTokens}})),
		fakeupstream.Event("message_stop", `{"type":"message_stop"}`))
	fakeupstream.StartStream(w)
	for _, ev := range evs {
		if !fakeupstream.WriteEvent(w, ev) {
			return
		}
	}
}

// debugTail is the last n lines of Claude Code's debug log, without the
// lines of its config file writes, which say nothing about the gateway.
func debugTail(path string, n int) string {
	raw, _ := os.ReadFile(path)
	var lines []string
	for line := range strings.Lines(string(raw)) {
		if !strings.Contains(line, ".claude.json") && !strings.Contains(line, "temp file") && !strings.Contains(line, "file permissions") {
			lines = append(lines, line)
		}
	}
	return strings.Join(lines[max(len(lines)-n, 0):], "")
}

// accessLogEntry is a line of Caddy's access log: what reached the relay.
type accessLogEntry struct {
	Request struct {
		Method  string              `json:"method"`
		URI     string              `json:"uri"`
		Headers map[string][]string `json:"headers"`
	} `json:"request"`
	Status int `json:"status"`
}

func readAccessLog(t *testing.T, path string) []accessLogEntry {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []accessLogEntry
	for line := range bytes.Lines(raw) {
		var e accessLogEntry
		if err := json.Unmarshal(line, &e); err != nil {
			t.Fatalf("access log line %q: %v", line, err)
		}
		out = append(out, e)
	}
	return out
}

// TestClaudeCodeCLIThroughTheRelay runs `claude -p` through the relay: the
// model asks for a Read, Claude Code runs it and sends the result back, the
// model answers. It checks what the gateway contract promises Claude Code:
// the anthropic-* headers and the beta query reach the upstream as Claude
// Code sent them, its credential does not (the channel's does), and model
// discovery finds what GET /v1/models offers.
func TestClaudeCodeCLIThroughTheRelay(t *testing.T) {
	if testing.Short() {
		t.Skip("runs Claude Code and a server")
	}
	claude, version := claudeCodeCLI(t)
	t.Logf("Claude Code %s: %s", version, claude)

	const secret, noteText = "claude-code-cli-account", "The relay test note: 7c1f"
	work := t.TempDir()
	note := filepath.Join(work, "note.txt")
	if err := os.WriteFile(note, []byte(noteText+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	model := cliModel{secret: secret, prompt: "Read note.txt and tell me what it says.", toolID: "toolu_01RelayCLIRead",
		file: note, marker: "relay-cli-marker-5e2a"}
	up := fakeupstream.New(t, model, fakeupstream.Account(secret))

	accessLog := filepath.Join(t.TempDir(), "access.log")
	site := "\tlog {\n\t\toutput file " + accessLog + "\n\t\tformat filter {\n\t\t\trequest>headers>X-Api-Key delete\n\t\t}\n\t}\n"
	// no models line: the channel serves every model, and GET /v1/models
	// offers the price table's Claude models
	startRelayWith(t, site, channelBlock("claude-code-cli", up.URL)+keyAndGroup("claude-code-cli", "claude-code-cli"))

	config := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	debugLog := filepath.Join(t.TempDir(), "debug.log")
	cmd := exec.CommandContext(ctx, claude, "-p", model.prompt, "--output-format", "json", "--model", "claude-sonnet-4-5",
		"--allowedTools", "Read", "--max-turns", "4", "--debug-file", debugLog)
	cmd.Dir = work
	cmd.WaitDelay = 5 * time.Second // a child left holding its output does not hold the test
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + t.TempDir(),
		"TMPDIR=" + t.TempDir(),
		"CLAUDE_CONFIG_DIR=" + config,
		"ANTHROPIC_BASE_URL=" + relayURL,
		"ANTHROPIC_AUTH_TOKEN=" + clientKey,
		"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
		"CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY=1",
		// a refusal shows at once rather than after minutes of backoff
		"CLAUDE_CODE_MAX_RETRIES=0",
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	runErr := cmd.Run()
	t.Logf("claude -p took %v", time.Since(start).Round(time.Millisecond))
	defer func() {
		if t.Failed() {
			t.Logf("claude's stdout:\n%s\nstderr:\n%s\nthe end of its debug log:\n%s", stdout.Bytes(), stderr.Bytes(), debugTail(debugLog, 150))
		}
	}()
	if ctx.Err() != nil {
		t.Fatalf("claude -p did not finish within 2 minutes: killed")
	}
	if runErr != nil {
		t.Fatalf("claude -p: %v", runErr)
	}
	var result struct {
		Type    string `json:"type"`
		IsError bool   `json:"is_error"`
		Result  string `json:"result"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &result); err != nil || result.Type != "result" || result.IsError || !strings.Contains(result.Result, model.marker) {
		t.Fatalf("claude's result should carry the model's final answer (%s): %+v %v", model.marker, result, err)
	}

	// the upstream: the tool's result came back; the headers came through
	var sawResult bool
	for _, r := range up.Requests() {
		req := gjson.ParseBytes(r.Body)
		if res := model.toolResult(req); res.Exists() && strings.Contains(res.Get("content").Raw, noteText) {
			sawResult = true
		}
		for name, vs := range r.Header {
			for _, v := range vs {
				if strings.Contains(v, clientKey) {
					t.Errorf("%s %s: the relay key reached the upstream in %s", r.Method, r.Path, name)
				}
			}
		}
		if r.Header.Get("X-Api-Key") != channelKey {
			t.Errorf("%s %s: the upstream got x-api-key %q, not the channel's key", r.Method, r.Path, r.Header.Get("X-Api-Key"))
		}
		if r.Path == "/v1/messages" && (r.RawQuery != "beta=true" || !strings.Contains(r.Header.Get("Anthropic-Beta"), "claude-code-20250219")) {
			t.Errorf("POST /v1/messages: query %q, anthropic-beta %q: Claude Code's ?beta=true and its betas must reach the upstream",
				r.RawQuery, r.Header.Get("Anthropic-Beta"))
		}
	}
	if !sawResult {
		t.Errorf("the upstream never received the result of the Read it asked for")
	}

	// the relay: what Claude Code sent it, by Caddy's access log
	var entries []accessLogEntry
	messages := 0
	for _, r := range up.Requests() {
		if r.Path == "/v1/messages" {
			messages++
		}
	}
	waitFor(t, "an access log line for each request", 5*time.Second, func() bool {
		entries = readAccessLog(t, accessLog)
		n := 0
		for _, e := range entries {
			if strings.HasPrefix(e.Request.URI, "/v1/messages?") || e.Request.URI == "/v1/messages" {
				n++
			}
		}
		return n >= messages
	})
	discovery := 0
	type pair struct{ version, beta string }
	var sent, arrived []pair
	for _, e := range entries {
		t.Logf("Claude Code sent %s %s: %d", e.Request.Method, e.Request.URI, e.Status)
		h := http.Header(e.Request.Headers)
		switch {
		case e.Request.Method == http.MethodGet && strings.HasPrefix(e.Request.URI, "/v1/models"):
			discovery++
			if e.Status != http.StatusOK {
				t.Errorf("GET %s: %d", e.Request.URI, e.Status)
			}
		case strings.HasPrefix(e.Request.URI, "/v1/messages"):
			if e.Status != http.StatusOK {
				t.Errorf("%s %s: %d", e.Request.Method, e.Request.URI, e.Status)
			}
			sent = append(sent, pair{h.Get("Anthropic-Version"), h.Get("Anthropic-Beta")})
		}
	}
	for _, r := range up.Requests() {
		if strings.HasPrefix(r.Path, "/v1/messages") {
			arrived = append(arrived, pair{r.Header.Get("Anthropic-Version"), r.Header.Get("Anthropic-Beta")})
		}
	}
	less := func(a, b pair) int { return strings.Compare(a.version+"\x00"+a.beta, b.version+"\x00"+b.beta) }
	slices.SortFunc(sent, less)
	slices.SortFunc(arrived, less)
	if !slices.Equal(sent, arrived) || len(sent) == 0 {
		t.Errorf("anthropic-version and anthropic-beta must reach the upstream as Claude Code sent them:\nsent    %q\narrived %q", sent, arrived)
	}
	if discovery == 0 {
		t.Errorf("Claude Code never asked GET /v1/models (CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY=1)")
	}

	// discovery: Claude Code's cache lists what the relay offers
	offered := send(t, http.MethodGet, "/v1/models?limit=1000", clientKey, "")
	var list struct {
		Data []struct {
			ID          string `json:"id"`
			DisplayName string `json:"display_name"`
		} `json:"data"`
	}
	if err := json.Unmarshal(offered.body, &list); err != nil || len(list.Data) == 0 {
		t.Fatalf("GET /v1/models: %d %s", offered.status, offered.body)
	}
	raw, err := os.ReadFile(filepath.Join(config, "cache", "gateway-models.json"))
	if err != nil {
		t.Fatalf("Claude Code %s wrote no discovery cache: %v", version, err)
	}
	var cached struct {
		BaseURL string `json:"baseUrl"`
		Models  []struct {
			ID          string `json:"id"`
			DisplayName string `json:"display_name"`
		} `json:"models"`
	}
	if err := json.Unmarshal(raw, &cached); err != nil {
		t.Fatalf("gateway-models.json: %v: %s", err, raw)
	}
	if cached.BaseURL != relayURL || !slices.Equal(cached.Models, list.Data) {
		t.Errorf("gateway-models.json should list the models the relay offers:\n got %s\nwant %s", raw, offered.body)
	}
}
