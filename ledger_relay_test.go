package relay

import (
	"context"
	"database/sql"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/ledger"
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

// makeBatch creates a batch as key, one request per model given, with the
// custom_ids given (each "r<i>" unless named); it returns the relay's id.
func makeBatch(t *testing.T, key string, models []string, ids ...string) string {
	t.Helper()
	reqs := make([]string, len(models))
	for i, m := range models {
		id := fmt.Sprintf("r%d", i)
		if i < len(ids) {
			id = ids[i]
		}
		reqs[i] = fmt.Sprintf(`{"custom_id":%q,"params":{"model":%q,"max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}}`, id, m)
	}
	r := send(t, "POST", "/v1/messages/batches", key, `{"requests":[`+strings.Join(reqs, ",")+`]}`)
	var made struct{ ID string }
	if err := json.Unmarshal(r.body, &made); r.status != 200 || err != nil || made.ID == "" {
		t.Fatalf("a batch of %v: %d %s", models, r.status, r.body)
	}
	return made.ID
}

// readResults reads a batch's results as key.
func readResults(t *testing.T, key, id string) reply {
	t.Helper()
	r := send(t, "GET", "/v1/messages/batches/"+id+"/results", key, "")
	if r.status != 200 || !strings.Contains(string(r.body), `"custom_id":"r0"`) {
		t.Fatalf("results of %s: %d %s", id, r.status, r.body)
	}
	return r
}

// batchUSD is what n results of 10 input and 5 output tokens cost at the
// batch price (half), at input and output prices per million.
func batchUSD(n int, in, out float64) float64 { return float64(n) * (10*in + 5*out) / 1e6 * 0.5 }

// ledgerSpend is what GET /relay/keys says each key spent today.
func ledgerSpend(t *testing.T) map[string]float64 {
	t.Helper()
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
	return spent
}

func TestLedgerRecordsEveryRequestAndReconcilesWithTheBudgetsSpend(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.db")
	bad := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	store := fakeupstream.NewStore("ledger")
	ok := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/messages/batches") {
			store.ServeHTTP(w, r)
			return
		}
		ledgerUpstream(w, r)
	}))
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
`, path, keyA, keyB)+channelBlock("ledger-bad", bad.URL, "priority 1", "models claude-sonnet-4-5 claude-haiku-4-5")+
		channelBlock("ledger-ok", ok.URL, "priority 2", "models claude-sonnet-4-5 claude-haiku-4-5"))
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	before := ledgerSpend(t) // a key's spend outlives a config: a run of -count 2 finds the first's

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

	messages := sent

	// batches, made past ledger-bad's 529: ledger-a's, read first by
	// ledger-b (ledger-a, whose budget held it, pays), then again by
	// ledger-a (nothing more); ledger-b's, of two models and two requests
	// that did not end in a reply, canceled before its results are read
	sonnet := []string{"claude-sonnet-4-5", "claude-sonnet-4-5"}
	madeByA := makeBatch(t, keyA, sonnet)
	crossRead := readResults(t, keyB, madeByA)
	againRead := readResults(t, keyA, madeByA)
	mixed := makeBatch(t, keyB, []string{"claude-sonnet-4-5", "claude-haiku-4-5", "claude-sonnet-4-5", "claude-haiku-4-5"}, "r0", "r1", "expired-2", "canceled-3")
	if r := send(t, "POST", "/v1/messages/batches/"+mixed+"/cancel", keyB, ""); r.status != 200 {
		t.Fatalf("cancel: %d %s", r.status, r.body)
	}
	mixedRead := readResults(t, keyB, mixed)
	sent += 6
	rows := sent + 1 // the mixed batch's read has a row per model

	waitFor(t, "every request's row in the ledger", 10*time.Second, func() bool { return ledgerRows(t, db) == rows })

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

	// the batches' rows: the cost of the results, on the first read, as
	// the maker's, by model
	type batchRow struct {
		key, model, cause string
		in, out, cost     int64
	}
	batchRowOf := func(id string) batchRow {
		var b batchRow
		if err := db.QueryRow(`SELECT key_name, served_model, cause, input_tokens, output_tokens, cost_nano_usd FROM relay_usage
			WHERE request_id = ? AND channel_name = 'ledger-ok' AND model = served_model`, id).Scan(&b.key, &b.model, &b.cause, &b.in, &b.out, &b.cost); err != nil {
			t.Fatalf("the row of %s: %v", id, err)
		}
		return b
	}
	nano := func(usd float64) int64 { return int64(math.Round(usd * 1e9)) }
	for _, c := range []struct {
		id   string
		want batchRow
	}{
		{crossRead.header.Get("X-Relay-Request-Id"), batchRow{"ledger-a", "claude-sonnet-4-5", "batch", 20, 10, nano(batchUSD(2, 3, 15))}},
		{againRead.header.Get("X-Relay-Request-Id"), batchRow{"ledger-a", "", "ok", 0, 0, 0}},
		{mixedRead.header.Get("X-Relay-Request-Id"), batchRow{"ledger-b", "claude-haiku-4-5", "batch", 10, 5, nano(batchUSD(1, 1, 5))}},
		{mixedRead.header.Get("X-Relay-Request-Id") + "/claude-sonnet-4-5", batchRow{"ledger-b", "claude-sonnet-4-5", "batch", 10, 5, nano(batchUSD(1, 3, 15))}},
	} {
		if got := batchRowOf(c.id); got != c.want {
			t.Errorf("the batch row %s: %+v, want %+v", c.id, got, c.want)
		}
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
	spent := ledgerSpend(t)
	today := time.Now().UTC().Format(time.DateOnly)
	total := 0.0
	for _, row := range answer.Rows {
		name, _ := row["key"].(string)
		c, _ := row["cost_usd"].(float64)
		total += row["requests"].(float64)
		if row["day"] != today || math.Abs(c-(spent[name]-before[name])) > 1e-9 || c <= 0 {
			t.Errorf("key %s on %v: ledger %v USD, budgets saw %v USD", name, row["day"], c, spent[name]-before[name])
		}
		for _, col := range []string{"input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"} {
			if _, ok := row[col]; !ok {
				t.Errorf("row without %s: %v", col, row)
			}
		}
	}
	if int(total) != rows {
		t.Errorf("the rows count %v requests, want %d", total, rows)
	}

	// by model, the batches' results count at their own model: the
	// messages and both batches' sonnet rows, the mixed batch's haiku row
	code, body = getUsage(t, "group_by=group,model&format=csv")
	lines := strings.Split(strings.TrimSpace(body), "\n")
	if code != 200 || lines[0] != "group,model,requests,input_tokens,output_tokens,cache_read_tokens,cache_write_tokens,cost_usd" ||
		!slices.ContainsFunc(lines, func(l string) bool {
			return strings.HasPrefix(l, "ledger-g,claude-sonnet-4-5,"+strconv.Itoa(messages-1+2)+",")
		}) ||
		!slices.Contains(lines, "ledger-g,claude-haiku-4-5,1,10,5,0,0,"+strconv.FormatFloat(batchUSD(1, 1, 5), 'f', -1, 64)) {
		t.Errorf("csv: %d\n%s", code, body)
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

// TestUsageCSVNamesAreNotFormulas serves a request whose identity (a
// header an auth layer would fill) is a spreadsheet formula, and has the
// ledger keep rows whose key, group and model begin with +, - and @, one of
// them costing less than nothing: in the admin API's CSV and the status
// page's spend.csv each such name comes out behind a ', so a spreadsheet
// shows it as text, while the numbers (a negative cost included) and the
// JSON answer stay as they are.
func TestUsageCSVNamesAreNotFormulas(t *testing.T) {
	const formula = `=HYPERLINK("http://evil.example/","x")`
	path := filepath.Join(t.TempDir(), "ledger.db")
	up := fakeupstream.New(t, http.HandlerFunc(ledgerUpstream))
	startRelayWith(t, "\trelay_status /status/*\n", fmt.Sprintf(`
		ledger sqlite %s
		identity {http.request.header.X-Csv-User}
		user * csv-g
		group csv-g {
			channels csv-up
		}
`, path)+channelBlock("csv-up", up.URL, "models claude-sonnet-4-5"))
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if r := send(t, "POST", "/v1/messages", "", simpleBody, "X-Csv-User", formula); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	l, err := ledger.Current()
	if err != nil {
		t.Fatal(err)
	}
	l.Add(ledger.Row{At: time.Now(), ID: "req_csv_hostile", Key: "+cmd", User: "@me", Group: "-g", Channel: "csv-up",
		Model: "@SUM(A1:A9)", Served: "@SUM(A1:A9)", Cause: causeOK, Status: 200, CostNano: -500_000_000})
	waitFor(t, "both rows in the ledger", 10*time.Second, func() bool { return ledgerRows(t, db) == 2 })

	readCSV := func(what, body string) [][]string {
		t.Helper()
		recs, err := csv.NewReader(strings.NewReader(body)).ReadAll()
		if err != nil {
			t.Fatalf("%s: %v\n%s", what, err, body)
		}
		return recs
	}
	code, body := getUsage(t, "group_by=user,key,group,model&format=csv&from="+time.Now().UTC().AddDate(0, 0, -1).Format(time.DateOnly))
	if code != 200 {
		t.Fatalf("usage CSV: %d %s", code, body)
	}
	got := readCSV("usage CSV", body)
	want := [][]string{
		{"user", "key", "group", "model", "requests", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "cost_usd"},
		{"'" + formula, "user:*", "csv-g", "claude-sonnet-4-5"},
		{"'@me", "'+cmd", "'-g", "'@SUM(A1:A9)", "1", "0", "0", "0", "0", "-0.5"},
	}
	if len(got) != 3 || !slices.Equal(got[0], want[0]) || !slices.Equal(got[1][:4], want[1]) || !slices.Equal(got[2], want[2]) {
		t.Errorf("usage CSV:\n%q\nwant\n%q", got, want)
	}

	_, js := getUsage(t, "group_by=user,key,group,model&from="+time.Now().UTC().AddDate(0, 0, -1).Format(time.DateOnly))
	for _, raw := range []string{`"user":"=HYPERLINK(`, `"key":"+cmd"`, `"model":"@SUM(A1:A9)"`, `"cost_usd":-0.5`} {
		if !strings.Contains(js, raw) {
			t.Errorf("the JSON answer lacks %s as it is: %s", raw, js)
		}
	}

	code, _, body = get(t, "/status/spend.csv")
	if code != 200 {
		t.Fatalf("spend.csv: %d %s", code, body)
	}
	today := time.Now().UTC().Format(time.DateOnly)
	found := false
	for _, rec := range readCSV("spend.csv", body)[1:] {
		for i, cell := range rec[:4] {
			if cell != "" && strings.ContainsRune("=+-@\t\r", rune(cell[0])) {
				t.Errorf("spend.csv: column %d begins a formula: %q", i, cell)
			}
		}
		if slices.Equal(rec, []string{today, "'-g", "'+cmd", "'@SUM(A1:A9)", "1", "0", "0", "0", "0", "-0.5"}) {
			found = true
		}
	}
	if !found {
		t.Errorf("spend.csv lacks the row of -g, +cmd and @SUM(A1:A9), neutralised:\n%s", body)
	}
}
