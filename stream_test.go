package relay

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
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

	t.Run("EOF without message_stop ends with an error event", func(t *testing.T) {
		up := fakeupstream.New(t, fakeupstream.Stream(good[:len(good)-1]...))
		startRelay(t, channelBlock("commit-eof-a", up.URL)+keyAndGroup("commit-eof", "commit-eof-a"))
		r := message(t, streamBody)
		if !strings.HasPrefix(string(r.body), strings.Join(good[:len(good)-1], "")) || !strings.Contains(string(r.body), "event: error\n") {
			t.Errorf("a stream without message_stop must end with event: error:\n%s", r.body)
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
