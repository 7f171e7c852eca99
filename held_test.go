package relay

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/redistest"
)

// TestAReloadAndCleanupGiveBackEveryPooledThing: a config holds a
// reference to each pool entry it took (channels' health, groups, keys'
// states, transports, the fleet, spend accounts, the spend store); during
// a reload two configs hold them, and once both are cleaned up no
// reference is left.
func TestAReloadAndCleanupGiveBackEveryPooledThing(t *testing.T) {
	t.Run("alone", func(t *testing.T) { testHeldReleased(t, "") })
	t.Run("fleet", func(t *testing.T) { testHeldReleased(t, redistest.Start(t).Addr) })
}

// testHeldReleased loads a config twice, as a reload does, then cleans up
// both, counting the references of each pool entry it takes; with
// redisAddr, the config shares its state through the Redis there.
func testHeldReleased(t *testing.T, redisAddr string) {
	cfg := map[string]any{
		"channels": []any{
			map[string]any{"name": "held-up", "upstream": upstream("anthropic", "url", "http://127.0.0.1:1", "api_key", "sk-upstream")},
			map[string]any{"name": "held-mock", "upstream": upstream("mock")},
		},
		"groups": []any{map[string]any{"name": "held-g", "channels": []string{"held-up", "held-mock"}, "budgets": []string{"5usd/day"}}},
		"keys": []any{
			map[string]any{"name": "held-budget", "secret": "sk-held-budget-0123456789abcdef", "group": "held-g", "budgets": []string{"5usd/day"}},
			map[string]any{"name": "held-lazy", "secret": "sk-held-lazy-0123456789abcdefgh", "group": "held-g"},
		},
	}
	if redisAddr != "" {
		cfg["storage"] = map[string]any{"redis": map[string]any{"address": []string{redisAddr}, "prefix": "held:"}}
	}
	raw, err := json.Marshal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	load := func() *Relay {
		r := new(Relay)
		if err := json.Unmarshal(raw, r); err != nil {
			t.Fatal(err)
		}
		provisionHandler(t, r)
		r.activate(r.keys[digestOf("sk-held-lazy-0123456789abcdefgh")]) // its first request takes its state
		return r
	}
	refs := func(pool *caddy.UsagePool, name string) int { n, _ := pool.References(name); return n }
	// refsWith sums the references of the entries whose name contains part
	refsWith := func(pool *caddy.UsagePool, part string) (n int) {
		pool.Range(func(k, _ any) bool {
			if strings.Contains(k.(string), part) {
				n += refs(pool, k.(string))
			}
			return true
		})
		return n
	}
	spendUsers := func() int {
		return money.StoreUsers()
	}
	usersBefore := spendUsers()
	check := func(when string, want int) {
		t.Helper()
		counts := map[string]int{
			"channelStates held-up":        refs(channelStates, "held-up"),
			"channelStates held-mock":      refs(channelStates, "held-mock"),
			"groupStates held-g":           refs(groupStates, "held-g"),
			"keyStates held-budget":        refs(keyStates, "held-budget"),
			"keyStates held-lazy":          refs(keyStates, "held-lazy"),
			"spendAccounts held-budget":    money.Refs("held-budget"),
			"spendAccounts held-lazy":      money.Refs("held-lazy"),
			"spendAccounts group:held-g":   money.Refs(money.GroupPrefix + "held-g"),
			"transports of held-up":        refsWith(transports, "held-up\x00"),
			"users of the spend store":     spendUsers() - usersBefore,
			"fleets with the prefix held:": refsWith(fleets, `"prefix":"held:"`),
		}
		if redisAddr == "" {
			counts["fleets with the prefix held:"] = want // there is none to count
		}
		for what, n := range counts {
			if n != want {
				t.Errorf("%s: %s has %d references, want %d", when, what, n, want)
			}
		}
	}

	old := load()
	check("loaded", 1)
	next := load()
	check("during the reload", 2)
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	check("after the reload", 1)
	if err := next.Cleanup(); err != nil {
		t.Fatal(err)
	}
	check("after the last Cleanup", 0)
	_ = next.Cleanup() // as provisionHandler does again: it gives back nothing twice
	check("after a second Cleanup", 0)
}

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
