package relay

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/memtest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// oneObjectChat is a Chat Completions body of about size bytes that is
// mostly one object of very many members (its metadata), which the
// translation accepts and does not carry: the body whose decoding costs
// most for its size.
func oneObjectChat(size int) []byte {
	b := []byte(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"hi"}],"metadata":{`)
	for i := 0; len(b) < size-2; i++ {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, '"')
		b = strconv.AppendInt(b, int64(i), 36)
		b = append(b, `":0`...)
	}
	return append(b, "}}"...)
}

// decodeRelay is a relay of one key and one channel at url, whose
// decodes may hold budget bytes at once.
func decodeRelay(t *testing.T, name, url string, budget int64) *Relay {
	t.Helper()
	r := &Relay{
		DecodeMemory: budget,
		Keys:         []*Key{{Secret: "sk-" + name + "-0123456789abcdef", Group: name}},
		Channels:     []*Channel{{Name: name, UpstreamRaw: upstream("anthropic", "url", url, "api_key", channelKey)}},
		Groups:       []*Group{{Name: name, Channels: []string{name}}},
	}
	provisionHandler(t, r)
	return r
}

// chatRequest is a Chat Completions request of r's key, its context ctx.
func chatRequest(ctx context.Context, name string, body []byte) *http.Request {
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, PathChatCompletions, bytes.NewReader(body))
	req.Header.Set("Authorization", "Bearer sk-"+name+"-0123456789abcdef")
	req.Header.Set("Content-Type", "application/json")
	return caddyhttp.PrepareRequest(req, caddy.NewReplacer(), httptest.NewRecorder(), &caddyhttp.Server{})
}

// peakHeap runs f and returns the most the heap held meanwhile beyond
// what it held before, sampled every millisecond, with the collector
// kept close to what is live.
func peakHeap(f func()) int64 {
	defer debug.SetGCPercent(debug.SetGCPercent(10))
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC() // what pools kept through the first goes with the second
	runtime.ReadMemStats(&ms)
	base, peak := int64(ms.HeapAlloc), int64(0)
	done := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			peak = max(peak, int64(ms.HeapAlloc)-base)
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	f()
	close(done)
	<-sampled
	return peak
}

// TestHugeObjectBodiesDecodeWithinTheBudget: six Chat Completions bodies
// that are each mostly one object of very many members, sent at once,
// decode within the node's decode_memory: at 32 MB each, decoding one
// would take more than the whole budget, so each gets a 413
// request_too_large at once (in the Chat Completions shape, the route's),
// naming the option, and no upstream hears of it; at 4 MB each, with room
// for one decode at a time, they decode one after another and are all
// served. (Before the budget, the six 32 MB bodies held 1.5 GB at once,
// and 2 GB and more with Go's default collector.)
// Under the race detector, bodies and budget are an eighth.
func TestHugeObjectBodiesDecodeWithinTheBudget(t *testing.T) {
	scale := 1
	if memtest.Race {
		scale = 8
	}
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	for _, c := range []struct {
		size   int
		budget int64
		status int
	}{
		{32_000_000 / scale, 256 << 20 / int64(scale), http.StatusRequestEntityTooLarge},
		{4_000_000 / scale, 192 << 20 / int64(scale), http.StatusOK},
	} {
		t.Run(fmt.Sprintf("%.1fMB", float64(c.size)/1e6), func(t *testing.T) {
			name := "decode-" + strconv.Itoa(c.size)
			budget := c.budget
			r := decodeRelay(t, name, up.URL, budget)
			body := oneObjectChat(c.size)
			before := up.Hits()
			var mu sync.Mutex
			var answers []*httptest.ResponseRecorder
			peak := peakHeap(func() {
				var wg sync.WaitGroup
				for range 6 {
					wg.Go(func() {
						w := httptest.NewRecorder()
						if err := r.ServeHTTP(w, chatRequest(context.Background(), name, body), nil); err != nil {
							t.Error(err)
						}
						mu.Lock()
						answers = append(answers, w)
						mu.Unlock()
					})
				}
				wg.Wait()
			})
			// what the bodies themselves take: each request's read buffer
			// and its translation
			bodies := int64(6 * 2 * len(body))
			t.Logf("six bodies of %.1f MB at once: the heap grew by at most %d MiB (budget %d MiB, the bodies themselves %d MiB)",
				float64(c.size)/1e6, peak>>20, budget>>20, bodies>>20)
			if bound := (budget + bodies) * 5 / 4; peak > bound {
				t.Errorf("the heap grew by %d MiB, over %d MiB: the decoding is not bounded", peak>>20, bound>>20)
			}
			for _, w := range answers {
				if w.Code != c.status {
					t.Fatalf("status %d, want %d: %.300s", w.Code, c.status, w.Body)
				}
			}
			switch c.status {
			case http.StatusRequestEntityTooLarge:
				w := answers[0]
				if !bytes.Contains(w.Body.Bytes(), []byte(`"code":"request_too_large"`)) || !bytes.Contains(w.Body.Bytes(), []byte("decode_memory")) {
					t.Errorf("the 413 does not say request_too_large and decode_memory: %s", w.Body)
				}
				if n := up.Hits() - before; n != 0 {
					t.Errorf("the upstream heard of %d bodies too large to decode", n)
				}
			case http.StatusOK:
				if n := up.Hits() - before; n != 6 {
					t.Errorf("the upstream got %d of the 6 bodies", n)
				}
			}
		})
	}
}

// TestABodyWaitsForRoomToDecode: a body that finds the node's decode
// budget taken waits for room rather than decoding beside the others, is
// served once there is room, and stops waiting when its client leaves.
func TestABodyWaitsForRoomToDecode(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	const name = "decode-wait"
	r := decodeRelay(t, name, up.URL, 1<<20)
	body := []byte(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}`)
	if err := r.decode.sem.Acquire(context.Background(), r.decode.size); err != nil { // another decode holds it all
		t.Fatal(err)
	}
	served := make(chan int, 1)
	go func() {
		w := httptest.NewRecorder()
		_ = r.ServeHTTP(w, chatRequest(context.Background(), name, body), nil)
		served <- w.Code
	}()
	select {
	case code := <-served:
		t.Fatalf("the request was answered %d while the budget was taken", code)
	case <-time.After(200 * time.Millisecond):
	}
	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan struct{})
	go func() {
		defer close(left)
		_ = r.ServeHTTP(httptest.NewRecorder(), chatRequest(ctx, name, body), nil)
	}()
	cancel()
	select {
	case <-left:
	case <-time.After(5 * time.Second):
		t.Fatal("a request whose client left still waits for room to decode")
	}
	r.decode.sem.Release(r.decode.size)
	select {
	case code := <-served:
		if code != http.StatusOK {
			t.Fatalf("status %d once there was room", code)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request was not served once there was room")
	}
	if n := up.Hits(); n != 1 {
		t.Errorf("the upstream got %d requests, want the one that waited", n)
	}
}

// TestDecodeCostCoversTheDecode: for bodies of every shape, on both
// routes that decode one, what decoding the body allocates is at most
// what decodeCost reserves for it; and its members are counted outside
// strings. (Under the race detector, which empties pools at random, with
// the slack of memtest.BoundedBodies.)
func TestDecodeCostCoversTheDecode(t *testing.T) {
	size, factor := memtest.BoundedBodies()
	longNames := []byte(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"hi"}],"metadata":{`)
	for i := 0; len(longNames) < size; i++ {
		if i > 0 {
			longNames = append(longNames, ',')
		}
		longNames = append(longNames, `"a-rather-long-name-of-a-member-`...)
		longNames = strconv.AppendInt(longNames, int64(i), 10)
		longNames = append(longNames, `":"v"`...)
	}
	longNames = append(longNames, "}}"...)
	text := bytes.Repeat([]byte(`key: value, http://example.com/a:b `), size/36)
	for _, c := range []struct {
		name string
		body []byte
	}{
		{"one object of short names", oneObjectChat(size)},
		{"one object of long names", longNames},
		{"one long text", []byte(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"` + string(text) + `"}]}`)},
		{"tiny messages", memtest.Repeated(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[`, `{"role":"user","content":"hi"},{"role":"assistant","content":"ho"}`, `,{"role":"user","content":"x"}]}`, size)},
		{"tools of schemas", memtest.Repeated(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"hi"}],"tools":[`,
			`{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":"string"},"b":{"type":"number"}}}}}`, `]}`, size)},
		{"a small request", []byte(simpleBody)},
		{"deep objects", []byte(strings.Repeat(`{"a":`, 5000) + "0" + strings.Repeat("}", 5000))},
		{"deep arrays", []byte(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"hi"}],"metadata":` + strings.Repeat(`[`, 9000) + strings.Repeat("]", 9000) + "}")},
		{"deep arrays in messages", []byte(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":[{"type":"text","text":"hi","x":` + strings.Repeat(`[`, 9000) + strings.Repeat("]", 9000) + "}]}]}")},
		{"empty objects", memtest.Repeated(`{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"hi"}],"metadata":[`, `{}`, `]}`, size)},
	} {
		for _, isChat := range []bool{false, true} {
			got := memtest.Allocated(func() {
				in := &inbound{}
				in.ask.body = bytes.Clone(c.body)
				if isChat {
					in.ask.chat = new(chat)
					if in.translateChat() != nil {
						return
					}
				}
				_ = in.inspect()
				in.releaseBody()
			}) - uint64(len(c.body)) // the test's copy
			cost := decodeCost(c.body, isChat, 0)
			t.Logf("%s (chat %v): %.1f times the body allocated, %.1f reserved", c.name, isChat, memtest.PerByte(got, c.body), float64(cost)/float64(len(c.body)))
			if float64(got) > float64(cost)*factor {
				t.Errorf("%s (chat %v): decoding allocated %d bytes, over the %d reserved", c.name, isChat, got, cost)
			}
		}
	}
	for _, c := range []struct {
		doc  string
		want int
	}{
		{`{"a":1,"b":{"c":"d:e"}}`, 3},
		{`{"a\":b":":","c":[{"d":"\\"},{"e":0}]}`, 4},
		{`["::",":"]`, 0},
		{`{"unterminated:`, 0},
	} {
		if got := objectMembers([]byte(c.doc)); got != c.want {
			t.Errorf("objectMembers(%s) = %d, want %d", c.doc, got, c.want)
		}
	}
}

// TestAMessagesBodyTooLargeToDecodeIsAnAnthropic413: on the Messages route
// the refusal of a body whose decode alone exceeds the budget is the
// Anthropic API's own 413 shape, and names decode_memory.
func TestAMessagesBodyTooLargeToDecodeIsAnAnthropic413(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	const name = "decode-messages"
	r := decodeRelay(t, name, up.URL, 8<<20)
	body := oneObjectChat(2 << 20) // a Messages body too: its metadata is one object of many members
	req := newRequest(string(body), "sk-"+name+"-0123456789abcdef")
	w, _ := serveHandler(t, r, req)
	if w.Code != http.StatusRequestEntityTooLarge {
		t.Fatalf("status %d: %.300s", w.Code, w.Body)
	}
	want := `{"type":"error","error":{"type":"request_too_large","message":"decoding this request body would take about `
	if !strings.HasPrefix(w.Body.String(), want) || !strings.Contains(w.Body.String(), "decode_memory of 8 MiB") {
		t.Errorf("the 413 is %s", w.Body)
	}
	if up.Hits() != 0 {
		t.Errorf("the upstream heard of it")
	}
}
