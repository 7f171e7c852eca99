package relay

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// failoverPair starts a relay whose group tries an upstream answering with
// bad first (priority 1) and one answering with good second.
func failoverPair(t *testing.T, name string, bad, good http.Handler) (first, second *fakeupstream.Upstream) {
	t.Helper()
	first, second = fakeupstream.New(t, bad), fakeupstream.New(t, good)
	startRelay(t, channelBlock(name+"-a", first.URL, "priority 1")+channelBlock(name+"-b", second.URL, "priority 2")+
		keyAndGroup(name, name+"-a "+name+"-b"))
	return first, second
}

func TestStreamCommitPoint(t *testing.T) {
	good := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 10, OutputTokens: 3}, "Hello", " world")
	overloaded := fakeupstream.Event("error", `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`)

	t.Run("error event before content fails over invisibly", func(t *testing.T) {
		bad, ok := failoverPair(t, "commit-err", fakeupstream.Stream(good[0], good[2], overloaded), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || string(r.body) != strings.Join(good, "") {
			t.Fatalf("client got %d:\n%s\nwant exactly the second upstream's stream", r.status, r.body)
		}
		if bad.Hits() != 1 || ok.Hits() != 1 || r.header.Get("X-Relay-Attempts") != "2" {
			t.Errorf("hits bad=%d ok=%d attempts=%q", bad.Hits(), ok.Hits(), r.header.Get("X-Relay-Attempts"))
		}
		if ct := r.header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
			t.Errorf("content-type = %q", ct)
		}
	})

	t.Run("keep-alive comments do not commit the stream", func(t *testing.T) {
		_, ok := failoverPair(t, "commit-comment", fakeupstream.Stream(": keep-alive\n\n", good[0], ": keep-alive\n\n", overloaded), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || string(r.body) != strings.Join(good, "") || ok.Hits() != 1 {
			t.Fatalf("client got %d (second upstream hits %d):\n%s\nwant the second upstream's stream only", r.status, ok.Hits(), r.body)
		}
	})

	t.Run("dead stream before content fails over", func(t *testing.T) {
		bad, ok := failoverPair(t, "commit-cut", fakeupstream.StreamThenCut(good[0]), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || string(r.body) != strings.Join(good, "") || bad.Hits() != 1 || ok.Hits() != 1 {
			t.Fatalf("client got %d (bad hits %d):\n%s", r.status, bad.Hits(), r.body)
		}
	})

	t.Run("cut after content ends with an error event and no failover", func(t *testing.T) {
		_, ok := failoverPair(t, "commit-late", fakeupstream.StreamThenCut(good[:4]...), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || !strings.HasPrefix(string(r.body), strings.Join(good[:4], "")) {
			t.Fatalf("client got %d:\n%s\nwant the events sent before the cut", r.status, r.body)
		}
		tail := strings.TrimPrefix(string(r.body), strings.Join(good[:4], ""))
		if !strings.HasPrefix(tail, "event: error\ndata: ") || !strings.Contains(tail, `"type":"api_error"`) || !strings.HasSuffix(tail, "\n\n") {
			t.Errorf("stream should end with an Anthropic error event, got %q", tail)
		}
		if ok.Hits() != 0 {
			t.Errorf("no second upstream may be called after the commit point: hits %d", ok.Hits())
		}
	})

	t.Run("EOF before the stop_reason ends with an error event", func(t *testing.T) {
		// the stream ends after the content, before the message_delta that
		// would give its stop_reason (a stream that ends after it is whole:
		// TestStreamEndingAfterStopReasonIsComplete)
		cut := good[:len(good)-2]
		up := fakeupstream.New(t, fakeupstream.Stream(cut...))
		startRelay(t, channelBlock("commit-eof-a", up.URL)+keyAndGroup("commit-eof", "commit-eof-a"))
		r := message(t, streamBody)
		if !strings.HasPrefix(string(r.body), strings.Join(cut, "")) || !strings.Contains(string(r.body), "event: error\n") {
			t.Errorf("a stream that ends before its stop_reason must end with event: error:\n%s", r.body)
		}
	})

	t.Run("invalid JSON data is dropped", func(t *testing.T) {
		evs := append([]string{}, good[:4]...)
		evs = append(evs, fakeupstream.Event("content_block_delta", `{"type":"content_block_delta",`))
		evs = append(evs, good[4:]...)
		up := fakeupstream.New(t, fakeupstream.Stream(evs...))
		startRelay(t, channelBlock("commit-json-a", up.URL)+keyAndGroup("commit-json", "commit-json-a"))
		if r := message(t, streamBody); string(r.body) != strings.Join(good, "") {
			t.Errorf("client got:\n%s\nwant the stream without the broken event", r.body)
		}
	})

	t.Run("non-retryable error event passes through", func(t *testing.T) {
		invalid := fakeupstream.Event("error", `{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}`)
		bad, ok := failoverPair(t, "commit-inv", fakeupstream.Stream(good[0], invalid), fakeupstream.Stream(good...))
		if r := message(t, streamBody); string(r.body) != good[0]+invalid || ok.Hits() != 0 || bad.Hits() != 1 {
			t.Errorf("client got:\n%s\n(second upstream hits %d)", r.body, ok.Hits())
		}
	})
}

func TestStreamFlushesEachEvent(t *testing.T) {
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 1, OutputTokens: 2}, "first", "second")
	release := make(chan struct{}) // the client must see "first" while the rest is held back
	up := fakeupstream.New(t, fakeupstream.Held(evs, 4, release, nil))
	startRelay(t, channelBlock("flush-a", up.URL)+keyAndGroup("flush", "flush-a"))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := openStream(t, ctx, streamBody)
	var seen strings.Builder
	for !strings.Contains(seen.String(), `"text":"first"`) {
		ev := s.next(t)
		if ev == "" {
			t.Fatalf("stream ended before the first delta; got %q", seen.String())
		}
		seen.WriteString(ev)
	}
	if seen.String() != strings.Join(evs[:4], "") {
		t.Errorf("events before the release:\n%s", seen.String())
	}
	close(release)
	seen.WriteString(s.rest(t))
	if seen.String() != strings.Join(evs, "") {
		t.Errorf("whole stream:\n%s", seen.String())
	}
}

func TestClientDisconnectCancelsUpstream(t *testing.T) {
	evs := fakeupstream.StreamEvents("m", fakeupstream.Usage{}, "first")
	canceled, never := make(chan struct{}), make(chan struct{})
	up := fakeupstream.New(t, fakeupstream.Held(evs, 4, never, canceled))
	startRelay(t, channelBlock("cancel-a", up.URL)+keyAndGroup("cancel", "cancel-a"))

	ctx, cancel := context.WithCancel(context.Background())
	s := openStream(t, ctx, streamBody)
	for ev := s.next(t); !strings.Contains(ev, "content_block_delta"); ev = s.next(t) {
		if ev == "" {
			t.Fatal("stream ended early")
		}
	}
	cancel()
	select {
	case <-canceled:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream request was not canceled within 5s of the client leaving")
	}
	// a client leaving is not the channel's fault: it still serves
	up.SetHandler(fakeupstream.Message("still here"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("channel should stay healthy after a client disconnect: %d", r.status)
	}
}

func TestStreamTimeouts(t *testing.T) {
	good := fakeupstream.StreamEvents("m", fakeupstream.Usage{}, "x")
	hang := func(evs ...string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			fakeupstream.StartStream(w)
			for _, ev := range evs {
				fakeupstream.WriteEvent(w, ev)
			}
			<-r.Context().Done()
		}
	}
	silent := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	noContent := fakeupstream.New(t, hang(good[0], good[2]))
	stalls := fakeupstream.New(t, hang(good[:4]...))
	openEnded := fakeupstream.New(t, hang(good...))
	ok := fakeupstream.New(t, fakeupstream.Stream(good...))
	startRelay(t, "\t\tfirst_byte_timeout 300ms\n\t\tfirst_content_timeout 300ms\n\t\tstream_idle_timeout 300ms\n"+
		channelBlock("to-silent", silent.URL, "priority 1")+channelBlock("to-nocontent", noContent.URL, "priority 1")+
		channelBlock("to-stalls", stalls.URL)+channelBlock("to-open", openEnded.URL)+channelBlock("to-ok", ok.URL, "priority 2")+
		"\t\tkey sk-to-1 to1\n\t\tgroup to1 {\n\t\t\tchannels to-silent to-ok\n\t\t}\n"+
		"\t\tkey sk-to-2 to2\n\t\tgroup to2 {\n\t\t\tchannels to-nocontent to-ok\n\t\t}\n"+
		"\t\tkey sk-to-3 to3\n\t\tgroup to3 {\n\t\t\tchannels to-stalls\n\t\t}\n"+
		"\t\tkey sk-to-4 to4\n\t\tgroup to4 {\n\t\t\tchannels to-open\n\t\t}\n")

	for _, c := range []struct{ name, key string }{{"first byte timeout fails over", "sk-to-1"}, {"first content timeout fails over", "sk-to-2"}} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			r := send(t, http.MethodPost, "/v1/messages", c.key, streamBody)
			if r.status != 200 || string(r.body) != strings.Join(good, "") || r.header.Get("X-Relay-Attempts") != "2" {
				t.Fatalf("got %d attempts %q:\n%s", r.status, r.header.Get("X-Relay-Attempts"), r.body)
			}
			if d := time.Since(start); d < 300*time.Millisecond || d > 10*time.Second {
				t.Errorf("took %v, want at least the 300ms timeout and well under 10s", d)
			}
		})
	}
	t.Run("idle stream ends with an error event", func(t *testing.T) {
		r := send(t, http.MethodPost, "/v1/messages", "sk-to-3", streamBody)
		body := string(r.body)
		if !strings.HasPrefix(body, strings.Join(good[:4], "")) || !strings.Contains(body, "event: error\n") || !strings.Contains(body, "idle") {
			t.Errorf("got:\n%s", body)
		}
	})
	t.Run("message_stop ends the response even if the upstream stays open", func(t *testing.T) {
		start := time.Now()
		r := send(t, http.MethodPost, "/v1/messages", "sk-to-4", streamBody)
		if string(r.body) != strings.Join(good, "") {
			t.Errorf("got:\n%s", r.body)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("the response ended %v after the request; message_stop should end it at once", d)
		}
	})
}

// An upstream that ends its response a moment after message_stop keeps its
// connection: the relay waits for the end instead of closing the body, so
// the next stream does not dial anew.
func TestStreamKeepsUpstreamConnection(t *testing.T) {
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 1, OutputTokens: 1}, "hi")
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fakeupstream.StartStream(w)
		for _, ev := range evs {
			fakeupstream.WriteEvent(w, ev)
		}
		time.Sleep(20 * time.Millisecond) // the response ends after its last event
	}))
	startRelay(t, channelBlock("keep-a", up.URL)+keyAndGroup("keep", "keep-a"))
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		got := openStream(t, ctx, streamBody).rest(t)
		cancel()
		if !strings.HasSuffix(got, evs[len(evs)-1]) {
			t.Fatalf("stream %d did not end with message_stop:\n%s", i+1, got)
		}
	}
	if n := up.Conns(); n != 1 {
		t.Errorf("two streams one after the other took %d upstream connections, want 1", n)
	}
}

// An upstream slow to its first content but alive (a long prefill: it
// sends message_start and then a ping every 50ms) is committed at
// first_content_timeout, and relayed as it comes: the client has
// message_start and the pings before any content exists, and the stream
// is not cut for its slowness, nor failed over.
func TestStreamKeepAliveBeforeContentIsRelayed(t *testing.T) {
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 7, OutputTokens: 2}, "late")
	release := make(chan struct{})
	var mu sync.Mutex
	var sent strings.Builder // what the upstream wrote, in order
	write := func(w http.ResponseWriter, ev string) bool {
		mu.Lock()
		sent.WriteString(ev)
		mu.Unlock()
		return fakeupstream.WriteEvent(w, ev)
	}
	slow := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fakeupstream.StartStream(w)
		write(w, evs[0])
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-r.Context().Done():
				return
			case <-release:
				for _, ev := range evs[1:] {
					write(w, ev)
				}
				return
			case <-tick.C:
				if !write(w, fakeupstream.Event("ping", `{"type": "ping"}`)) {
					return
				}
			}
		}
	}))
	spare := fakeupstream.New(t, fakeupstream.Stream(evs...))
	startRelay(t, "\t\tfirst_byte_timeout 2s\n\t\tfirst_content_timeout 300ms\n\t\tstream_idle_timeout 2s\n"+
		channelBlock("keepalive-slow", slow.URL, "priority 1")+channelBlock("keepalive-spare", spare.URL, "priority 2")+
		keyAndGroup("keepalive", "keepalive-slow keepalive-spare"))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	start := time.Now()
	s := openStream(t, ctx, streamBody)
	if s.resp.StatusCode != 200 {
		t.Fatalf("status %d", s.resp.StatusCode)
	}
	var got strings.Builder
	first := s.next(t)
	got.WriteString(first)
	if first != evs[0] {
		t.Fatalf("the first event is %q, want the upstream's message_start", first)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("message_start reached the client after %v, before first_content_timeout (300ms): the hold could not have failed over", d)
	}
	if ping := s.next(t); !strings.HasPrefix(ping, "event: ping\n") {
		t.Fatalf("after message_start the client got %q, want the upstream's pings as they come", ping)
	} else {
		got.WriteString(ping)
	}
	close(release) // only now does the upstream have content
	got.WriteString(s.rest(t))
	mu.Lock()
	want := sent.String()
	mu.Unlock()
	if got.String() != want {
		t.Errorf("the client got\n%q\nwant the upstream's bytes\n%q", got.String(), want)
	}
	if strings.Contains(got.String(), "event: error") || spare.Hits() != 0 || s.resp.Header.Get("X-Relay-Attempts") != "" {
		t.Errorf("a live stream was cut or failed over: spare hits %d, attempts %q", spare.Hits(), s.resp.Header.Get("X-Relay-Attempts"))
	}
	if ch := channels(t)["keepalive-slow"]; ch.State != stateHealthy {
		t.Errorf("a slow but live upstream was blamed: %+v", ch)
	}
}

// A stream whose upstream ends after a message_delta that gives the
// stop_reason, without message_stop, is whole: the client gets the
// upstream's bytes and no error, the channel is not blamed, and the
// request is billed the message_delta's counts.
func TestStreamEndingAfterStopReasonIsComplete(t *testing.T) {
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 11, OutputTokens: 6}, "all", " here")
	noStop := evs[:len(evs)-1]
	for _, c := range []struct {
		name    string
		handler http.HandlerFunc
	}{
		{"stream ends cleanly", fakeupstream.Stream(noStop...)},
		{"connection is cut", fakeupstream.StreamThenCut(noStop...)},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := "stopped-" + strings.ReplaceAll(c.name, " ", "-")
			up := fakeupstream.New(t, c.handler)
			spare := fakeupstream.New(t, fakeupstream.Stream(evs...))
			startRelay(t, channelBlock(name, up.URL, "priority 1")+channelBlock(name+"-spare", spare.URL, "priority 2")+
				keyAndGroup(name, name+" "+name+"-spare"))
			output := func() float64 {
				return testutil.ToFloat64(metricTokens.WithLabelValues(name, name, labelOther, "output"))
			}
			before, estimated := output(), testutil.ToFloat64(metricEstimated.WithLabelValues(name))
			r := message(t, streamBody)
			if r.status != 200 || string(r.body) != strings.Join(noStop, "") {
				t.Fatalf("got %d:\n%s\nwant exactly the upstream's bytes, no error appended", r.status, r.body)
			}
			if spare.Hits() != 0 {
				t.Errorf("a whole answer was failed over")
			}
			if ch := channels(t)[name]; ch.State != stateHealthy || ch.Failures != 0 {
				t.Errorf("the channel was blamed for a whole answer: %+v", ch)
			}
			waitFor(t, "the request's accounting", 5*time.Second, func() bool { return output()-before == 6 })
			if d := testutil.ToFloat64(metricEstimated.WithLabelValues(name)) - estimated; d != 0 {
				t.Errorf("the output was estimated (%v), but the message_delta gave it", d)
			}
		})
	}
}

// holdCase is a stream attempt whose upstream the test writes event by
// event, with a hold limit the test calls itself.
type holdCase struct {
	s    *streamAttempt
	w    *httptest.ResponseRecorder
	pw   *io.PipeWriter
	done chan attemptResult
}

func newHoldCase(t *testing.T, fct time.Duration) *holdCase {
	t.Helper()
	pr, pw := io.Pipe()
	r := &Relay{now: time.Now}
	r.logger = discardLogger()
	ch := &channel{name: "hold-unit", firstContent: fct, streamIdle: time.Minute}
	in := &inbound{who: requester{key: &key{group: &group{}}}}
	ctx, cancel := context.WithCancelCause(context.Background())
	// as the transport does: the attempt's end ends its body
	context.AfterFunc(ctx, func() { pw.CloseWithError(context.Cause(ctx)) })
	resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/event-stream"}}, Body: pr}
	dl := &deadline{cancel: cancel, headers: time.Now(), in: in, relay: r}
	c := &holdCase{w: httptest.NewRecorder(), pw: pw, done: make(chan attemptResult, 1)}
	c.s = &streamAttempt{r: r, w: c.w, in: in, ch: ch, n: 1, ctx: ctx, clientCtx: context.Background(), deadline: dl, resp: resp, last: dl.headers}
	dl.stream = c.s
	dl.start(stageFirstContent, fct)
	t.Cleanup(func() { dl.stop(); cancel(nil) })
	go func() { c.done <- c.s.run() }()
	return c
}

// send writes events as the upstream, and waits until the hold has read
// them.
func (c *holdCase) send(t *testing.T, evs ...string) {
	t.Helper()
	for _, ev := range evs {
		if _, err := io.WriteString(c.pw, ev); err != nil {
			t.Fatal(err)
		}
	}
}

// heldLen is how much the hold holds.
func (c *holdCase) heldLen() int {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	return len(c.s.held)
}

// silentFor makes the upstream's last event d ago, as the hold limit sees it.
func (c *holdCase) silentFor(d time.Duration) {
	c.s.mu.Lock()
	c.s.last = time.Now().Add(-d)
	c.s.mu.Unlock()
}

func (c *holdCase) result(t *testing.T) attemptResult {
	t.Helper()
	select {
	case res := <-c.done:
		return res
	case <-time.After(10 * time.Second):
		t.Fatal("the attempt did not end within 10s")
	}
	return attemptResult{}
}

func TestStreamHoldLimit(t *testing.T) {
	evs := fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 3, OutputTokens: 1}, "x")
	start, ping, rest := evs[0], evs[2], evs[1:]
	rest = append([]string{rest[0]}, rest[2:]...) // content_block_start onwards, without the ping

	t.Run("an upstream that sent an event lately is committed at the limit", func(t *testing.T) {
		c := newHoldCase(t, time.Hour) // the test calls the limit
		c.send(t, start, ping)
		waitFor(t, "the hold to read both events", 5*time.Second, func() bool { return c.heldLen() == len(start)+len(ping) })
		c.silentFor(10 * time.Minute) // within half of the hour
		c.s.holdLimit()
		if got := c.w.Body.String(); got != start+ping || c.w.Code != 200 {
			t.Fatalf("at the limit the client got %d %q, want the held events at once", c.w.Code, got)
		}
		c.send(t, rest...)
		_ = c.pw.Close()
		if res := c.result(t); res.verdict.outcome != outcomeSuccess || !res.done {
			t.Fatalf("verdict %+v", res.verdict)
		}
		if got, want := c.w.Body.String(), start+ping+strings.Join(rest, ""); got != want {
			t.Errorf("the client got\n%q\nwant\n%q", got, want)
		}
	})
	t.Run("an upstream silent for half the limit is held until its next event", func(t *testing.T) {
		c := newHoldCase(t, time.Hour)
		c.send(t, start)
		waitFor(t, "the hold to read message_start", 5*time.Second, func() bool { return c.heldLen() == len(start) })
		c.silentFor(40 * time.Minute)
		c.s.holdLimit()
		if c.w.Body.Len() != 0 || stage(c.s.deadline.stage.Load()) != stageStall {
			t.Fatalf("the limit committed an upstream silent for 40 of 60 minutes: %q, stage %d", c.w.Body.String(), c.s.deadline.stage.Load())
		}
		c.send(t, ping) // a sign of life: committed with it at once
		waitFor(t, "the commit", 5*time.Second, func() bool {
			c.s.mu.Lock()
			defer c.s.mu.Unlock()
			return c.s.over
		})
		c.send(t, rest...)
		_ = c.pw.Close()
		if res := c.result(t); res.verdict.outcome != outcomeSuccess {
			t.Fatalf("verdict %+v", res.verdict)
		}
		if got, want := c.w.Body.String(), start+ping+strings.Join(rest, ""); got != want {
			t.Errorf("the client got\n%q\nwant\n%q", got, want)
		}
	})
	t.Run("an upstream silent for the whole limit is a stall", func(t *testing.T) {
		c := newHoldCase(t, 200*time.Millisecond) // the deadline's own timer ends the hold
		c.send(t, start)
		res := c.result(t)
		if res.done || res.verdict.outcome != outcomeTransient || res.verdict.reason != "first content timeout" {
			t.Fatalf("verdict %+v done %v, want a transient first content timeout to fail over", res.verdict, res.done)
		}
		if c.w.Body.Len() != 0 {
			t.Errorf("a stall reached the client: %q", c.w.Body.String())
		}
	})
}
