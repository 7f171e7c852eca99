package main

// A session budget on a fleet: one Claude Code session's requests spread
// over two relays that share a real Redis.

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// sessionBody is a Claude Code request of session sid whose messages
// after the prompt are turns.
func sessionBody(sid string, turns ...string) string {
	return `{"model":"claude-sonnet-4-5","max_tokens":8,"metadata":{"user_id":"user_7f3a9c0d_account_1b2c3d4e_session_` + sid +
		`"},"messages":[{"role":"user","content":"hi"}` + strings.Join(append([]string{""}, turns...), ",") + `]}`
}

// sendSession sends one message of session sid to the node.
func (n *fleetNode) sendSession(sid string, turns ...string) (int, string, error) {
	req, _ := http.NewRequest(http.MethodPost, "http://"+n.site+"/v1/messages", strings.NewReader(sessionBody(sid, turns...)))
	req.Header.Set("X-Api-Key", fleetKey)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Claude-Code-Session-Id", sid)
	resp, err := fleetClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode == 429 && resp.Header.Get("X-Should-Retry") != "false" {
		err = errors.New("a session's 429 without x-should-retry: false")
	}
	return resp.StatusCode, string(b), err
}

// sessionRows is GET /relay/sessions of the node.
func (n *fleetNode) sessionRows(t *testing.T) []map[string]any {
	t.Helper()
	resp, err := fleetClient.Get("http://" + n.admin + "/relay/sessions?top=10")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	return rows
}

// TestFleetSessionBudgetHoldsAcrossNodes sends 50 requests of one Claude
// Code session at once, over two relays of a fleet, against its
// session_budget of $1 a day: only the holds that fit in $1 reach the
// upstream at once, on both relays together; the rest wait, and those
// that no longer fit once the others settled are refused with
// session_budget_exceeded. Another session of the key is served after.
// A session that loops over both relays is stopped at its loop_guard.
func TestFleetSessionBudgetHoldsAcrossNodes(t *testing.T) {
	srv := redistest.Start(t)
	probe := &concurrencyProbe{release: make(chan struct{})}
	up := fakeupstream.New(t, probe)
	cfg := fleetConfig{redisAddr: srv.Addr, prefix: "sessions:", channels: []string{"up=" + up.URL}, storage: "\t\t\ttimeout 2s\n",
		keyOpts: "\t\t\tsession_budget 1usd/24h\n\t\t\tloop_guard 3\n",
		extra:   "\t\tpricing {\n\t\t\tclaude-sonnet-4-5 input 100 output 10000\n\t\t}\n"}
	nodes := startFleet(t, 2, cfg)

	const sid = "5e2d1c3a-0f1e-4b8a-9c7d-2e4f6a8b0c1d"
	hold := holdOf(sessionBody(sid), 8)
	inFlight := int(1 / hold)
	var answered sync.WaitGroup
	answered.Add(1)
	var statuses []int
	var bodies []string
	var errs []error
	go func() {
		defer answered.Done()
		statuses, bodies, errs = fire(50, func(i int) (int, string, error) { return nodes[i%2].sendSession(sid) })
	}()
	within(t, "the holds that fit at the upstream, the others queued on both nodes", 10*time.Second, func() bool {
		return probe.held.Load() > int64(inFlight) || // past the budget already: judged below
			probe.held.Load() == int64(inFlight) && nodes[0].metric(t, "relay_queue_depth{")+nodes[1].metric(t, "relay_queue_depth{") == float64(50-inFlight)
	})
	close(probe.release)
	answered.Wait()

	served := 0
	for i, s := range statuses {
		switch {
		case errs[i] != nil:
			t.Errorf("request %d: %v", i, errs[i])
		case s == 200:
			served++
		case s == 429 && strings.Contains(bodies[i], `"code":"session_budget_exceeded"`) && strings.Contains(bodies[i], "session_budget of key"):
		default:
			t.Errorf("request %d: %d %s; want 200, or 429 session_budget_exceeded", i, s, bodies[i])
		}
	}
	// the session's spend in Redis: its account is a digest of the key's
	// and the session's ids, its window today's
	sum := sha256.Sum256([]byte("app\x00" + sid))
	day := "sessions:{s:session:" + hex.EncodeToString(sum[:8]) + "}:day:" + time.Now().UTC().Format("20060102")
	var spent int64
	within(t, "the fleet's spend synced", 5*time.Second, func() bool {
		v, _ := srv.Command("GET", day)
		spent, _ = strconv.ParseInt(v, 10, 64)
		return spent == int64(served)*int64(math.Round(fakeAnswerCost*1e9))
	})
	t.Logf("%d of 50 served over two relays, %d at the upstream at once, $%.4f spent of $1", served, probe.most.Load(), float64(spent)/1e9)
	if want := int((1-hold)/fakeAnswerCost) + 1; served != want || spent > 1e9 {
		t.Errorf("%d served, $%v spent; want %d, within $1", served, float64(spent)/1e9, want)
	}
	if probe.most.Load() != int64(inFlight) || up.Hits() != served {
		t.Errorf("at most %d at the upstream at once (want %d), %d reached it (want %d)", probe.most.Load(), inFlight, up.Hits(), served)
	}
	// each node shows the session by its digest, with the fleet's spend
	for _, n := range nodes {
		within(t, "node "+n.site+" shows the session's spend", 5*time.Second, func() bool {
			rows := n.sessionRows(t)
			if len(rows) != 1 {
				return false
			}
			got, _ := rows[0]["window_spend_usd"].(float64) // none before the node's first sync
			return rows[0]["key"] == "app" && rows[0]["budget_usd"] == 1.0 && math.Abs(got-float64(spent)/1e9) < 1e-9
		})
	}
	// the session is spent on both nodes; another session of the key is not
	for _, n := range nodes {
		if s, body, err := n.sendSession(sid); s != 429 || err != nil || !strings.Contains(body, "session_budget_exceeded") {
			t.Errorf("node %s, the spent session: %d %s %v", n.site, s, body, err)
		}
		if s, body, err := n.sendSession("other-" + n.site); s != 200 || err != nil {
			t.Errorf("node %s, another session: %d %s %v", n.site, s, body, err)
		}
	}

	// a loop whose turns go to one relay and the other: counted in the fleet
	var turns []string
	for i := range 4 {
		id := "toolu_" + strconv.Itoa(i)
		turns = append(turns, `{"role":"assistant","content":[{"type":"tool_use","id":"`+id+`","name":"Bash","input":{"command":"make"}}]}`,
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"`+id+`","content":"make: *** [all] Error 2","is_error":true}]}`)
		s, body, err := nodes[i%2].sendSession("looping", turns...)
		want := 200
		if i >= 2 {
			want = 429
		}
		if s != want || err != nil || want == 429 && !strings.Contains(body, `"code":"session_loop"`) {
			t.Errorf("turn %d of a loop, on node %d: %d %s %v; want %d", i+1, i%2, s, body, err, want)
		}
	}
}
