package relay

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2/caddytest"
)

func TestLiteralKeyIsHashedInConfig(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, channelBlock("lit-a", up.URL)+keyAndGroup("lit", "lit-a"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("status %d", r.status)
	}
	resp, err := client.Get("http://localhost:2999/config/")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if bytes.Contains(cfg, []byte(clientKey)) || !bytes.Contains(cfg, []byte(`"secret":"sha256:`)) {
		t.Errorf("a literal client key must be stored as its sha256: %s", cfg)
	}
}

// TestTheExamplesKeysAreNotWeak: an example that trips the relay's own
// weak-key warning teaches a newcomer to ignore it.
func TestTheExamplesKeysAreNotWeak(t *testing.T) {
	files, _ := filepath.Glob("examples/*.Caddyfile")
	if len(files) == 0 {
		t.Fatal("no examples/*.Caddyfile")
	}
	keyLine := regexp.MustCompile(`(?m)^\s*key\s+(\S+)`)
	literal := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range keyLine.FindAllStringSubmatch(string(b), -1) {
			if strings.Contains(m[1], "{") || strings.HasPrefix(m[1], sha256Prefix) {
				continue
			}
			literal++
			if weakKey(m[1]) {
				t.Errorf("%s: the key %s trips the weak-key warning", f, m[1])
			}
		}
	}
	if literal == 0 {
		t.Fatal("no example writes a key in clear: the test checks nothing")
	}
	if !weakKey("sk-relay-fleet-demo") {
		t.Error("a 19-character key is not weak any more: update this test")
	}
}

func TestAKeysSlowClientsWaitForItsSlot(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	// a key of its own: key limits are kept by name across configs
	const key = "sk-slow-slot-client-0123456789"
	startRelay(t, channelBlock("hostile-slot", up.URL)+
		"\t\tkey "+key+" hostile-slot {\n\t\t\tname slow-slot\n\t\t\tconcurrency 1\n\t\t}\n\t\tgroup hostile-slot {\n\t\t\tchannels hostile-slot\n\t\t}\n")
	conn := slowRequest(t, key, 1<<20)
	// the slow request holds the key's one slot while its body trickles
	// in: the next request is refused before its body is read
	var last reply
	deadline := time.Now().Add(5 * time.Second)
	for last = send(t, "POST", "/v1/messages", key, simpleBody); last.status != 429; last = send(t, "POST", "/v1/messages", key, simpleBody) {
		if time.Now().After(deadline) {
			_ = conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			answer, _ := bufio.NewReader(conn).ReadString('\n')
			t.Fatalf("no request was refused while the slow one should hold the slot (last %d %s; the slow one got %q)", last.status, last.body, answer)
		}
		time.Sleep(10 * time.Millisecond)
	}
	wantRelayError(t, last, 429, "rate_limit_error", "key_rate_limited")
	conn.Close() // the slow client gives up: its slot comes back
	waitFor(t, "the slot back", 5*time.Second, func() bool { return send(t, "POST", "/v1/messages", key, simpleBody).status == 200 })
}

// recorded turns a recorded response into a reply, for wantRelayError.
func recorded(w *httptest.ResponseRecorder) reply {
	return reply{w.Code, w.Header(), w.Body.Bytes()}
}

func TestAKeyStopsWorkingWhenItExpires(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	expires := time.Unix(1_900_000_000, 0).Add(time.Hour) // the fake clock starts at 1_900_000_000
	r, clock := limitRelay(t, "kexp", Key{KeyOptions: KeyOptions{Expires: expires.Format(time.RFC3339)}}, up.URL)
	send := func(path string) *httptest.ResponseRecorder {
		req := newRequest(simpleBody, "sk-kexp")
		if path != "" {
			req = httptest.NewRequest(http.MethodGet, path, nil)
			req.Header.Set("X-Api-Key", "sk-kexp")
		}
		w, _ := serveHandler(t, r, req)
		return w
	}
	if w := send(""); w.Code != 200 {
		t.Fatalf("before its expiry: %d %s", w.Code, w.Body)
	}
	clock.advance(time.Hour - time.Second)
	if w := send(""); w.Code != 200 {
		t.Fatalf("a second before its expiry: %d %s", w.Code, w.Body)
	}
	clock.advance(time.Second)
	for _, path := range []string{"", "/v1/models"} {
		w := send(path)
		wantRelayError(t, recorded(w), 401, "authentication_error", "key_expired")
		body := w.Body.String()
		if !strings.Contains(body, `key \"kexp\" expired at `+expires.UTC().Format(time.RFC3339)) || strings.Contains(body, "sk-kexp") {
			t.Errorf("%s: the message must name the key and its expiry, never the secret: %s", cmp.Or(path, "/v1/messages"), body)
		}
	}
	if up.Hits() != 2 {
		t.Errorf("an expired key's request reached the upstream: %d hits", up.Hits())
	}
}

func TestADisabledKeyIsRefused(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	r, _ := limitRelay(t, "kdis", Key{KeyOptions: KeyOptions{Disabled: true}}, up.URL)
	w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-kdis"))
	wantRelayError(t, recorded(w), 401, "authentication_error", "key_disabled")
	if body := w.Body.String(); !strings.Contains(body, `key \"kdis\" is disabled`) || strings.Contains(body, "sk-kdis") {
		t.Errorf("the message must name the key, never the secret: %s", body)
	}
	if up.Hits() != 0 {
		t.Errorf("a disabled key's request reached the upstream")
	}
	// a wrong key is still only a wrong key
	w, _ = serveHandler(t, r, newRequest(simpleBody, "sk-other"))
	wantRelayError(t, recorded(w), 401, "authentication_error", "")
}

// keyRows calls GET /relay/keys without a server, by key name.
func keyRows(t *testing.T) (map[string]keyStatus, string) {
	t.Helper()
	w := httptest.NewRecorder()
	if err := (adminAPI{}).keys(w, httptest.NewRequest(http.MethodGet, "/relay/keys", nil)); err != nil {
		t.Fatal(err)
	}
	var rows []keyStatus
	if err := json.Unmarshal(w.Body.Bytes(), &rows); err != nil {
		t.Fatalf("%v: %s", err, w.Body)
	}
	out := map[string]keyStatus{}
	for i, row := range rows {
		if i > 0 && rows[i-1].Name > row.Name {
			t.Errorf("rows are not sorted by name: %q before %q", rows[i-1].Name, row.Name)
		}
		out[row.Name] = row
	}
	return out, w.Body.String()
}

func TestKeyStatusShowsTheLimitsInUse(t *testing.T) {
	release := make(chan struct{})
	evs := fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 100, OutputTokens: 50}, "held")
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if strings.Contains(mustRead(req), `"stream":true`) {
			fakeupstream.Held(evs, 4, release, nil)(w, req)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m", "x", fakeupstream.Usage{InputTokens: 100, OutputTokens: 50}))
	}))
	start := time.Unix(1_900_000_000, 0)
	r, clock := limitRelay(t, "kstat", Key{KeyOptions: KeyOptions{Rate: "3/m", Tokens: "1000/m", Concurrency: 2, Priority: "batch",
		Expires: start.Add(time.Minute).Format(time.RFC3339)}}, up.URL)

	rows, _ := keyRows(t)
	want := keyStatus{Name: "kstat", Kind: "key", Group: "kstat", Priority: "batch", Limits: limitsStatus{
		Rate: "3/m", RateRemaining: ptr(int64(3)), Tokens: "1000/m", TokensRemaining: ptr(int64(1000)), Concurrency: 2},
		SpendUSD: map[string]float64{"day": 0, "week": 0, "month": 0}}
	got := rows["kstat"]
	if got.Expires == nil || !got.Expires.Equal(start.Add(time.Minute)) {
		t.Errorf("expires = %v", got.Expires)
	}
	got.Expires = nil
	if !reflect.DeepEqual(got, want) {
		t.Errorf("a fresh key:\n got %s\nwant %s", show(got), show(want))
	}

	// one request done (150 tokens), one stream running
	if w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-kstat")); w.Code != 200 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		w, _ := serveHandler(t, r, newRequest(streamBody, "sk-kstat"))
		if w.Code != 200 {
			t.Errorf("stream: %d", w.Code)
		}
	}()
	waitFor(t, "the stream in flight", 5*time.Second, func() bool { rows, _ := keyRows(t); return rows["kstat"].Limits.Inflight == 1 })
	rows, body := keyRows(t)
	inUse := rows["kstat"].Limits
	// the stream is charged its body's estimate until it ends
	if *inUse.RateRemaining != 1 || *inUse.TokensRemaining >= 850 || *inUse.TokensRemaining < 800 || inUse.Inflight != 1 {
		t.Errorf("in use: %s", show(inUse))
	}
	sum := sha256.Sum256([]byte("sk-kstat"))
	if strings.Contains(body, "sk-kstat") || strings.Contains(body, hex.EncodeToString(sum[:])) || strings.Contains(body, hex.EncodeToString(sum[:8])) {
		t.Errorf("GET /relay/keys shows the secret or its digest: %s", body)
	}
	close(release)
	<-done

	// the relay's clock: the rate refills, the key expires
	clock.advance(time.Minute)
	rows, _ = keyRows(t)
	if got := rows["kstat"]; !got.Expired || *got.Limits.RateRemaining != 3 || *got.Limits.TokensRemaining != 1000 || got.Limits.Inflight != 0 {
		t.Errorf("a minute later: %s", show(got))
	}

	// a handler's Cleanup takes its keys out
	if err := r.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if rows, _ := keyRows(t); rows["kstat"].Name != "" {
		t.Errorf("a cleaned-up handler's key is still listed: %+v", rows["kstat"])
	}
}

func ptr[T any](v T) *T { return &v }

func show(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// adminDo sends a request to Caddy's admin API with a JSON body, and
// returns the status and the answer; header pairs follow the body.
func adminDo(t *testing.T, method, path, body string, header ...string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, adminURL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestKeysChangeLiveThroughTheConfigAPI adds, inserts, changes and removes
// keys through Caddy's config API (by path and by @id) while a stream runs:
// each change takes effect on the next request, the running stream ends
// with all its events, and a key that stays keeps its spent rate.
func TestKeysChangeLiveThroughTheConfigAPI(t *testing.T) {
	const (
		stayKey = "sk-live-stay-0123456789abcdef"
		goneKey = "sk-live-gone-0123456789abcdef"
		newKey  = "sk-live-new-0123456789abcdef"
		putKey  = "sk-live-put-0123456789abcdef"
	)
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 5, OutputTokens: 6}, "one ", "two ", "three ", "four")
	release := make(chan struct{})
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if !strings.Contains(mustRead(req), `"stream":true`) {
			fakeupstream.Message("served")(w, req)
			return
		}
		// a slow stream: a first delta, then nothing until released, then
		// the rest one by one
		fakeupstream.StartStream(w)
		for _, ev := range evs[:4] {
			fakeupstream.WriteEvent(w, ev)
		}
		select {
		case <-release:
		case <-req.Context().Done():
			return
		}
		for _, ev := range evs[4:] {
			time.Sleep(20 * time.Millisecond)
			if !fakeupstream.WriteEvent(w, ev) {
				return
			}
		}
	}))
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	keyJSON := func(name, secret string, extra string) string {
		return fmt.Sprintf(`{"name": %q, "secret": %q, "group": "live"%s}`, name, secret, extra)
	}
	tester := caddytest.NewTester(t)
	tester.InitServer(`{
	"admin": {"listen": "localhost:2999"},
	"logging": {"logs": {"default": {"writer": {"output": "file", "filename": "`+logFile+`"}, "encoder": {"format": "json"}}}},
	"apps": {"http": {"http_port": 9080, "https_port": 9443, "grace_period": 1, "servers": {"srv0": {"listen": [":9080"], "routes": [{"handle": [{
		"handler": "relay",
		"@id": "live-relay",
		"keys": [`+keyJSON("live-stay", sha256Secret(stayKey), `, "rate": "2/m"`)+`, `+keyJSON("live-gone", sha256Secret(goneKey), "")+`],
		"channels": [{"name": "live-ch", "upstream": {"provider": "anthropic", "url": "`+up.URL+`", "api_key": "`+channelKey+`"}}],
		"groups": [{"name": "live", "channels": ["live-ch"]}]
	}]}]}}}}
}`, "json")
	if t.Failed() {
		t.FailNow()
	}
	as := func(key string) reply { return send(t, http.MethodPost, "/v1/messages", key, simpleBody) }
	wantStatus := func(when, key string, status int) reply {
		t.Helper()
		r := as(key)
		if r.status != status {
			t.Fatalf("%s: %s... got %d, want %d: %s", when, key[:12], r.status, status, r.body)
		}
		return r
	}

	// live-stay spends its rate; live-gone opens a stream that stays open
	wantStatus("before", stayKey, 200)
	wantStatus("before", stayKey, 200)
	wantRelayError(t, as(stayKey), 429, "rate_limit_error", "key_rate_limited")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream := openStreamAs(t, ctx, goneKey, streamBody)
	var got strings.Builder
	for ev := stream.next(t); ; ev = stream.next(t) {
		got.WriteString(ev)
		if ev == "" || strings.Contains(ev, `"one "`) {
			break
		}
	}
	if !strings.Contains(got.String(), `"one "`) {
		t.Fatalf("the stream did not start: %q", got.String())
	}

	const byPath = "/config/apps/http/servers/srv0/routes/0/handle/0/keys"
	// POST appends a key (its secret literal: the log warns), DELETE
	// removes live-gone, whose stream is still running
	if code, body := adminDo(t, http.MethodPost, "/id/live-relay/keys", keyJSON("live-new", newKey, "")); code != 200 {
		t.Fatalf("POST a key: %d %s", code, body)
	}
	if code, body := adminDo(t, http.MethodDelete, byPath+"/1", ""); code != 200 {
		t.Fatalf("DELETE a key: %d %s", code, body)
	}
	wantStatus("added by POST", newKey, 200)
	wantRelayError(t, as(goneKey), 401, "authentication_error", "")
	wantRelayError(t, as(stayKey), 429, "rate_limit_error", "key_rate_limited")

	// PUT inserts at an index; PATCH replaces a key
	if code, body := adminDo(t, http.MethodPut, byPath+"/0", keyJSON("live-put", sha256Secret(putKey), "")); code != 200 {
		t.Fatalf("PUT a key: %d %s", code, body)
	}
	wantStatus("inserted by PUT", putKey, 200)
	if code, body := adminDo(t, http.MethodPatch, "/id/live-relay/keys/2", keyJSON("live-new", newKey, `, "disabled": true`)); code != 200 {
		t.Fatalf("PATCH a key: %d %s", code, body)
	}
	wantRelayError(t, as(newKey), 401, "authentication_error", "key_disabled")
	wantRelayError(t, as(stayKey), 429, "rate_limit_error", "key_rate_limited")

	// a key the relay cannot load is refused by the API (Caddy answers
	// 500), naming the key and the field, and the running config stays as
	// it was
	code, body := adminDo(t, http.MethodPost, byPath, keyJSON("live-bad", sha256Secret("sk-live-bad-0123456789abcdef"), `, "expires": "soon"`))
	if code == 200 || !strings.Contains(body, `key \"live-bad\": expires: \"soon\" is not an RFC 3339 time`) {
		t.Errorf("a bad expires: %d %s", code, body)
	}
	wantStatus("after a refused change", putKey, 200)

	// GET /relay/keys follows
	resp, err := client.Get(adminURL + "/relay/keys")
	if err != nil {
		t.Fatal(err)
	}
	var rows []keyStatus
	err = json.NewDecoder(resp.Body).Decode(&rows)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, row := range rows {
		if strings.HasPrefix(row.Name, "live-") {
			names = append(names, row.Name)
		}
		switch row.Name {
		case "live-stay":
			if row.Limits.Rate != "2/m" || row.Limits.RateRemaining == nil || *row.Limits.RateRemaining != 0 {
				t.Errorf("live-stay: %s", show(row))
			}
		case "live-new":
			if !row.Disabled {
				t.Errorf("live-new: %s", show(row))
			}
		}
	}
	if strings.Join(names, " ") != "live-new live-put live-stay" {
		t.Errorf("GET /relay/keys lists %v", names)
	}

	// the stream that ran through five reloads ends with all its events
	close(release)
	got.WriteString(stream.rest(t))
	if got.String() != strings.Join(evs, "") {
		t.Errorf("the running stream:\n got %q\nwant %q", got.String(), strings.Join(evs, ""))
	}

	// the literal secret was warned about, by name, and never logged
	logged, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	warnings := 0
	for _, line := range strings.Split(string(logged), "\n") {
		if strings.Contains(line, "written in the config as it is") {
			warnings++
			if !strings.Contains(line, `live-new`) {
				t.Errorf("the warning must name the key: %s", line)
			}
		}
	}
	if warnings == 0 {
		t.Errorf("no warning about the literal secret in the log:\n%s", logged)
	}
	for _, secret := range []string{stayKey, goneKey, newKey, putKey} {
		if strings.Contains(string(logged), secret) {
			t.Errorf("the log holds a secret")
		}
	}
}
