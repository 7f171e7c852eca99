package relay

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
)

// statusSite mounts the status page at /status/ of the test site.
const statusSite = "\trelay_status /status/*\n"

const statusResourceSecret = "status-test-resource-secret-0123456789abcdef"

// startStatusRelay starts a relay with the page at /status/ and one group
// `stg` (key clientKey) of the channels given.
func startStatusRelay(t *testing.T, channels ...string) {
	t.Helper()
	var blocks, names strings.Builder
	for i := 0; i+1 < len(channels); i += 2 {
		blocks.WriteString(channelBlock(channels[i], channels[i+1], "cooldown 30s"))
		names.WriteString(" " + channels[i])
	}
	startRelayWith(t, statusSite, "\t\tresource_secret "+statusResourceSecret+"\n"+blocks.String()+keyAndGroup("stg", names.String(), "retries 0"))
}

// get fetches a path of the test site.
func get(t *testing.T, path string) (int, http.Header, string) {
	t.Helper()
	resp, err := client.Get(relayURL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// readStatusEvents reads the page's event stream until it has seen a requests
// event and a state event, and returns what it read.
func readStatusEvents(t *testing.T) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, relayURL+"/status/events", nil)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("events: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var all strings.Builder
	sawState, sawRequests := false, false
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 4<<20)
	for sc.Scan() {
		line := sc.Text()
		all.WriteString(line + "\n")
		if line == "" && sawState && sawRequests {
			break // the end of the event
		}
		sawState = sawState || line == "event: state"
		sawRequests = sawRequests || line == "event: requests"
	}
	if !sawState || !sawRequests {
		t.Fatalf("events ended before a state and a requests event: %v\n%s", sc.Err(), all.String())
	}
	return all.String()
}

func TestStatusPageShowsNoSecret(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	startStatusRelay(t, "st-secret", up.URL)
	if r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`); r.status != 200 {
		t.Fatalf("message: %d %s", r.status, r.body)
	}
	send(t, http.MethodPost, "/v1/messages", "sk-wrong-key-0000000000000", `{}`)

	status, h, page := get(t, "/status/")
	if status != 200 || !strings.HasPrefix(h.Get("Content-Type"), "text/html") {
		t.Fatalf("page: %d %s", status, h.Get("Content-Type"))
	}
	if csp := h.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "script-src 'self'") || strings.Contains(csp, "unsafe") {
		t.Errorf("Content-Security-Policy: %q", csp)
	}
	if strings.Contains(page, "<script>") || strings.Contains(page, "<style") || strings.Contains(page, "http") && strings.Contains(page, "://") {
		t.Error("the page has inline code or names another origin")
	}
	_, _, script := get(t, "/status/status.js")
	_, _, style := get(t, "/status/status.css")
	if !strings.Contains(script, "EventSource") || !strings.Contains(style, "prefers-color-scheme") {
		t.Fatal("script or style not served")
	}
	events := readStatusEvents(t)
	if !strings.Contains(events, `"st-secret"`) || !strings.Contains(events, `"claude-sonnet-4-5"`) {
		t.Fatalf("the events lack the channel or the request:\n%s", events)
	}
	digest := func(s string) string { d := sha256.Sum256([]byte(s)); return hex.EncodeToString(d[:]) }
	for _, secret := range []string{channelKey, clientKey, digest(clientKey), digest(channelKey), statusResourceSecret} {
		for what, text := range map[string]string{"page": page, "script": script, "style": style, "events": events} {
			if strings.Contains(text, secret) {
				t.Errorf("the %s shows the secret %q", what, secret)
			}
		}
	}
}

func TestStatusActionsAreSameOriginPOSTs(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	startStatusRelay(t, "st-act", up.URL)
	post := func(path string, header ...string) int {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, relayURL+path, nil)
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, c := range []struct {
		name   string
		header []string
	}{
		{"another origin", []string{"Origin", "http://evil.example"}},
		{"another port", []string{"Origin", "http://localhost:9081"}},
		{"cross-site fetch", []string{"Sec-Fetch-Site", "cross-site", "Origin", "http://localhost:9080"}},
		{"same-site fetch", []string{"Sec-Fetch-Site", "same-site"}},
		{"same-origin fetch without an origin", []string{"Sec-Fetch-Site", "same-origin"}},
		{"no origin at all", nil},
		{"opaque origin", []string{"Origin", "null"}},
	} {
		if got := post("/status/channels/st-act/disable", c.header...); got != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", c.name, got)
		}
	}
	if st := channels(t)["st-act"].State; st != stateHealthy {
		t.Fatalf("a refused action changed the channel: %s", st)
	}
	if got := post("/status/channels/st-act/disable", "Origin", relayURL, "Sec-Fetch-Site", "same-origin"); got != 200 {
		t.Fatalf("same-origin disable: %d", got)
	}
	if st := channels(t)["st-act"].State; st != stateDisabled {
		t.Fatalf("after disable: %s", st)
	}
	if got := post("/status/channels/st-act/enable", "Origin", relayURL); got != 200 || channels(t)["st-act"].State != stateHealthy {
		t.Fatalf("same-origin enable: %d %s", got, channels(t)["st-act"].State)
	}
	if got := post("/status/channels/nope/disable", "Origin", relayURL); got != 404 {
		t.Errorf("unknown channel: %d", got)
	}
	if got := post("/status/channels/st-act/explode", "Origin", relayURL); got != 404 {
		t.Errorf("unknown action: %d", got)
	}
	if status, _, _ := get(t, "/status/channels/st-act/disable"); status != http.StatusMethodNotAllowed {
		t.Errorf("GET of an action: %d", status)
	}
	if got := post("/status/", "Origin", relayURL); got != http.StatusMethodNotAllowed {
		t.Errorf("POST of the page: %d", got)
	}
}

// TestStatusPageAnswersOnlyItsOwnHosts is a DNS-rebinding page: a name
// of the attacker's that resolves to 127.0.0.1 makes the browser send the
// page's own origin, with the attacker's name as Host and Origin. A site
// that names no host serves the page's data and actions to loopback names
// only; a site that names its host, to that host.
func TestStatusPageAnswersOnlyItsOwnHosts(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	tester := caddytest.NewTester(t)
	tester.InitServer(testGlobal+"http://localhost:9080 {\n\trelay {\n"+channelBlock("st-host", up.URL)+keyAndGroup("sth", "st-host")+"\t}\n}\n"+
		"http://:9081 {\n\tbind 127.0.0.1\n\trelay_status\n}\n"+
		"http://status.example:9082 {\n\tbind 127.0.0.1\n\trelay_status\n}\n", "caddyfile")
	// served says whether the page answered: its action's JSON, or its
	// event stream
	served := func(method, addr, host, path string) bool {
		t.Helper()
		req, _ := http.NewRequest(method, "http://"+addr+path, nil)
		req.Host = host
		req.Header.Set("Origin", "http://"+host)
		req.Header.Set("Sec-Fetch-Site", "same-origin")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close() // an event stream ends here, after its headers
		ct := resp.Header.Get("Content-Type")
		return resp.StatusCode == 200 && (ct == "text/event-stream" || ct == "application/json")
	}
	for _, c := range []struct {
		addr, host string
		want       bool
	}{
		{"127.0.0.1:9081", "rebind.attacker.example:9081", false},
		{"127.0.0.1:9081", "rebind.attacker.example", false},
		{"127.0.0.1:9082", "rebind.attacker.example:9082", false}, // Caddy routes it nowhere
		{"127.0.0.1:9081", "localhost:9081", true},
		{"127.0.0.1:9081", "127.0.0.1:9081", true},
		{"127.0.0.1:9081", "[::1]:9081", true},
		{"127.0.0.1:9082", "status.example:9082", true},
	} {
		for _, data := range []string{"/events", "/spend"} {
			if got := served(http.MethodGet, c.addr, c.host, data); got != c.want {
				t.Errorf("%s with Host %s: served %v, want %v", data, c.host, got, c.want)
			}
		}
		got := served(http.MethodPost, c.addr, c.host, "/channels/st-host/disable")
		disabled := channels(t)["st-host"].State == stateDisabled
		if got != c.want || disabled != c.want {
			t.Errorf("disable with Host %s: served %v, channel disabled %v; want %v", c.host, got, disabled, c.want)
		}
		if _, err := steerChannel("st-host", "enable"); err != nil {
			t.Fatal(err)
		}
	}
}

func TestStatusRingKeepsTheLastRequests(t *testing.T) {
	g := new(requestRing)
	ch := &channel{name: "ring-ch"}
	in := &inbound{id: "req", start: time.Unix(100, 0), ask: asked{model: "m"}, grant: granted{target: "m"}, end: ending{answered: ch, status: 200, attempts: 1}}
	in.end.chain = append(in.chainBuf[:0], attemptRecord{channel: "ring-ch", outcome: outcomeSuccess})
	if n := testing.AllocsPerRun(100, func() { g.record(in, time.Millisecond, 0.5) }); n != 0 {
		t.Errorf("record allocates %v times", n)
	}
	for i := range recentSize + 5 {
		in.id = fmt.Sprint("r", i)
		g.record(in, time.Millisecond, 0.5)
	}
	rows, last := g.since(0)
	if len(rows) != recentSize || rows[0].id != "r5" || rows[len(rows)-1].id != fmt.Sprint("r", recentSize+4) || last != rows[len(rows)-1].seq {
		t.Fatalf("%d rows, first %s, last %s, seq %d", len(rows), rows[0].id, rows[len(rows)-1].id, last)
	}
	more, _ := g.since(last - 2)
	if len(more) != 2 || more[1].seq != last {
		t.Fatalf("since: %d rows", len(more))
	}
	if none, _ := g.since(last); len(none) != 0 {
		t.Fatalf("since the newest: %d rows", len(none))
	}
	row := rows[0].row()
	if row.Channel != "ring-ch" || len(row.Chain) != 1 || row.Chain[0] != "ring-ch:success" || row.CostUSD != 0.5 {
		t.Fatalf("row: %+v", row)
	}
}

func TestStatusCaddyfile(t *testing.T) {
	for _, c := range []struct{ in, err string }{
		{"relay_status", ""},
		{"relay_status extra", "wrong argument count"},
		{"relay_status {\n\tfoo\n}", "takes no options"},
	} {
		d := caddyfile.NewTestDispenser(c.in)
		err := new(StatusPage).UnmarshalCaddyfile(d)
		if (err == nil) != (c.err == "") || err != nil && !strings.Contains(err.Error(), c.err) {
			t.Errorf("%q: %v, want %q", c.in, err, c.err)
		}
	}
}

// BenchmarkStatusRecord is the request path's share of the status page:
// writing one ring slot.
func BenchmarkStatusRecord(b *testing.B) {
	g := new(requestRing)
	ch := &channel{name: "ring-ch"}
	in := &inbound{id: "req", start: time.Unix(100, 0), ask: asked{model: "m"}, grant: granted{target: "m"}, end: ending{answered: ch, status: 200, attempts: 1}}
	in.end.chain = append(in.chainBuf[:0], attemptRecord{channel: "ring-ch", outcome: outcomeSuccess})
	b.ReportAllocs()
	for b.Loop() {
		g.record(in, time.Millisecond, 0.5)
	}
}

func TestStatusShowsTheFleet(t *testing.T) {
	srv := redistest.Start(t)
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	startRelayWith(t, statusSite, "\t\tstorage redis {\n\t\t\taddress "+srv.Addr+"\n\t\t\tprefix status-fleet:\n\t\t}\n"+
		channelBlock("st-fleet", up.URL)+keyAndGroup("stg", "st-fleet"))
	message(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
	events := readStatusEvents(t)
	if !strings.Contains(events, `"fleet":[{"id":"`+fleet.ThisNode().ID+`"`) || !strings.Contains(events, `"state":"up"`) {
		t.Fatalf("the events do not list this node in the fleet:\n%s", events)
	}
}

func TestStatusPagePaths(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	startStatusRelay(t, "st-paths", up.URL)
	noRedirect := &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := noRedirect.Get(relayURL + "/status/board")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusFound || resp.Header.Get("Location") != "./board/" {
		t.Errorf("a path without its slash: %d, Location %q", resp.StatusCode, resp.Header.Get("Location"))
	}
	for path, mime := range map[string]string{"/status/": "text/html", "/status/board/": "text/html", "/status/status.js": "text/javascript", "/status/status.css": "text/css"} {
		status, h, _ := get(t, path)
		if status != 200 || !strings.HasPrefix(h.Get("Content-Type"), mime) || h.Get("X-Content-Type-Options") != "nosniff" || h.Get("Content-Security-Policy") != statusCSP {
			t.Errorf("%s: %d %q %q", path, status, h.Get("Content-Type"), h.Get("Content-Security-Policy"))
		}
	}
	// the relay still answers the rest of the site
	if status, _, _ := get(t, "/v1/models"); status != http.StatusUnauthorized {
		t.Errorf("the relay beside the page: %d", status)
	}
}

// TestStatusPageShowsTheKeysInUse: the status page is sent to every viewer
// each time it changes, so it lists the keys that have served a request, at
// most statusMaxKeys of them, and counts the others.
func TestStatusPageShowsTheKeysInUse(t *testing.T) {
	var lines []string
	for i := range statusMaxKeys + 100 {
		lines = append(lines, fmt.Sprintf(`{"secret": "sk-many-%04d-0123456789abcdef", "group": "many", "name": "many-%04d"}`, i, i))
	}
	r := &Relay{KeysFile: writeKeysFile(t, strings.Join(lines, "\n")),
		Channels: []*Channel{{Name: "many-ch", UpstreamRaw: upstream("mock")}},
		Groups:   []*Group{{Name: "many", Channels: []string{"many-ch"}}}}
	provisionHandler(t, r)
	mine := func(snap statusSnapshot) (n int) {
		for _, k := range snap.Keys {
			if strings.HasPrefix(k.Name, "many-") {
				n++
			}
		}
		return n
	}
	if w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-many-0007-0123456789abcdef")); w.Code != 200 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	snap := snapshot(time.Now(), nil, nil)
	if mine(snap) != 1 || snap.KeysTotal < statusMaxKeys+100 {
		t.Fatalf("after one key's request: %d of the keys shown, %d keys counted", mine(snap), snap.KeysTotal)
	}
	for _, k := range r.keys {
		r.activate(k)
	}
	if snap := snapshot(time.Now(), nil, nil); len(snap.Keys) != statusMaxKeys {
		t.Errorf("with every key in use: %d keys shown, want %d", len(snap.Keys), statusMaxKeys)
	}
}
