package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

func TestAdminListsChannels(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Message("a"))
	b := fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")))
	startRelay(t, channelBlock("list-a", a.URL, "priority 2")+channelBlock("list-b", b.URL, "priority 1")+
		"\t\tchannel list-m {\n\t\t\tprovider mock\n\t\t}\n"+
		keyAndGroup("list", "list-a list-b")+"\t\tkey sk-list-2 list2\n\t\tgroup list2 {\n\t\t\tchannels list-a list-m\n\t\t}\n")
	message(t, simpleBody)

	rows := channels(t)
	la, lb := rows["list-a"], rows["list-b"]
	if la.Provider != "anthropic" || strings.Join(la.Groups, ",") != "list,list2" || la.State != stateHealthy ||
		la.Requests != 1 || la.Failures != 0 || la.EWMALatencyMs <= 0 || la.CooldownUntil != nil || la.Inflight != 0 {
		t.Errorf("list-a = %+v", la)
	}
	if lb.State != stateCooldown || lb.Requests != 1 || lb.Failures != 1 || lb.LastError != "transient" ||
		lb.LastErrorReason != "status 503" || lb.CooldownUntil == nil || time.Until(*lb.CooldownUntil) <= 0 {
		t.Errorf("list-b = %+v", lb)
	}
	if rows["list-m"].Provider != "mock" {
		t.Errorf("list-m = %+v", rows["list-m"])
	}

	status, body := adminPost(t, "no-such-channel", "reset")
	var apiErr struct {
		Error string `json:"error"`
	}
	if status != 404 || json.Unmarshal(body, &apiErr) != nil || !strings.Contains(apiErr.Error, "no-such-channel") {
		t.Errorf("unknown channel: %d %s", status, body)
	}
	if status, body := adminPost(t, "list-a", "explode"); status != 404 || !bytes.Contains(body, []byte("explode")) {
		t.Errorf("unknown action: %d %s", status, body)
	}
}

func TestAdminDisableEnableResetRouteTheNextRequest(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Message("a"))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("steer-a", a.URL, "priority 1")+channelBlock("steer-b", b.URL, "priority 2")+keyAndGroup("steer", "steer-a steer-b"))

	if message(t, simpleBody); a.Hits() != 1 {
		t.Fatalf("a should serve first")
	}
	status, body := adminPost(t, "steer-a", "disable")
	if status != 200 || !bytes.Contains(body, []byte(`"state":"disabled"`)) {
		t.Fatalf("disable: %d %s", status, body)
	}
	if message(t, simpleBody); a.Hits() != 1 || b.Hits() != 1 {
		t.Errorf("after disable the very next request must skip a: a=%d b=%d", a.Hits(), b.Hits())
	}
	adminPost(t, "steer-a", "enable")
	if message(t, simpleBody); a.Hits() != 2 {
		t.Errorf("after enable the very next request must use a again: a=%d", a.Hits())
	}

	// a failure cools a for 5s; reset brings it back at once
	a.SetHandler(fakeupstream.Raw(503, []byte("down")))
	message(t, simpleBody)
	a.SetHandler(fakeupstream.Message("a"))
	if message(t, simpleBody); a.Hits() != 3 {
		t.Fatalf("a should be cooling: hits %d", a.Hits())
	}
	if status, body := adminPost(t, "steer-a", "reset"); status != 200 || !bytes.Contains(body, []byte(`"state":"healthy"`)) {
		t.Fatalf("reset: %d %s", status, body)
	}
	if message(t, simpleBody); a.Hits() != 4 {
		t.Errorf("after reset the very next request must use a: hits %d", a.Hits())
	}

	// with every channel disabled: a 503 that says so, without a retry-after
	adminPost(t, "steer-a", "disable")
	adminPost(t, "steer-b", "disable")
	r := message(t, simpleBody)
	wantRelayError(t, r, 503, "relay_error", "no_healthy_channel")
	if !bytes.Contains(r.body, []byte("disabled")) || r.header.Get("Retry-After") != "" || r.header.Get("X-Should-Retry") != "false" {
		t.Errorf("all disabled: %s %v", r.body, r.header)
	}
	adminPost(t, "steer-a", "enable")
	adminPost(t, "steer-b", "enable")
}

func TestDisableDrainsInFlightStream(t *testing.T) {
	evs := fakeupstream.StreamEvents("m", fakeupstream.Usage{}, "first", "second")
	release := make(chan struct{})
	a := fakeupstream.New(t, fakeupstream.Held(evs, 4, release, nil))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("drain-a", a.URL, "priority 1")+channelBlock("drain-b", b.URL, "priority 2")+keyAndGroup("drain", "drain-a drain-b"))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := openStream(t, ctx, streamBody)
	for ev := s.next(t); !strings.Contains(ev, `"first"`); ev = s.next(t) {
		if ev == "" {
			t.Fatal("stream ended early")
		}
	}
	if rows := channels(t); rows["drain-a"].Inflight != 1 {
		t.Errorf("inflight = %d, want the open stream", rows["drain-a"].Inflight)
	}
	adminPost(t, "drain-a", "disable")
	if message(t, simpleBody); b.Hits() != 1 || a.Hits() != 1 {
		t.Errorf("new requests must skip the draining channel: a=%d b=%d", a.Hits(), b.Hits())
	}
	close(release)
	if rest := s.rest(t); !strings.HasSuffix(rest, evs[len(evs)-1]) || strings.Contains(rest, "event: error") {
		t.Errorf("the in-flight stream must finish normally, got:\n%s", rest)
	}
	waitFor(t, "inflight back to 0", 5*time.Second, func() bool { return channels(t)["drain-a"].Inflight == 0 })
	adminPost(t, "drain-a", "enable")
}

// TestReloadKeepsChannelState loads a config, cools a channel, then POSTs a
// new config with other weights through the admin API: the channel is still
// cooling, and its counters carry on.
func TestReloadKeepsChannelState(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	cfg := func(weight int) string {
		return channelBlock("reload-a", a.URL, "cooldown 1m", fmt.Sprintf("weight %d", weight)) +
			channelBlock("reload-b", b.URL, "priority 2") + keyAndGroup("reload", "reload-a reload-b")
	}
	startRelay(t, cfg(1))
	message(t, simpleBody)
	before := channels(t)["reload-a"]
	if before.State != stateCooldown || before.Requests != 1 {
		t.Fatalf("before the reload: %+v", before)
	}

	a.SetHandler(fakeupstream.Message("a"))
	startRelay(t, cfg(50)) // POST /load with changed weights
	if r := message(t, simpleBody); r.status != 200 || a.Hits() != 1 {
		t.Errorf("after the reload the cooling channel was called: hits %d", a.Hits())
	}
	after := channels(t)
	if after["reload-a"].State != stateCooldown || !after["reload-a"].CooldownUntil.Equal(*before.CooldownUntil) {
		t.Errorf("cooldown lost in the reload: %+v", after["reload-a"])
	}
	if after["reload-b"].Requests != 2 || after["reload-a"].Failures != 1 {
		t.Errorf("counters did not carry over: a=%+v b=%+v", after["reload-a"], after["reload-b"])
	}

	// a channel removed from the config is released
	startRelay(t, channelBlock("reload-b", b.URL)+keyAndGroup("reload", "reload-b"))
	if _, ok := channels(t)["reload-a"]; ok {
		t.Errorf("a removed channel should leave GET /relay/channels")
	}
}

func TestAdminAndTrafficConcurrently(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Message("a"))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("conc-a", a.URL)+channelBlock("conc-b", b.URL)+keyAndGroup("conc", "conc-a conc-b"))

	var wg sync.WaitGroup
	errs := make(chan string, 100)
	for w := 0; w < 4; w++ {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for i := 0; i < 25; i++ {
				resp, err := client.Post(relayURL+"/v1/messages", "application/json", strings.NewReader(simpleBody))
				if err != nil {
					errs <- err.Error()
					return
				}
				resp.Body.Close()
			}
		}()
		go func(w int) {
			defer wg.Done()
			for i := 0; i < 25; i++ {
				name := []string{"conc-a", "conc-b"}[(w+i)%2]
				for _, action := range []string{"disable", "enable", "reset"} {
					resp, err := client.Post(adminURL+"/relay/channels/"+name+"/"+action, "", nil)
					if err != nil {
						errs <- err.Error()
						return
					}
					resp.Body.Close()
				}
				if resp, err := client.Get(adminURL + "/relay/channels"); err == nil {
					resp.Body.Close()
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	// every channel ends enabled and nothing is left in flight
	for _, name := range []string{"conc-a", "conc-b"} {
		adminPost(t, name, "enable")
		if st := channels(t)[name]; st.Inflight != 0 || st.State == stateDisabled {
			t.Errorf("%s = %+v", name, st)
		}
	}
}

func TestProbeRecoversChannelBeforeCooldownEnds(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("probe-a", a.URL, "priority 1", "cooldown 10m", "models claude-sonnet-4-5=sonnet-upstream",
		"probe {\n\t\t\t\tinterval 50ms\n\t\t\t}")+channelBlock("probe-b", b.URL, "priority 2")+keyAndGroup("probe", "probe-a probe-b"))

	message(t, simpleBody)
	if st := channels(t)["probe-a"]; st.State != stateCooldown {
		t.Fatalf("probe-a should be cooling for 10m: %+v", st)
	}
	hitsAfterFailure := a.Hits()
	a.SetHandler(fakeupstream.Raw(200, []byte(`{"input_tokens":3}`)))
	waitFor(t, "probe-a healthy again", 5*time.Second, func() bool { return channels(t)["probe-a"].State == stateHealthy })

	probes := a.Requests()[hitsAfterFailure:]
	if len(probes) == 0 {
		t.Fatal("no probe reached the upstream")
	}
	p := probes[len(probes)-1]
	if p.Path != "/v1/messages/count_tokens" || p.Header.Get("X-Api-Key") != channelKey || p.Header.Get("Anthropic-Version") != "2023-06-01" ||
		!bytes.Contains(p.Body, []byte(`"model":"sonnet-upstream"`)) {
		t.Errorf("probe request: %s %v %s", p.Path, p.Header, p.Body)
	}
	// count_tokens refuses max_tokens as an unknown field
	if bytes.Contains(p.Body, []byte("max_tokens")) {
		t.Errorf("the probe counts tokens with a max_tokens: %s", p.Body)
	}
	if st := channels(t)["probe-a"]; st.Requests != 1 {
		t.Errorf("probes must not count as traffic: requests = %d", st.Requests)
	}
	a.SetHandler(fakeupstream.Message("a again"))
	if r := message(t, simpleBody); !bytes.Contains(r.body, []byte("a again")) {
		t.Errorf("the recovered channel should serve: %s", r.body)
	}
}

func TestWaitForRecoveryServesOnceAChannelRecovers(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")))
	startRelay(t, channelBlock("wait-a", a.URL, "cooldown 400ms")+keyAndGroup("wait", "wait-a", "wait_for_recovery 5s"))
	if r := message(t, simpleBody); r.status != 503 {
		t.Fatalf("first request: %d", r.status)
	}
	a.SetHandler(fakeupstream.Message("recovered"))
	start := time.Now()
	r := message(t, simpleBody)
	if r.status != 200 || !bytes.Contains(r.body, []byte("recovered")) {
		t.Fatalf("the waiting request should be served after the recovery: %d %s", r.status, r.body)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("waited %v; the channel recovered after 400ms", d)
	}

	// without the wait, the same situation answers 503 at once
	a.SetHandler(fakeupstream.Raw(503, []byte("down")))
	startRelay(t, channelBlock("nowait-a", a.URL, "cooldown 1m")+keyAndGroup("nowait", "nowait-a"))
	message(t, simpleBody)
	r = message(t, simpleBody)
	wantRelayError(t, r, 503, "relay_error", "no_healthy_channel")
	if ra := r.header.Get("Retry-After"); ra != "60" && ra != "59" {
		t.Errorf("retry-after = %q, want the ~60s to the recovery", ra)
	}
}

func TestRetryBudgetCapsAttemptsInAnOutage(t *testing.T) {
	var cfg strings.Builder
	ups := make([]*fakeupstream.Upstream, 3)
	for i := range ups {
		ups[i] = fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")))
		// no cooldown and no breaker to speak of: only the budget holds back
		cfg.WriteString(channelBlock(fmt.Sprintf("budget-%d", i), ups[i].URL, "cooldown 1ns", "max_cooldown 1ns",
			"breaker {\n\t\t\t\tmin_requests 1000000\n\t\t\t}"))
	}
	cfg.WriteString(keyAndGroup("budget", "budget-0 budget-1 budget-2", "retries 2", "retry_budget 20% 1/s"))
	startRelay(t, cfg.String())

	const requests = 100
	for i := 0; i < requests; i++ {
		if r := message(t, simpleBody); r.status != 503 {
			t.Fatalf("request %d: %d", i, r.status)
		}
	}
	attempts := ups[0].Hits() + ups[1].Hits() + ups[2].Hits()
	// without a budget: 3 attempts a request; with it: 100 first attempts
	// and retries within max(20% of requests, 1/s over 10s)
	if attempts > requests+20 || attempts < requests+10 {
		t.Errorf("%d attempts for %d requests, want between %d (the floor) and %d (20%%)", attempts, requests, requests+10, requests+20)
	}
}

func TestBreakerOpensEndToEnd(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Raw(500, []byte("err")))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("brk-a", a.URL, "priority 1", "cooldown 1ns", "max_cooldown 1ns",
		"breaker {\n\t\t\t\tmin_requests 3\n\t\t\t\tfailure_ratio 50%\n\t\t\t\topen_for 1m\n\t\t\t}")+
		channelBlock("brk-b", b.URL, "priority 2")+keyAndGroup("brk", "brk-a brk-b"))
	for i := 0; i < 3; i++ { // a 1ns cooldown is over by the next request
		message(t, simpleBody)
	}
	if a.Hits() != 3 {
		t.Fatalf("a hits = %d, want 3", a.Hits())
	}
	st := channels(t)["brk-a"]
	if st.State != stateOpen || st.CooldownUntil == nil || time.Until(*st.CooldownUntil) < 50*time.Second {
		t.Errorf("after 3 failures of 3 the breaker should be open for 1m: %+v", st)
	}
	message(t, simpleBody)
	if a.Hits() != 3 {
		t.Errorf("an open channel was called")
	}
}

func TestReloadKeepsUpstreamConnections(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	cfg := func(weight int, transport string) string {
		return channelBlock("conn-a", up.URL, fmt.Sprintf("weight %d", weight), transport) + keyAndGroup("conn", "conn-a")
	}
	startRelay(t, cfg(1, ""))
	message(t, simpleBody)
	if n := up.Conns(); n != 1 {
		t.Fatalf("connections after the first request: %d", n)
	}
	startRelay(t, cfg(2, "")) // a reload that leaves the transport as it was
	message(t, simpleBody)
	if n := up.Conns(); n != 1 {
		t.Errorf("a reload with the same transport dialed again: %d connections", n)
	}
	startRelay(t, cfg(2, "transport http {\n\t\t\t\tdial_timeout 7s\n\t\t\t}"))
	message(t, simpleBody)
	if n := up.Conns(); n != 2 {
		t.Errorf("a changed transport must be a new one: %d connections, want 2", n)
	}
}

func TestAdminErrorsAreJSON(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, channelBlock("admin-json", up.URL)+keyAndGroup("admin-json", "admin-json"))
	for _, c := range []struct {
		method, path string
		status       int
		allow, says  string
	}{
		{http.MethodGet, "/relay/channels/admin-json", 404, "", "no relay admin route"},
		{http.MethodGet, "/relay/nothing", 404, "", "no relay admin route"},
		{http.MethodGet, "/relay/channels/admin-json/disable", 405, "POST", "use POST"},
		{http.MethodPost, "/relay/channels", 405, "GET", "use GET"},
		{http.MethodDelete, "/relay/keys", 405, "GET", "use GET"},
		{http.MethodGet, "/relay/keys/admin-json", 404, "", "GET /relay/keys"},
		{http.MethodPost, "/relay/channels/no-such-channel/reset", 404, "", `unknown channel "no-such-channel"`},
		{http.MethodPost, "/relay/channels/admin-json/explode", 404, "", `unknown action "explode"`},
	} {
		req, _ := http.NewRequest(c.method, adminURL+c.path, nil)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body struct {
			Error string `json:"error"`
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		err = json.Unmarshal(raw, &body)
		if bytes.Contains(raw, []byte(`\u003c`)) || strings.Contains(body.Error, "/relay/channels/<name>/") && !bytes.Contains(raw, []byte("/relay/channels/<name>/")) {
			t.Errorf("%s %s: the error escapes < for HTML: %s", c.method, c.path, raw)
		}
		if resp.StatusCode != c.status || err != nil || !strings.Contains(body.Error, c.says) ||
			resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("Allow") != c.allow {
			t.Errorf("%s %s: %d %q (%v), Allow %q; want %d JSON saying %q, Allow %q",
				c.method, c.path, resp.StatusCode, body.Error, err, resp.Header.Get("Allow"), c.status, c.says, c.allow)
		}
	}
	if code, _ := adminPost(t, "admin-json", "disable"); code != 200 {
		t.Errorf("the right method still works: %d", code)
	}
	adminPost(t, "admin-json", "enable")
}
