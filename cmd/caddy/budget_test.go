package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// TestSpendSurvivesARestart runs the binary with a key whose budget holds
// three answers, stops it gracefully after two and starts it again, then
// kills it after the third and starts it again: the spend is in Caddy's
// storage both times, written on the way out and at a checkpoint.
func TestSpendSurvivesARestart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	up := fakeupstream.New(t, fakeupstream.Message("ok")) // 5 output tokens an answer
	storage := t.TempDir()
	site, admin := freePort(t), freePort(t)
	config := filepath.Join(t.TempDir(), "Caddyfile")
	// 5 output tokens at $200,000 per million: $1 an answer, and max_tokens
	// 5 holds $1 while it runs, so the third answer fits in the $3 budget
	src := fmt.Sprintf(`{
	admin %s
	storage file_system %s
}
http://%s {
	relay {
		pricing {
			m-spend input 0 output 200000
		}
		key sk-spend-client-0123456789abcdef spend {
			name spender
			budget 3usd/month
		}
		channel up {
			url %s
			api_key %s
		}
		group spend {
			channels up
		}
	}
}
`, admin, storage, site, up.URL, fakeupstream.Key)
	if err := os.WriteFile(config, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	send := func() int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, "http://"+site+"/v1/messages",
			strings.NewReader(`{"model":"m-spend","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("X-Api-Key", "sk-spend-client-0123456789abcdef")
		req.Header.Set("Anthropic-Version", "2023-06-01")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	stored := func() string {
		b, _ := os.ReadFile(filepath.Join(storage, "relay", "spend.json"))
		return string(b)
	}

	cmd := runCaddy(t, caddyBin, config)
	for i := range 2 {
		if s := send(); s != 200 {
			t.Fatalf("request %d: %d", i+1, s)
		}
	}
	_ = cmd.Process.Signal(os.Interrupt) // Caddy stops its config: the spend is written
	_ = cmd.Wait()
	if !strings.Contains(stored(), `"nano_usd":2000000000`) {
		t.Fatalf("after a graceful stop, the stored spend is %s, want $2", stored())
	}

	cmd = runCaddy(t, caddyBin, config)
	if s := send(); s != 200 {
		t.Fatalf("the third answer after the restart: %d", s)
	}
	if s := send(); s != 429 {
		t.Fatalf("the fourth, over the $3 budget: %d, want 429", s)
	}
	// a crash loses at most what was not checkpointed: wait for the
	// checkpoint (at most 10s), then kill
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(stored(), `"nano_usd":3000000000`) {
		if time.Now().After(deadline) {
			t.Fatalf("no checkpoint of the $3 spent within 15s: %s", stored())
		}
		time.Sleep(100 * time.Millisecond)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()

	runCaddy(t, caddyBin, config)
	if s := send(); s != 429 {
		t.Fatalf("after a crash and a restart: %d, want 429 (the budget is still spent)", s)
	}
	if up.Hits() != 3 {
		t.Errorf("the upstream answered %d times, want 3", up.Hits())
	}
}

// TestATotalSurvivesARestart spends a key's lifetime budget, stops the
// binary and starts it again: the total is in Caddy's storage, and the key
// is still refused, told that its budget never renews and given no
// retry-after.
func TestATotalSurvivesARestart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	up := fakeupstream.New(t, fakeupstream.Message("ok")) // 5 output tokens an answer
	storage := t.TempDir()
	site, admin := freePort(t), freePort(t)
	config := filepath.Join(t.TempDir(), "Caddyfile")
	// $1 an answer, as in TestSpendSurvivesARestart: two fit in $2
	src := fmt.Sprintf(`{
	admin %s
	storage file_system %s
}
http://%s {
	relay {
		pricing {
			m-spend input 0 output 200000
		}
		key sk-total-client-0123456789abcdef spend {
			name lifetime
			budget 2usd/total
		}
		channel up {
			url %s
			api_key %s
		}
		group spend {
			channels up
		}
	}
}
`, admin, storage, site, up.URL, fakeupstream.Key)
	if err := os.WriteFile(config, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	send := func() (int, http.Header, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, "http://"+site+"/v1/messages",
			strings.NewReader(`{"model":"m-spend","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`))
		req.Header.Set("X-Api-Key", "sk-total-client-0123456789abcdef")
		req.Header.Set("Anthropic-Version", "2023-06-01")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b)
	}

	cmd := runCaddy(t, caddyBin, config)
	for i := range 2 {
		if s, _, body := send(); s != 200 {
			t.Fatalf("request %d: %d %s", i+1, s, body)
		}
	}
	_ = cmd.Process.Signal(os.Interrupt) // Caddy stops its config: the spend is written
	_ = cmd.Wait()
	b, _ := os.ReadFile(filepath.Join(storage, "relay", "spend.json"))
	if !strings.Contains(string(b), `"total":{"start":"1970-01-01T00:00:00Z","nano_usd":2000000000}`) {
		t.Fatalf("after a graceful stop, the stored spend is %s, want a total of $2 since the epoch", b)
	}

	runCaddy(t, caddyBin, config)
	s, h, body := send()
	if s != 429 || !strings.Contains(body, `"code":"budget_exceeded"`) || !strings.Contains(body, "never renews") {
		t.Fatalf("after the restart: %d %s, want 429 budget_exceeded saying the budget never renews", s, body)
	}
	if h.Get("Retry-After") != "" || h.Get("X-Should-Retry") != "false" {
		t.Errorf("retry-after %q, x-should-retry %q; want none, and false", h.Get("Retry-After"), h.Get("X-Should-Retry"))
	}
	if up.Hits() != 2 {
		t.Errorf("the upstream answered %d times, want 2", up.Hits())
	}
}

// TestAResetReachesTheWholeFleet spends a key's total on one relay of a
// fleet, until both relays refuse it, then resets it on the other: Redis
// forgets the fleet's total, and the first relay serves the key again
// once it has synced, its own view of the spend being the fleet's.
func TestAResetReachesTheWholeFleet(t *testing.T) {
	srv := redistest.Start(t)
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	// an answer costs $0.051 and holds about $0.085 while it runs: one
	// fits in $0.10, a second does not
	nodes := startFleet(t, 2, fleetConfig{redisAddr: srv.Addr, prefix: "reset:", keyOpts: "\t\t\tbudget 0.1usd/total\n",
		extra: "\t\tpricing {\n\t\t\tclaude-sonnet-4-5 input 100 output 10000\n\t\t}\n", channels: []string{"up=" + up.URL}})
	a, b := nodes[0], nodes[1]
	if s, body := a.sendBody(t); s != 200 {
		t.Fatalf("the first request: %d %s", s, body)
	}
	within(t, "node b syncs the fleet's spend", 5*time.Second, func() bool {
		return math.Abs(spendOf(t, b.admin, "app")["total"]-0.051) < 1e-9
	})
	if s, body := b.sendBody(t); s != 429 || !strings.Contains(body, "never renews") {
		t.Fatalf("node b, past the fleet's total: %d %s; want 429 saying the budget never renews", s, body)
	}
	total := "reset:{s:app}:total:19700101"
	if v, _ := srv.Command("GET", total); v != "51000000" {
		t.Fatalf("the fleet's total in Redis: %q, want 51000000 billionths of a dollar", v)
	}

	resp, err := fleetClient.Post("http://"+a.admin+"/relay/keys/app/spend/reset?period=total", "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	var row struct {
		Name     string             `json:"name"`
		SpendUSD map[string]float64 `json:"spend_usd"`
	}
	err = json.NewDecoder(resp.Body).Decode(&row)
	resp.Body.Close()
	if resp.StatusCode != 200 || err != nil || row.Name != "app" || row.SpendUSD["total"] != 0 || row.SpendUSD["day"] == 0 {
		t.Fatalf("POST /relay/keys/app/spend/reset?period=total on node a: %d %+v %v", resp.StatusCode, row, err)
	}
	if v, _ := srv.Command("GET", total); v != "$-1" && v != "0" {
		t.Errorf("the fleet's total in Redis after the reset: %q, want none", v)
	}
	took := within(t, "node b serves the key again after its sync", 5*time.Second, func() bool {
		s, _ := b.sendBody(t)
		return s == 200
	})
	t.Logf("node b served the key %v after the reset", took)
	within(t, "node a refuses the key again once it has synced what b spent", 5*time.Second, func() bool {
		s, _ := a.sendBody(t)
		return s == 429
	})
	if up.Hits() != 2 {
		t.Errorf("the upstream answered %d times, want 2", up.Hits())
	}
}

// spendOf is a key's spend_usd in GET /relay/keys on the relay whose admin
// endpoint is admin.
func spendOf(t *testing.T, admin, name string) map[string]float64 {
	t.Helper()
	resp, err := fleetClient.Get("http://" + admin + "/relay/keys")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []struct {
		Name     string             `json:"name"`
		SpendUSD map[string]float64 `json:"spend_usd"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Name == name {
			return r.SpendUSD
		}
	}
	t.Fatalf("GET /relay/keys has no key %q", name)
	return nil
}
