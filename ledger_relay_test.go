package relay

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// ledgerUpstream answers a message as the request asks: streamed or not,
// with usage that has every kind of token.
func ledgerUpstream(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Model  string `json:"model"`
		Stream bool   `json:"stream"`
	}
	_ = json.NewDecoder(r.Body).Decode(&req)
	u := fakeupstream.Usage{InputTokens: 120, OutputTokens: 40, CacheReadInputTokens: 1000, CacheCreationInputTokens: 30}
	if req.Stream {
		fakeupstream.Stream(fakeupstream.StreamEvents(req.Model, u, "Hello", " world", "!")...)(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(fakeupstream.MessageBody(req.Model, "Hello", u))
}

// ledgerRows counts the rows in the SQLite ledger at path, read beside
// the relay's writer.
func ledgerRows(t *testing.T, db *sql.DB) int {
	var n int
	if err := db.QueryRow(`SELECT COUNT(*) FROM relay_usage`).Scan(&n); err != nil && !strings.Contains(err.Error(), "no such table") {
		t.Fatal(err)
	}
	return n
}

// getUsage asks the admin API for usage.
func getUsage(t *testing.T, query string) (int, string) {
	t.Helper()
	resp, err := client.Get(adminURL + "/relay/usage?" + query)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestLedgerRecordsEveryRequestAndReconcilesWithTheBudgetsSpend(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	bad := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	ok := fakeupstream.New(t, http.HandlerFunc(ledgerUpstream))
	const keyA, keyB = "sk-ledger-a-0123456789", "sk-ledger-b-0123456789"
	startRelay(t, fmt.Sprintf(`
		ledger sqlite %s
		ledger_retention 30d
		key %s ledger-g {
			name ledger-a
			budget 1000usd/day
		}
		key %s ledger-g {
			name ledger-b
			budget 1000usd/day
		}
		group ledger-g {
			channels ledger-bad ledger-ok
		}
`, path, keyA, keyB)+channelBlock("ledger-bad", bad.URL, "priority 1", "models claude-sonnet-4-5")+
		channelBlock("ledger-ok", ok.URL, "priority 2", "models claude-sonnet-4-5"))
	db, err := sql.Open("sqlite", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()

	const msg = `{"model":"claude-sonnet-4-5","max_tokens":50,"messages":[{"role":"user","content":"Hi"}]}`
	const streamMsg = `{"model":"claude-sonnet-4-5","stream":true,"max_tokens":50,"messages":[{"role":"user","content":"Hi"}]}`
	sent := 0
	first := send(t, "POST", "/v1/messages", keyA, msg) // fails over from ledger-bad
	sent++
	if first.status != 200 || first.header.Get("X-Relay-Attempts") == "" && bad.Hits() == 0 {
		t.Fatalf("first request: %d %s (bad upstream hit %d times)", first.status, first.body, bad.Hits())
	}
	for range 2 {
		if r := send(t, "POST", "/v1/messages", keyA, msg); r.status != 200 {
			t.Fatalf("%d %s", r.status, r.body)
		}
		if r := send(t, "POST", "/v1/messages", keyA, streamMsg); r.status != 200 || !strings.Contains(string(r.body), "message_stop") {
			t.Fatalf("stream: %d %s", r.status, r.body)
		}
		sent += 2
	}
	withSession := send(t, "POST", "/v1/messages", keyB, msg, "X-Claude-Code-Session-Id", "cc-session-ledger-42")
	sent++
	if withSession.status != 200 {
		t.Fatalf("%d %s", withSession.status, withSession.body)
	}
	if r := send(t, "POST", "/v1/messages", keyB, `{"model":"claude-unknown-9","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}`); r.status != 503 {
		t.Fatalf("an unknown model: %d %s", r.status, r.body)
	}
	sent++
	// a client that leaves after the first event: the relay reads on for
	// the usage, and bills it
	ctx, cancel := context.WithCancel(context.Background())
	s := openStreamAs(t, ctx, keyB, streamMsg)
	s.next(t)
	cancel()
	sent++

	waitFor(t, "every request's row in the ledger", 10*time.Second, func() bool { return ledgerRows(t, db) == sent })

	// one request's row, by the id its answer carried
	var (
		key, user, group, channel, model, served, cause, session string
		status                                                   int
		in, out, cr, cw, cost, dur, fb                           int64
		estimated, incomplete                                    bool
		at                                                       int64
	)
	id := withSession.header.Get("X-Relay-Request-Id")
	err = db.QueryRow(`SELECT time, key_name, user_name, group_name, channel_name, model, served_model, status, cause,
		input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, cost_nano_usd, estimated, incomplete,
		session_digest, duration_ms, first_byte_ms FROM relay_usage WHERE request_id = ?`, id).Scan(
		&at, &key, &user, &group, &channel, &model, &served, &status, &cause, &in, &out, &cr, &cw, &cost, &estimated, &incomplete, &session, &dur, &fb)
	if err != nil {
		t.Fatalf("the row of %s: %v", id, err)
	}
	wantCost := int64(math.Round((120*3 + 40*15 + 1000*0.3 + 30*3.75) / 1e6 * 1e9))
	if key != "ledger-b" || user != "" || group != "ledger-g" || channel != "ledger-ok" || model != "claude-sonnet-4-5" || served != model ||
		status != 200 || cause != "ok" || in != 120 || out != 40 || cr != 1000 || cw != 30 || cost != wantCost || estimated || incomplete {
		t.Errorf("row: key %s user %q group %s channel %s model %s/%s status %d cause %s tokens %d/%d/%d/%d cost %d (want %d) estimated %v incomplete %v",
			key, user, group, channel, model, served, status, cause, in, out, cr, cw, cost, wantCost, estimated, incomplete)
	}
	if session != sessionDigest("cc-session-ledger-42") || time.Since(time.UnixMilli(at)) > time.Minute || dur < fb {
		t.Errorf("session %q, time %v, duration %dms, first byte %dms", session, time.UnixMilli(at), dur, fb)
	}
	var raw int
	_ = db.QueryRow(`SELECT COUNT(*) FROM relay_usage WHERE session_digest LIKE '%cc-session%' OR request_id LIKE '%cc-session%'`).Scan(&raw)
	if raw != 0 {
		t.Error("the raw session id is in the ledger")
	}
	var refusedStatus int
	var refusedChannel string
	_ = db.QueryRow(`SELECT status, channel_name FROM relay_usage WHERE model = 'claude-unknown-9'`).Scan(&refusedStatus, &refusedChannel)
	if refusedStatus != 503 || refusedChannel != "" {
		t.Errorf("the refused request's row: status %d channel %q", refusedStatus, refusedChannel)
	}

	// the admin API: by key and day, the ledger's cost is the spend the
	// budgets saw
	code, body := getUsage(t, "group_by=key,day")
	var answer struct {
		Rows []map[string]any `json:"rows"`
	}
	if err := json.Unmarshal([]byte(body), &answer); code != 200 || err != nil || len(answer.Rows) != 2 {
		t.Fatalf("GET /relay/usage: %d %v\n%s", code, err, body)
	}
	resp, err := client.Get(adminURL + "/relay/keys")
	if err != nil {
		t.Fatal(err)
	}
	var keys []keyStatus
	_ = json.NewDecoder(resp.Body).Decode(&keys)
	resp.Body.Close()
	spent := map[string]float64{}
	for _, k := range keys {
		spent[k.Name] = k.SpendUSD["day"]
	}
	today := time.Now().UTC().Format(time.DateOnly)
	total := 0.0
	for _, row := range answer.Rows {
		name, _ := row["key"].(string)
		c, _ := row["cost_usd"].(float64)
		total += row["requests"].(float64)
		if row["day"] != today || math.Abs(c-spent[name]) > 1e-9 || c <= 0 {
			t.Errorf("key %s on %v: ledger %v USD, budgets saw %v USD", name, row["day"], c, spent[name])
		}
		for _, col := range []string{"input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"} {
			if _, ok := row[col]; !ok {
				t.Errorf("row without %s: %v", col, row)
			}
		}
	}
	if int(total) != sent {
		t.Errorf("the rows count %v requests, want %d", total, sent)
	}

	code, body = getUsage(t, "group_by=group,model&format=csv")
	lines := strings.Split(strings.TrimSpace(body), "\n")
	if code != 200 || len(lines) != 3 || lines[0] != "group,model,requests,input_tokens,output_tokens,cache_read_tokens,cache_write_tokens,cost_usd" ||
		!strings.HasPrefix(lines[1], "ledger-g,claude-sonnet-4-5,"+strconv.Itoa(sent-1)+",") {
		t.Errorf("csv: %d\n%q", code, body)
	}
	code, body = getUsage(t, "group_by=key,tenant")
	if code != 400 || !strings.Contains(body, `unknown column \"tenant\"`) {
		t.Errorf("a bad group_by: %d %s", code, body)
	}
	code, body = getUsage(t, "from=2020-01-01&to=2020-02-01&group_by=key")
	if code != 200 || strings.TrimSpace(body) != `{"rows":[]}` {
		t.Errorf("a month without rows: %d %s", code, body)
	}
}
