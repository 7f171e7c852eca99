package relay

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// benchBody is a realistic 10 KB Messages request.
var benchBody = `{"model":"claude-sonnet-4-5","max_tokens":64,"metadata":{"user_id":"u-1"},"messages":[{"role":"user","content":"` +
	strings.Repeat("The quick brown fox jumps over the lazy dog. ", 225) + `"}]}`

// discardWriter is a ResponseWriter that flushes and forgets.
type discardWriter struct{ h http.Header }

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (d *discardWriter) WriteHeader(int)             {}
func (d *discardWriter) Flush()                      {}

// benchServe runs ServeHTTP b.N times against a fast in-process upstream.
func benchServe(b *testing.B, body string) {
	up := fakeupstream.Start(fakeupstream.Fast(), false)
	defer up.Close()
	name := "bench-serve"
	if strings.Contains(body, `"stream":true`) {
		name += "-stream"
	}
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-" + name, Group: name, Name: name}},
		Channels: []*Channel{{Name: name, UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", "{env.HOME}"), Models: []string{"claude-sonnet-4-5"}}},
		Groups:   []*Group{{Name: name, Channels: []string{name}}},
	}
	provisionHandler(b, r)
	srv := &caddyhttp.Server{}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		req := httptest.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(body))
		req.Header.Set("X-Api-Key", "sk-"+name)
		req.Header.Set("Anthropic-Version", "2023-06-01")
		w := &discardWriter{h: http.Header{}}
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, srv)
		if err := r.ServeHTTP(w, req, nil); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkServeHTTP is one non-streaming request end to end: route, key,
// body, inspect, admit, select, attempt over loopback HTTP, account.
func BenchmarkServeHTTP(b *testing.B) { benchServe(b, benchBody) }

// BenchmarkServeHTTPStream is the same for a 20-event stream.
func BenchmarkServeHTTPStream(b *testing.B) {
	benchServe(b, strings.Replace(benchBody, `"max_tokens":64`, `"max_tokens":64,"stream":true`, 1))
}

// BenchmarkInspect is the one-pass scan of a 10 KB body.
func BenchmarkInspect(b *testing.B) {
	body := []byte(benchBody)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for i := 0; i < b.N; i++ {
		in := inbound{body: body}
		if err := in.inspect(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkStreamCopy is the SSE path of one attempt: hold until content,
// commit, forward and flush each of 20 events, read the usage.
func BenchmarkStreamCopy(b *testing.B) {
	deltas := make([]string, 13)
	for i := range deltas {
		deltas[i] = "tok "
	}
	stream := []byte(strings.Join(fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 9, OutputTokens: 13}, deltas...), ""))
	r := &Relay{}
	r.logger = discardLogger()
	ch := &channel{name: "bench-copy", firstContent: time.Minute, streamIdle: time.Minute}
	g := &group{}
	b.ReportAllocs()
	b.SetBytes(int64(len(stream)))
	for i := 0; i < b.N; i++ {
		in := &inbound{key: &key{group: g}}
		ctx, cancel := context.WithCancelCause(context.Background())
		resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/event-stream"}}, Body: io.NopCloser(bytes.NewReader(stream))}
		dl := &deadline{cancel: cancel, headers: time.Now()}
		dl.start(stageFirstContent, time.Minute)
		s := &streamAttempt{r: r, w: &discardWriter{h: http.Header{}}, in: in, ch: ch, n: 1, ctx: ctx, clientCtx: context.Background(),
			deadline: dl, resp: resp}
		if res := s.run(); res.verdict.outcome != outcomeSuccess || in.usage.output != 13 {
			b.Fatalf("%+v %+v", res.verdict, in.usage)
		}
		dl.stop()
		cancel(nil)
	}
}
