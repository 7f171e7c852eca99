// Package fakeupstream is a fake Anthropic API for tests and benchmarks: a
// real HTTP server on 127.0.0.1 that records every request it receives and
// answers with whatever the test scripts, in Anthropic's exact wire format.
// It is as strict as the real API by default (see strict.go): a request the
// real API would refuse is refused before the test's handler sees it.
package fakeupstream

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/apirules"
)

// Request is what the upstream received.
type Request struct {
	Method   string
	Path     string
	RawQuery string
	Host     string
	Header   http.Header
	Body     []byte
}

// Upstream is a running fake. Its handler may be swapped while it runs.
type Upstream struct {
	*httptest.Server

	mu      sync.Mutex
	handler http.Handler
	reqs    []Request
	refused []string
	record  bool
	conns   atomic.Int64
	open    atomic.Int64

	keys      []string // the credentials it accepts
	lenient   bool     // no checks: every request goes to the handler
	account   string   // the secret its thinking signatures are made with; "": it verifies none (thinking.go)
	rules     apirules.Rules
	refusedBy func(string)
}

// New starts an upstream answering with h on 127.0.0.1 and stops it when the
// test ends. A request it refuses as the real API would fails the test: the
// relay sent what no real upstream takes. (A test that wants an upstream to
// refuse scripts the refusal in h.)
func New(t testing.TB, h http.Handler, opts ...Option) *Upstream {
	u := unstarted(h, true, opts)
	u.refusedBy = func(line string) {
		t.Errorf("upstream %s refused %s, as the real API would", u.URL, line)
	}
	u.Server.Start()
	t.Cleanup(u.Close) // after the handlers are done: no error comes later
	return u
}

// Start starts an upstream answering with h on 127.0.0.1; the caller closes
// it. With record false it keeps no copy of the requests, for benchmarks.
func Start(h http.Handler, record bool, opts ...Option) *Upstream {
	u := unstarted(h, record, opts)
	u.Server.Start()
	return u
}

// StartTLS starts an upstream answering with h on 127.0.0.1 over TLS, with
// a self-signed certificate, offering HTTP/2 by ALPN as Anthropic's API
// does: a client that negotiates it sends its requests as streams of
// shared connections. The caller closes it.
func StartTLS(h http.Handler, record bool, opts ...Option) *Upstream {
	u := unstarted(h, record, opts)
	u.Server.EnableHTTP2 = true
	u.Server.StartTLS()
	return u
}

func unstarted(h http.Handler, record bool, opts []Option) *Upstream {
	u := &Upstream{handler: h, record: record, keys: []string{Key}}
	for _, o := range opts {
		o(u)
	}
	u.rules = u.rulesOf()
	u.Server = httptest.NewUnstartedServer(http.HandlerFunc(u.serve))
	u.Server.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		switch s {
		case http.StateNew:
			u.conns.Add(1)
			u.open.Add(1)
		case http.StateClosed, http.StateHijacked:
			u.open.Add(-1)
		}
	}
	return u
}

// Conns is the number of TCP connections the upstream accepted so far.
func (u *Upstream) Conns() int64 { return u.conns.Load() }

// OpenConns is the number of TCP connections open now. Over HTTP/2 it may
// be well below Conns: clients that dial at once for requests to a new
// host keep one of the connections and close the others.
func (u *Upstream) OpenConns() int64 { return u.open.Load() }

// bodies holds the buffers of the bodies an upstream that records nothing
// reads to check them.
var bodies = sync.Pool{New: func() any { return new(bytes.Buffer) }}

func (u *Upstream) serve(w http.ResponseWriter, r *http.Request) {
	wire := apirules.Other
	if !u.lenient {
		wire = apirules.WireOf(r.Method, r.URL.Path)
	}
	var body []byte
	switch {
	case u.record:
		body, _ = io.ReadAll(r.Body)
	case wire.ReadsBody():
		buf := bodies.Get().(*bytes.Buffer)
		buf.Reset()
		_, _ = buf.ReadFrom(r.Body)
		defer bodies.Put(buf)
		body = buf.Bytes()
	}
	u.mu.Lock()
	if u.record {
		u.reqs = append(u.reqs, Request{Method: r.Method, Path: r.URL.Path, RawQuery: r.URL.RawQuery, Host: r.Host, Header: r.Header.Clone(), Body: body})
	}
	h := u.handler
	u.mu.Unlock()
	if f := u.rules.Check(wire, r.Header, body); f != nil {
		line := r.Method + " " + r.URL.Path + ": " + f.Message
		if u.record {
			u.mu.Lock()
			u.refused = append(u.refused, line)
			u.mu.Unlock()
		}
		if u.refusedBy != nil {
			u.refusedBy(line)
		}
		f.Write(w)
		return
	}
	if body != nil {
		r.Body = io.NopCloser(bytes.NewReader(body))
	}
	h.ServeHTTP(w, r)
}

// SetHandler replaces the handler for the requests to come.
func (u *Upstream) SetHandler(h http.Handler) {
	u.mu.Lock()
	u.handler = h
	u.mu.Unlock()
}

// Hits is the number of requests received so far.
func (u *Upstream) Hits() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.reqs)
}

// Requests returns a copy of every request received so far.
func (u *Upstream) Requests() []Request {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]Request(nil), u.reqs...)
}

// Last returns the last request received; it fails the test when there was
// none.
func (u *Upstream) Last(t testing.TB) Request {
	t.Helper()
	reqs := u.Requests()
	if len(reqs) == 0 {
		t.Fatalf("upstream %s received no request", u.URL)
	}
	return reqs[len(reqs)-1]
}

// DeadURL returns the URL of a port on 127.0.0.1 that refuses connections.
func DeadURL(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return "http://" + addr
}

// Usage is the token usage a reply reports.
type Usage struct {
	InputTokens              int `json:"input_tokens"`
	CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int `json:"cache_read_input_tokens"`
	OutputTokens             int `json:"output_tokens"`
	// ServerToolUse, when set, counts the server tools the reply used,
	// as the API reports them beside the tokens
	ServerToolUse *ServerToolUse `json:"server_tool_use,omitempty"`
}

// ServerToolUse is the server tool calls a reply reports in its usage.
type ServerToolUse struct {
	WebSearchRequests int `json:"web_search_requests"`
	WebFetchRequests  int `json:"web_fetch_requests"`
}

// MessageBody is a complete non-streaming Messages reply.
func MessageBody(model, text string, u Usage) []byte {
	b, _ := json.Marshal(map[string]any{
		"id": "msg_fake", "type": "message", "role": "assistant", "model": model,
		"content":     []map[string]string{{"type": "text", "text": text}},
		"stop_reason": "end_turn", "stop_sequence": nil, "usage": u,
	})
	return b
}

// Message answers every request with a 200 non-streaming reply whose text
// is text, echoing the request's model.
func Message(text string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Model string `json:"model"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Request-Id", "req_fake")
		_, _ = w.Write(MessageBody(req.Model, text, Usage{InputTokens: 10, OutputTokens: 5}))
	}
}

// Event renders one SSE event in Anthropic's framing.
func Event(name, data string) string {
	return "event: " + name + "\ndata: " + data + "\n\n"
}

// StreamEvents is the event sequence of a streamed reply with one text
// block made of the given deltas. Server tools count nothing yet in its
// message_start: its message_delta carries u's counts, as the API's does.
func StreamEvents(model string, u Usage, deltas ...string) []string {
	start := u
	start.OutputTokens = 1
	if u.ServerToolUse != nil {
		start.ServerToolUse = &ServerToolUse{}
	}
	msg, _ := json.Marshal(map[string]any{"type": "message_start", "message": map[string]any{
		"id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": []any{},
		"stop_reason": nil, "stop_sequence": nil, "usage": start}})
	evs := []string{
		Event("message_start", string(msg)),
		Event("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`),
		Event("ping", `{"type": "ping"}`),
	}
	for _, d := range deltas {
		j, _ := json.Marshal(d)
		evs = append(evs, Event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":`+string(j)+`}}`))
	}
	usage, _ := json.Marshal(u)
	return append(evs,
		Event("content_block_stop", `{"type":"content_block_stop","index":0}`),
		Event("message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":`+string(usage)+`}`),
		Event("message_stop", `{"type":"message_stop"}`),
	)
}

// Stream answers with a 200 event stream of the given events, flushing each
// one as it is written.
func Stream(events ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		StartStream(w)
		for _, ev := range events {
			if !WriteEvent(w, ev) {
				return
			}
		}
	}
}

// StartStream writes the headers of an Anthropic event stream.
func StartStream(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("Request-Id", "req_fake_stream")
	w.WriteHeader(http.StatusOK)
	_ = http.NewResponseController(w).Flush()
}

// WriteEvent writes and flushes raw event bytes; it reports whether the
// client is still there.
func WriteEvent(w http.ResponseWriter, ev string) bool {
	if _, err := io.WriteString(w, ev); err != nil {
		return false
	}
	return http.NewResponseController(w).Flush() == nil
}

// ErrorBody is an Anthropic error body.
func ErrorBody(typ, msg string) []byte {
	return apirules.ErrorBody(typ, msg, requestID)
}

// Error answers with status and an Anthropic error body; header pairs
// ("Retry-After", "3") are set first.
func Error(status int, typ, msg string, header ...string) http.HandlerFunc {
	body := ErrorBody(typ, msg)
	return Raw(status, body, header...)
}

// Raw answers with status and body as given, as JSON.
func Raw(status int, body []byte, header ...string) http.HandlerFunc {
	if len(header)%2 != 0 {
		panic(fmt.Sprintf("fakeupstream: odd header list %q", header))
	}
	return func(w http.ResponseWriter, r *http.Request) {
		for i := 0; i < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write(body)
	}
}

// Hangup answers by closing the connection without a response.
func Hangup() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close()
		}
	}
}

// CutAfter sends the response headers with a Content-Length larger than
// the body, writes part and closes the connection: a reply cut mid-body.
func CutAfter(status int, part []byte, promised int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		fmt.Fprintf(buf, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", status, http.StatusText(status), promised)
		_, _ = buf.Write(part)
		_ = buf.Flush()
	}
}

// StreamThenCut sends the events and then drops the connection, without
// ending the chunked body: a stream broken mid-way.
func StreamThenCut(events ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		fmt.Fprint(buf, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
		for _, ev := range events {
			fmt.Fprintf(buf, "%x\r\n%s\r\n", len(ev), ev)
		}
		_ = buf.Flush()
	}
}

// Held streams the first n events, then holds the stream open until release
// is closed (then sends the rest) or the request is canceled (then closes
// canceled, if given).
func Held(events []string, n int, release <-chan struct{}, canceled chan<- struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		StartStream(w)
		for _, ev := range events[:n] {
			WriteEvent(w, ev)
		}
		select {
		case <-release:
		case <-r.Context().Done():
			if canceled != nil {
				close(canceled)
			}
			return
		}
		for _, ev := range events[n:] {
			WriteEvent(w, ev)
		}
	}
}

// Fast answers every request at once: a non-streaming reply, or a stream of
// 20 events when the body asks for one. The replies are rendered once.
func Fast() http.HandlerFunc {
	message := MessageBody("claude-sonnet-4-5", "ok", Usage{InputTokens: 2500, OutputTokens: 5})
	deltas := make([]string, 13) // with the 7 framing events: 20 in all
	for i := range deltas {
		deltas[i] = "tok "
	}
	stream := []byte(strings.Join(StreamEvents("claude-sonnet-4-5", Usage{InputTokens: 2500, OutputTokens: 13}, deltas...), ""))
	bufs := sync.Pool{New: func() any { return new(bytes.Buffer) }}
	return func(w http.ResponseWriter, r *http.Request) {
		buf := bufs.Get().(*bytes.Buffer)
		buf.Reset()
		_, _ = buf.ReadFrom(r.Body)
		streaming := bytes.Contains(buf.Bytes(), []byte(`"stream":true`))
		bufs.Put(buf)
		if streaming {
			w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
			_, _ = w.Write(stream)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(message)))
		_, _ = w.Write(message)
	}
}

// Idle reads the request, starts a stream (message_start,
// content_block_start, one delta), then sends a ping every interval until
// the client goes away: a long generation that holds a connection and
// little else. Reading the whole request first, as Anthropic's API does,
// matters over HTTP/2: a request body left unread keeps its share of the
// connection's flow-control window, and the streams of a connection stop
// sending once it is spent.
func Idle(interval time.Duration) http.HandlerFunc {
	evs := StreamEvents("claude-sonnet-4-5", Usage{InputTokens: 1}, "first")
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		StartStream(w)
		for _, ev := range evs[:4] {
			WriteEvent(w, ev)
		}
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-r.Context().Done():
				return
			case <-t.C:
				if !WriteEvent(w, Event("ping", `{"type": "ping"}`)) {
					return
				}
			}
		}
	}
}
