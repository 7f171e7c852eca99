package relay

// What a hostile tenant tries, with a valid key of the cheapest group and
// nothing else, each reproduced against a real Caddy: the promises of
// docs/security.md, one test each.

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"runtime/metrics"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	dto "github.com/prometheus/client_model/go"
	"github.com/tidwall/gjson"
)

// twoGroups renders a free key and a production key whose groups share the
// same channels.
func twoGroups(channels string) string {
	return "\t\tkey sk-free-tenant-0123456789 free\n\t\tkey " + clientKey + " production\n" +
		"\t\tgroup free {\n\t\t\tchannels " + channels + "\n\t\t}\n" +
		"\t\tgroup production {\n\t\t\tchannels " + channels + "\n\t\t}\n"
}

// echoBeta answers as Anthropic does when a request carries an
// anthropic-beta value it does not know: a 400 whose message quotes it.
func echoBeta(w http.ResponseWriter, r *http.Request) {
	if beta := r.Header.Get("Anthropic-Beta"); beta != "" {
		fakeupstream.Error(400, "invalid_request_error",
			"Unexpected value(s) `"+beta+"` for the `anthropic-beta` header. Please consult our documentation at docs.claude.com or try again without the header.")(w, r)
		return
	}
	fakeupstream.Message("served")(w, r)
}

func TestAHeaderCannotCoolASharedChannel(t *testing.T) {
	a, b := fakeupstream.New(t, http.HandlerFunc(echoBeta)), fakeupstream.New(t, http.HandlerFunc(echoBeta))
	startRelay(t, channelBlock("hostile-beta-a", a.URL)+channelBlock("hostile-beta-b", b.URL)+twoGroups("hostile-beta-a hostile-beta-b"))

	for _, beta := range []string{"credit balance is too low", "Your credit balance is too low", "CREDIT BALANCE IS TOO LOW"} {
		r := send(t, http.MethodPost, "/v1/messages", "sk-free-tenant-0123456789", simpleBody, "Anthropic-Beta", beta)
		if r.status != 400 || !strings.Contains(string(r.body), beta) {
			t.Fatalf("the upstream's 400 should reach the client as it is: %d %s", r.status, r.body)
		}
		if r.header.Get("X-Relay-Attempts") != "" {
			t.Errorf("a client error was retried: x-relay-attempts %s", r.header.Get("X-Relay-Attempts"))
		}
	}
	for name, st := range channels(t) {
		if strings.HasPrefix(name, "hostile-beta-") && (st.State != stateHealthy || st.CooldownUntil != nil) {
			t.Errorf("%s was cooled by a request header: %+v", name, st)
		}
	}
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("the production key lost its channels to another tenant's header: %d %s", r.status, r.body)
	}
}

func TestTheRealBillingErrorStillCools(t *testing.T) {
	broke := fakeupstream.New(t, fakeupstream.Error(400, "invalid_request_error",
		"Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade or purchase credits."))
	ok := fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, channelBlock("hostile-bill-a", broke.URL, "priority 1")+channelBlock("hostile-bill-b", ok.URL, "priority 2")+
		keyAndGroup("hostile-bill", "hostile-bill-a hostile-bill-b"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("failover: %d %s", r.status, r.body)
	}
	st := channels(t)["hostile-bill-a"]
	if st.LastError != "auth" || st.CooldownUntil == nil || time.Until(*st.CooldownUntil) < 29*time.Minute {
		t.Errorf("an account out of credit should cool for auth_cooldown: %+v", st)
	}
}

// byModel answers 403 (as refuse does) for requests whose path names
// refused, and a message otherwise.
func byModel(refused string, refuse http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, refused) {
			refuse(w, r)
			return
		}
		fakeupstream.Message("from "+r.URL.Path)(w, r)
	}
}

func TestARefusedModelIsSetAsideAloneOnBedrock(t *testing.T) {
	fb := newFakeBedrock(t, byModel("claude-opus", bedrockFailure(403, "AccessDeniedException", "You don't have access to the model with the specified model ID.")))
	fallback := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	// the bedrock channel lists no models: the client picks the model id
	bedrock := strings.Replace(bedrockChannel(t, "hostile-br", fb.URL, "priority 1"),
		"\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n", "", 1)
	startRelay(t, bedrock+channelBlock("hostile-br-fallback", fallback.URL, "priority 2")+
		keyAndGroup("hostile-br", "hostile-br hostile-br-fallback", "expose_channel")+
		"\t\tkey sk-bedrock-only-0123456789 hostile-br-only\n\t\tgroup hostile-br-only {\n\t\t\tchannels hostile-br\n\t\t}\n")
	opus := `{"model":"claude-opus-4-1","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	sonnet := `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`

	r := message(t, opus)
	if r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br-fallback" || fb.Hits() != 1 {
		t.Fatalf("a refused model should fail over: %d %s via %q, bedrock hits %d", r.status, r.body, r.header.Get("X-Relay-Channel"), fb.Hits())
	}
	st := channels(t)["hostile-br"]
	if st.State != stateHealthy || st.CooldownUntil != nil || st.LastError != "model_refused" {
		t.Errorf("a model refusal must not cool the channel: %+v", st)
	}
	if until, ok := st.RefusedModels["claude-opus-4-1"]; !ok || time.Until(until) < 59*time.Minute || len(st.RefusedModels) != 1 {
		t.Errorf("only claude-opus-4-1 should be set aside, for capability_ttl: %v", st.RefusedModels)
	}
	// the refusal is remembered: the model goes elsewhere without asking
	if r := message(t, opus); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br-fallback" || fb.Hits() != 1 {
		t.Errorf("the refused model was asked again: %d via %q, bedrock hits %d", r.status, r.header.Get("X-Relay-Channel"), fb.Hits())
	}
	// and other models are served by the channel as before
	if r := message(t, sonnet); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br" {
		t.Errorf("another model should still be served by the channel: %d %s via %q", r.status, r.body, r.header.Get("X-Relay-Channel"))
	}
	// a group that has no other channel: the upstream's answer, then the
	// relay's own model_not_found without asking the upstream again
	hits := fb.Hits()
	if r := send(t, http.MethodPost, "/v1/messages", "sk-bedrock-only-0123456789", opus); r.status != 503 || fb.Hits() != hits {
		t.Errorf("a model every channel refused: %d %s, bedrock hits %d, want %d", r.status, r.body, fb.Hits(), hits)
	} else {
		wantRelayError(t, r, 503, "relay_error", "model_not_found")
	}
	// the admin reset forgets the refusal
	if code, body := adminPost(t, "hostile-br", "reset"); code != 200 || strings.Contains(string(body), "refused_models") {
		t.Fatalf("reset: %d %s", code, body)
	}
	if message(t, opus); fb.Hits() != hits+1 {
		t.Errorf("after a reset the channel should be asked again: bedrock hits %d, want %d", fb.Hits(), hits+1)
	}
}

func TestARefusedModelIsSetAsideAloneOnVertex(t *testing.T) {
	g := newFakeGoogle(t, 3600)
	vx := fakeVertex(t, g, byModel("claude-opus", googleError(400, "FAILED_PRECONDITION",
		"Publisher Model `projects/p/locations/us-east5/publishers/anthropic/models/claude-opus-4-1` is not enabled for this project.", false)))
	fallback := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, vertexBlock("hostile-vx", vx.URL, g.serviceAccountFile(t), "priority 1")+channelBlock("hostile-vx-fallback", fallback.URL, "priority 2")+
		keyAndGroup("hostile-vx", "hostile-vx hostile-vx-fallback", "expose_channel"))
	r := message(t, `{"model":"claude-opus-4-1","max_tokens":16,"messages":[]}`)
	if r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-vx-fallback" {
		t.Fatalf("a model not enabled for the project should fail over: %d %s", r.status, r.body)
	}
	st := channels(t)["hostile-vx"]
	if _, ok := st.RefusedModels["claude-opus-4-1"]; st.State != stateHealthy || st.CooldownUntil != nil || !ok {
		t.Errorf("FAILED_PRECONDITION must set the model aside, not cool the channel: %+v", st)
	}
	if r := message(t, simpleBody); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-vx" {
		t.Errorf("another model should still be served by the channel: %d via %q", r.status, r.header.Get("X-Relay-Channel"))
	}
}

func TestSmuggledSecondModelIsRefused(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, channelBlock("hostile-smuggle", up.URL, "models claude-sonnet-4-5")+keyAndGroup("hostile-smuggle", "hostile-smuggle"))
	for name, body := range map[string]string{
		"a second object":  `{"model":"claude-opus-4-1","max_tokens":16,"messages":[]} {"model":"claude-sonnet-4-5"}`,
		"a duplicate key":  `{"model":"claude-opus-4-1","max_tokens":16,"model":"claude-sonnet-4-5","messages":[]}`,
		"an escaped twin":  `{"model":"claude-sonnet-4-5","mod\u0065l":"claude-opus-4-1","messages":[]}`,
		"a broken nesting": `{"model":"claude-sonnet-4-5","messages":[{"role":"user" "model":"claude-opus-4-1"}]}`,
	} {
		t.Run(name, func(t *testing.T) {
			wantRelayError(t, message(t, body), 400, "invalid_request_error", "")
		})
	}
	if up.Hits() != 0 {
		t.Errorf("a smuggling body reached the upstream %d times", up.Hits())
	}
}

func TestModelNamesAreCheckedBeforeAnyURL(t *testing.T) {
	fb := newFakeBedrock(t, fakeupstream.Message("served"))
	bedrock := strings.Replace(bedrockChannel(t, "hostile-dots", fb.URL),
		"\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n", "", 1)
	startRelay(t, bedrock+keyAndGroup("hostile-dots", "hostile-dots"))
	for _, model := range []string{"..", ".", "a/../invoke", "../../v1/x", "claude sonnet", strings.Repeat("m", 900<<10)} {
		r := message(t, `{"model":"`+model+`","max_tokens":1,"messages":[]}`)
		wantRelayError(t, r, 400, "invalid_request_error", "")
		if len(r.body) > 1024 {
			t.Errorf("the error echoes the model: %d bytes", len(r.body))
		}
	}
	if fb.Hits() != 0 {
		t.Errorf("a model that is not an id reached Bedrock %d times: %v", fb.Hits(), fb.Requests()[0].Path)
	}
	// ids as the clouds spell them still pass, signed correctly
	for _, model := range []string{"us.anthropic.claude-sonnet-4-5-20250929-v1:0", "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/a1b2c3"} {
		if r := message(t, `{"model":"`+model+`","max_tokens":1,"messages":[]}`); r.status != 200 {
			t.Errorf("model %q: %d %s", model, r.status, r.body)
		}
	}
	if bad := fb.refused(); len(bad) > 0 {
		t.Errorf("signatures refused: %v", bad)
	}
}

// slowRequest opens a connection to the relay and sends the headers of a
// request that declares a body of size bytes, and the first bytes of it.
func slowRequest(t *testing.T, key string, size int) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", "127.0.0.1:9080")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	_, err = fmt.Fprintf(conn, "POST /v1/messages HTTP/1.1\r\nHost: localhost:9080\r\nX-Api-Key: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", key, size)
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

// heapAllocated is every byte the process allocated on the heap so far.
func heapAllocated() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func TestSlowBodiesReserveNoMemoryAndTimeOut(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, "\t\tread_body_timeout 1s\n"+channelBlock("hostile-slow", up.URL)+keyAndGroup("hostile-slow", "hostile-slow"))

	// 40 clients each declare a 32 MiB body and send one byte of it. Before,
	// each declaration reserved its 32 MiB at once: 1.3 GB for 40 bytes.
	const clients, declared = 40, 32 << 20
	before := heapAllocated()
	var wg sync.WaitGroup
	statuses := make(chan string, clients)
	for i := 0; i < clients; i++ {
		conn := slowRequest(t, clientKey, declared)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = conn.SetReadDeadline(time.Now().Add(15 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				statuses <- err.Error()
				return
			}
			defer resp.Body.Close()
			var b strings.Builder
			_, _ = bufio.NewReader(resp.Body).WriteTo(&b)
			statuses <- fmt.Sprintf("%d %s", resp.StatusCode, gjson.Get(b.String(), "error.type"))
		}()
	}
	wg.Wait()
	close(statuses)
	for s := range statuses {
		if s != "408 timeout_error" {
			t.Errorf("a client that stopped sending got %q, want 408 timeout_error after read_body_timeout", s)
		}
	}
	// the bound: what 40 requests allocate in all, far below one body
	if grew := heapAllocated() - before; grew > 64<<20 {
		t.Errorf("40 slow clients made the relay allocate %d MiB, want under 64 MiB", grew>>20)
	}
	if up.Hits() != 0 {
		t.Errorf("an incomplete body reached the upstream")
	}
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("after the timeouts: %d %s", r.status, r.body)
	}
}

func TestAKeysSlowClientsWaitForItsSlot(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, channelBlock("hostile-slot", up.URL)+
		"\t\tkey "+clientKey+" hostile-slot {\n\t\t\tconcurrency 1\n\t\t}\n\t\tgroup hostile-slot {\n\t\t\tchannels hostile-slot\n\t\t}\n")
	conn := slowRequest(t, clientKey, 1<<20)
	// the slow request holds the key's one slot while its body trickles
	// in: the next request is refused before its body is read
	waitFor(t, "a request refused while the slow one holds the slot", 5*time.Second, func() bool {
		r := message(t, simpleBody)
		if r.status == 429 {
			wantRelayError(t, r, 429, "rate_limit_error", "key_rate_limited")
		}
		return r.status == 429
	})
	conn.Close() // the slow client gives up: its slot comes back
	waitFor(t, "the slot back", 5*time.Second, func() bool { return message(t, simpleBody).status == 200 })
}

func TestClientLeavingBeforeTheFirstByteEndsTheRequest(t *testing.T) {
	arrived := make(chan struct{}, 3)
	hold := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done()
	})
	ups := []*fakeupstream.Upstream{fakeupstream.New(t, hold), fakeupstream.New(t, hold), fakeupstream.New(t, hold)}
	startRelay(t, channelBlock("hostile-gone-a", ups[0].URL)+channelBlock("hostile-gone-b", ups[1].URL)+
		channelBlock("hostile-gone-c", ups[2].URL)+keyAndGroup("hostile-gone", "hostile-gone-a hostile-gone-b hostile-gone-c"))
	mf, _ := scrape(t)
	left := func(mf map[string]*dto.MetricFamily) float64 {
		return max(value(mf, "relay_requests_total", "group=hostile-gone", "code=499"), 0)
	}
	leftBefore := left(mf)

	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, relayURL+"/v1/messages", strings.NewReader(simpleBody))
	req.Header.Set("X-Api-Key", clientKey)
	done := make(chan error, 1)
	go func() {
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	<-arrived
	cancel()
	<-done
	waitFor(t, "the request accounted as 499", 5*time.Second, func() bool { mf, _ := scrape(t); return left(mf) == leftBefore+1 })

	mf, _ = scrape(t)
	if v := value(mf, "relay_failovers_total", "group=hostile-gone"); v > 0 {
		t.Errorf("relay_failovers_total = %v after the client left: the relay failed over for nobody", v)
	}
	attempts := 0.0
	for _, ch := range []string{"hostile-gone-a", "hostile-gone-b", "hostile-gone-c"} {
		attempts += max(value(mf, "relay_attempts_total", "channel="+ch, "outcome=canceled"), 0)
	}
	if attempts != 1 {
		t.Errorf("%v attempts after the client left, want the one that was running", attempts)
	}
	for _, ch := range []string{"hostile-gone-a", "hostile-gone-b", "hostile-gone-c"} {
		if st := channels(t)[ch]; st.State != stateHealthy {
			t.Errorf("%s was cooled by a client leaving: %+v", ch, st)
		}
	}
	groupStates.Range(func(k, v any) bool {
		if k == "hostile-gone" {
			if n := retries(v.(*groupState)); n != 0 {
				t.Errorf("the client's departure spent %d of the group's retry budget", n)
			}
		}
		return true
	})
}

// retries counts the retries a group's budget holds over its window.
func retries(g *groupState) int {
	g.budget.mu.Lock()
	defer g.budget.mu.Unlock()
	n := 0
	for _, b := range g.budget.buckets {
		n += b.retries
	}
	return n
}

func TestSuccessBodiesAreBounded(t *testing.T) {
	huge := fakeupstream.Raw(200, []byte(`{"type":"message","pad":"`+strings.Repeat("x", 4096)+`"}`))
	big, ok := fakeupstream.New(t, huge), fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, "\t\tmax_response_size 1KiB\n"+channelBlock("hostile-big-a", big.URL, "priority 1")+
		channelBlock("hostile-big-b", ok.URL, "priority 2")+keyAndGroup("hostile-big", "hostile-big-a hostile-big-b"))
	if r := message(t, simpleBody); r.status != 200 || !strings.Contains(string(r.body), "served") {
		t.Fatalf("an answer over max_response_size should fail over: %d %s", r.status, r.body)
	}
	if st := channels(t)["hostile-big-a"]; st.LastError != "transient" || !strings.Contains(st.LastErrorReason, "max_response_size") {
		t.Errorf("the oversized answer's channel: %+v", st)
	}
}

func TestUpstreamQuotaIsCappedAndReset(t *testing.T) {
	far := time.Now().Add(20 * time.Hour).UTC().Format(time.RFC3339)
	up := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody("m", "a", fakeupstream.Usage{}),
		"Anthropic-Ratelimit-Requests-Remaining", "0", "Anthropic-Ratelimit-Requests-Reset", far))
	startRelay(t, "\t\tmax_cooldown 1m\n"+channelBlock("hostile-quota", up.URL)+keyAndGroup("hostile-quota", "hostile-quota"))
	message(t, simpleBody)
	st := channels(t)["hostile-quota"]
	if !st.Busy || st.BusyUntil == nil || time.Until(*st.BusyUntil) > time.Minute+time.Second {
		t.Fatalf("a quota reset 20h away should keep the channel busy for max_cooldown at most: %+v", st)
	}
	if code, _ := adminPost(t, "hostile-quota", "reset"); code != 200 {
		t.Fatal("reset failed")
	}
	if st := channels(t)["hostile-quota"]; st.Busy {
		t.Errorf("reset should clear the spent quota: %+v", st)
	}
}

func TestUpstreamAccountHeadersStayUpstream(t *testing.T) {
	account := []string{"Anthropic-Organization-Id", "org-0123", "Set-Cookie", "__cf_bm=secret; Path=/", "Request-Id", "req_up"}
	ok := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody("m", "a", fakeupstream.Usage{}), account...))
	bad := fakeupstream.New(t, fakeupstream.Raw(400, fakeupstream.ErrorBody("invalid_request_error", "no"), account...))
	startRelay(t, channelBlock("hostile-hdr-ok", ok.URL)+channelBlock("hostile-hdr-bad", bad.URL)+
		keyAndGroup("hostile-hdr", "hostile-hdr-ok")+
		"\t\tkey sk-header-errors-0123456789 hostile-hdr-bad\n\t\tgroup hostile-hdr-bad {\n\t\t\tchannels hostile-hdr-bad\n\t\t}\n")
	for _, r := range []reply{message(t, simpleBody), send(t, http.MethodPost, "/v1/messages", "sk-header-errors-0123456789", simpleBody)} {
		if r.header.Get("Anthropic-Organization-Id") != "" || r.header.Get("Set-Cookie") != "" {
			t.Errorf("%d: the upstream's account reached the tenant: %v", r.status, r.header)
		}
		if r.header.Get("Request-Id") != "req_up" {
			t.Errorf("%d: request-id should pass: %v", r.status, r.header)
		}
	}
}
