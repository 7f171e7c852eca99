package relay

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/dedup"
	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// postStream opens a Messages request with the given headers and returns
// the response once its headers are in.
func postStream(t *testing.T, ctx context.Context, key, body string, header ...string) *http.Response {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, relayURL+"/v1/messages", strings.NewReader(body))
	req.Header.Set("X-Api-Key", key)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := (&http.Client{}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

// readEvents reads n raw events of a stream.
func readEvents(t *testing.T, br *bufio.Reader, n int) string {
	t.Helper()
	var b strings.Builder
	for i := 0; i < n; {
		line, err := br.ReadString('\n')
		b.WriteString(line)
		if err != nil {
			t.Fatalf("after %q: %v", b.String(), err)
		}
		if line == "\n" {
			i++
		}
	}
	return b.String()
}

// dedupFollowers counts the requests attached to the flights of the dedup
// table.
func dedupFollowers() int { return dedups.Followers() }

// forgetDedups empties the dedup table, so a test starts from nothing.
func forgetDedups(t *testing.T) { forgetDedupsB(t) }

func forgetDedupsB(t testing.TB) {
	t.Helper()
	dedups.Clear()
	t.Cleanup(dedups.Clear)
}

// A retry sent while its first attempt is still streaming gets the same
// stream, byte for byte, from its first byte and then live; the upstream
// is called once.
func TestDedupRetryAttachesToStream(t *testing.T) {
	forgetDedups(t)
	release := make(chan struct{})
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 1000, OutputTokens: 3}, "one", "two", "three")
	up := fakeupstream.New(t, fakeupstream.Held(evs, 4, release, nil)) // message_start, content_block_start, ping, one delta
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	startRelay(t, channelBlock("dd-stream", up.URL, "models claude-sonnet-4-5")+keyAndGroup("dd-stream", "dd-stream"))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := postStream(t, ctx, clientKey, streamBody, "X-Stainless-Retry-Count", "0")
	if first.StatusCode != 200 {
		t.Fatalf("first: status %d", first.StatusCode)
	}
	fr := bufio.NewReader(first.Body)
	firstHead := readEvents(t, fr, 4) // the upstream is working on it now

	retry := postStream(t, ctx, clientKey, streamBody, "X-Stainless-Retry-Count", "1")
	if retry.StatusCode != 200 || !isEventStream(retry.Header) {
		t.Fatalf("retry: status %d, content-type %q", retry.StatusCode, retry.Header.Get("Content-Type"))
	}
	rr := bufio.NewReader(retry.Body)
	if head := readEvents(t, rr, 4); head != firstHead {
		t.Fatalf("retry's replayed head differs:\n%q\nwant\n%q", head, firstHead)
	}
	free()
	firstRest, _ := io.ReadAll(fr)
	retryRest, _ := io.ReadAll(rr)
	if string(retryRest) != string(firstRest) || !strings.Contains(string(firstRest), "message_stop") {
		t.Fatalf("retry's live part differs:\n%q\nwant\n%q", retryRest, firstRest)
	}
	if want := strings.Join(evs, ""); firstHead+string(firstRest) != want {
		t.Errorf("first attempt's stream is not the upstream's:\n%q", firstHead+string(firstRest))
	}
	if n := up.Hits(); n != 1 {
		t.Errorf("upstream calls = %d, want 1", n)
	}
	mf, _ := scrape(t)
	if v := value(mf, "relay_dedup_total", "group=dd-stream"); v != 1 {
		t.Errorf("relay_dedup_total = %v, want 1", v)
	}
	if v := value(mf, "relay_saved_tokens_total", "group=dd-stream"); v != 1003 {
		t.Errorf("relay_saved_tokens_total = %v, want 1003", v)
	}
}

// A non-streaming retry waits for the answer of its first attempt, still
// at a slow upstream, and gets its bytes; the upstream is called once.
func TestDedupRetryAttachesToMessage(t *testing.T) {
	forgetDedups(t)
	release, arrived := make(chan struct{}), make(chan struct{}, 4)
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
		fakeupstream.Message("slow answer")(w, r)
	}))
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free) // before the upstream closes, even when the test fails
	startRelay(t, channelBlock("dd-json", up.URL, "models claude-sonnet-4-5")+keyAndGroup("dd-json", "dd-json"))

	var wg sync.WaitGroup
	var first, retry reply
	var errFirst, errRetry error
	wg.Add(1)
	go func() {
		defer wg.Done()
		first, errFirst = do(http.MethodPost, "/v1/messages", clientKey, simpleBody, "X-Stainless-Retry-Count", "0")
	}()
	<-arrived
	wg.Add(1)
	go func() {
		defer wg.Done()
		retry, errRetry = do(http.MethodPost, "/v1/messages", clientKey, simpleBody, "X-Stainless-Retry-Count", "1")
	}()
	waitFor(t, "the retry attaches", 5*time.Second, func() bool { return dedupFollowers() == 1 })
	free()
	wg.Wait()
	if errFirst != nil || errRetry != nil {
		t.Fatal(errFirst, errRetry)
	}
	if first.status != 200 || retry.status != 200 || string(first.body) != string(retry.body) {
		t.Fatalf("first %d %s, retry %d %s", first.status, first.body, retry.status, retry.body)
	}
	if first.header.Get("X-Relay-Request-Id") == retry.header.Get("X-Relay-Request-Id") {
		t.Error("the retry has its first attempt's request id")
	}
	if n := up.Hits(); n != 1 {
		t.Errorf("upstream calls = %d, want 1", n)
	}
}

// Within dedup_window a retry gets the stored answer; a first attempt, a
// request without the headers and another key's retry go upstream, and
// so does an answer that failed.
func TestDedupOnlyRetriesOfTheSameKey(t *testing.T) {
	forgetDedups(t)
	up := fakeupstream.New(t, fakeupstream.Message("answer"))
	const other = "sk-other-client-secret-0123"
	startRelay(t, channelBlock("dd-keys", up.URL, "models claude-sonnet-4-5")+keyAndGroup("dd-keys", "dd-keys")+
		"\t\tkey "+other+" dd-keys\n")

	calls := func(key string, header ...string) int {
		t.Helper()
		before := up.Hits()
		if r := send(t, http.MethodPost, "/v1/messages", key, simpleBody, header...); r.status != 200 {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		return up.Hits() - before
	}
	if n := calls(clientKey, "X-Stainless-Retry-Count", "0"); n != 1 {
		t.Fatalf("first attempt: %d calls", n)
	}
	if n := calls(clientKey, "X-Stainless-Retry-Count", "1"); n != 0 {
		t.Errorf("retry within the window: %d calls, want 0", n)
	}
	if n := calls(clientKey, "Idempotency-Key", "k-1"); n != 1 {
		t.Errorf("a new idempotency key: %d calls, want 1", n)
	}
	if n := calls(clientKey, "Idempotency-Key", "k-1"); n != 0 {
		t.Errorf("the same idempotency key again: %d calls, want 0", n)
	}
	if n := calls(clientKey, "X-Stainless-Retry-Count", "0"); n != 1 {
		t.Errorf("a second first attempt: %d calls, want 1", n)
	}
	if n := calls(clientKey); n != 1 {
		t.Errorf("without the headers: %d calls, want 1", n)
	}
	if n := calls(other, "X-Stainless-Retry-Count", "1"); n != 1 {
		t.Errorf("another key's retry: %d calls, want 1", n)
	}
	// a failed answer is never replayed
	up.SetHandler(fakeupstream.Error(400, "invalid_request_error", "bad"))
	if r := send(t, http.MethodPost, "/v1/messages", clientKey, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "X-Stainless-Retry-Count", "0"); r.status != 400 {
		t.Fatalf("status %d", r.status)
	}
	up.SetHandler(fakeupstream.Message("answer"))
	before := up.Hits()
	if r := send(t, http.MethodPost, "/v1/messages", clientKey, `{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "X-Stainless-Retry-Count", "1"); r.status != 200 || up.Hits() != before+1 {
		t.Errorf("retry of a failed request: status %d, %d calls, want 200 from the upstream", r.status, up.Hits()-before)
	}
}

// dedup_window 0 turns dedup off.
func TestDedupWindowZero(t *testing.T) {
	forgetDedups(t)
	up := fakeupstream.New(t, fakeupstream.Message("answer"))
	startRelay(t, "\t\tdedup_window 0\n"+channelBlock("dd-off", up.URL, "models claude-sonnet-4-5")+keyAndGroup("dd-off", "dd-off"))
	message(t, simpleBody, "X-Stainless-Retry-Count", "0")
	message(t, simpleBody, "X-Stainless-Retry-Count", "1")
	if n := up.Hits(); n != 2 {
		t.Errorf("upstream calls = %d, want 2", n)
	}
}

// heldStream is an upstream whose stream stops after its first 4 events
// until free is called (at the latest when the test ends); canceled closes
// when its attempt is canceled.
func heldStream(t *testing.T) (evs []string, up *fakeupstream.Upstream, free func(), canceled chan struct{}) {
	release := make(chan struct{})
	canceled = make(chan struct{})
	evs = fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 10, OutputTokens: 3}, "one", "two")
	up = fakeupstream.New(t, fakeupstream.Held(evs, 4, release, canceled))
	var once sync.Once
	free = func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	return evs, up, free, canceled
}

// When the client of a first attempt leaves, its upstream attempt runs on
// for dedup_grace; the SDK's retry attaches to it and gets the whole
// stream, and the upstream is called once.
func TestDedupGraceKeepsTheAttemptForTheRetry(t *testing.T) {
	forgetDedups(t)
	evs, up, free, canceled := heldStream(t)
	startRelay(t, channelBlock("dd-grace", up.URL, "models claude-sonnet-4-5")+keyAndGroup("dd-grace", "dd-grace"))

	ctx, leave := context.WithCancel(context.Background())
	first := postStream(t, ctx, clientKey, streamBody, "X-Stainless-Retry-Count", "0")
	readEvents(t, bufio.NewReader(first.Body), 4)
	leave() // the SDK's timeout

	retry := postStream(t, context.Background(), clientKey, streamBody, "X-Stainless-Retry-Count", "1")
	rr := bufio.NewReader(retry.Body)
	head := readEvents(t, rr, 4)
	free()
	rest, _ := io.ReadAll(rr)
	if got, want := head+string(rest), strings.Join(evs, ""); got != want {
		t.Fatalf("retry got\n%q\nwant\n%q", got, want)
	}
	select {
	case <-canceled:
		t.Error("the upstream attempt was canceled")
	default:
	}
	if n := up.Hits(); n != 1 {
		t.Errorf("upstream calls = %d, want 1", n)
	}
}

// Without a retry, the attempt of a client that left ends after
// dedup_grace.
func TestDedupGraceEnds(t *testing.T) {
	forgetDedups(t)
	_, up, _, canceled := heldStream(t)
	startRelay(t, "\t\tdedup_grace 100ms\n"+channelBlock("dd-grace-end", up.URL, "models claude-sonnet-4-5")+keyAndGroup("dd-grace-end", "dd-grace-end"))

	ctx, leave := context.WithCancel(context.Background())
	first := postStream(t, ctx, clientKey, streamBody, "X-Stainless-Retry-Count", "0")
	readEvents(t, bufio.NewReader(first.Body), 4)
	leave()
	select {
	case <-canceled:
	case <-time.After(10 * time.Second):
		t.Fatal("the upstream attempt was not canceled after dedup_grace")
	}
}

// A follower replaying a stream whose answer then outgrows what is kept
// ends with an event: error, never a clean-looking truncated stream; one
// that attaches to a flight already dropped is relayed itself.
func TestDedupFollowerOfADroppedAnswer(t *testing.T) {
	forgetDedups(t)
	r := &Relay{}
	f := dedup.NewFlight()
	f.Begin(200, http.Header{"Content-Type": {"text/event-stream"}}, true, nil)
	f.Add([]byte("event: ping\ndata: {}\n\n"))
	w := httptest.NewRecorder()
	done := make(chan bool)
	go func() {
		done <- r.replay(w, context.Background(), &inbound{id: "relay_test"}, f, sharedDedup)
	}()
	waitFor(t, "the follower waits", 5*time.Second, f.Awaited)
	f.Add(make([]byte, dedup.MaxAnswer)) // over the cap
	if !<-done {
		t.Fatal("the follower had begun: it must end its stream itself")
	}
	body := w.Body.String()
	if !strings.HasPrefix(body, "event: ping\ndata: {}\n\n") || !strings.Contains(body, "event: error") {
		t.Errorf("follower got %q", body)
	}
	if dedup.SharedBytes() != 0 {
		t.Errorf("a dropped flight keeps %d bytes", dedup.SharedBytes())
	}
	if r.replay(httptest.NewRecorder(), context.Background(), &inbound{}, f, sharedDedup) {
		t.Error("a follower attached to a dropped flight was answered from it")
	}
}

// TestRequestDigestKinds: each kind of digest tells requests apart by
// route, version, betas and body alike, and the two kinds differ, so an
// entry made with one never matches the other.
func TestRequestDigestKinds(t *testing.T) {
	base := func() *inbound {
		return &inbound{route: routeMessages, ask: asked{header: http.Header{"Anthropic-Version": {"2023-06-01"}}, body: []byte(benchBody)}}
	}
	variants := map[string]*inbound{"same": base()}
	v := base()
	v.ask.body = []byte(strings.Replace(benchBody, "lazy", "lazY", 1))
	variants["body"] = v
	v = base()
	v.ask.header = http.Header{"Anthropic-Version": {"2023-06-02"}}
	variants["version"] = v
	v = base()
	v.ask.header = http.Header{"Anthropic-Version": {"2023-06-01"}, "Anthropic-Beta": {"x"}}
	variants["beta"] = v
	v = base()
	v.route = routeCountTokens
	variants["route"] = v
	for _, shared := range []bool{false, true} {
		want := requestDigest(base(), shared)
		for name, in := range variants {
			if got := requestDigest(in, shared); (got == want) != (name == "same") {
				t.Errorf("shared %v, %s: digests equal %v", shared, name, got == want)
			}
		}
	}
	if requestDigest(base(), false) == requestDigest(base(), true) {
		t.Error("the two kinds of digest agree")
	}
}

// BenchmarkRequestDigest digests a 10 KB request: for dedup (keyed
// hashes) and for a group's response cache (SHA-256).
func BenchmarkRequestDigest(b *testing.B) {
	in := &inbound{route: routeMessages, ask: asked{header: http.Header{"Anthropic-Version": {"2023-06-01"}}, body: []byte(benchBody)}}
	for _, shared := range []bool{false, true} {
		b.Run(map[bool]string{false: "dedup", true: "cache"}[shared], func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(in.ask.body)))
			for b.Loop() {
				requestDigest(in, shared)
			}
		})
	}
}
