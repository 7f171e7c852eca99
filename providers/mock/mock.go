// Package mock is the relay's provider that answers in-process, without
// any network or credential: module http.handlers.relay.providers.mock.
package mock

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/apirules"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/tidwall/gjson"
)

func init() {
	caddy.RegisterModule(Provider{})
}

// Provider answers Anthropic requests in-process, so the relay can be
// tried, and clients chaos-tested, without any credential: a plausible
// Messages reply or SSE stream whose text names the channel, with correct
// usage numbers. It is as strict as Anthropic's API behind the relay's
// provider anthropic: a request the API refuses (no max_tokens, no
// messages, an unknown field, a tool loop without its thinking block) it
// refuses with the API's 400 invalid_request_error and message, so that a
// client's mistake shows on the first try, locally. Its answers go through
// exactly the same classification, commit point and streaming as a real
// upstream's.
type Provider struct {
	// Latency is how long it waits before answering.
	Latency caddy.Duration `json:"latency,omitempty"`

	// ReplyTokens is the length of its reply in tokens (`tokens <n>` in the
	// Caddyfile), capped by the request's max_tokens. Default: 16.
	ReplyTokens int `json:"reply_tokens,omitempty"`

	// FailRate is the fraction of requests (0 to 1) answered with a 529
	// overloaded_error.
	FailRate float64 `json:"fail_rate,omitempty"`

	transport *mockTransport
}

// CaddyModule returns the Caddy module information.
func (Provider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.mock",
		New: func() caddy.Module { return new(Provider) },
	}
}

// check validates the options; the Caddyfile adapter runs it too.
func (p *Provider) check() error {
	if p.FailRate < 0 || p.FailRate > 1 {
		return fmt.Errorf("fail_rate must be between 0 and 1")
	}
	if p.ReplyTokens < 0 || p.Latency < 0 {
		return fmt.Errorf("tokens and latency must not be negative")
	}
	return nil
}

// Provision implements caddy.Provisioner.
func (p *Provider) Provision(caddy.Context) error {
	if err := p.check(); err != nil {
		return err
	}
	p.transport = &mockTransport{latency: time.Duration(p.Latency), tokens: cmp.Or(p.ReplyTokens, defaultMockTokens), failRate: p.FailRate}
	return nil
}

// BaseURL implements provider.Provider. Nothing is dialed: each mock
// channel counts as its own upstream host.
func (*Provider) BaseURL() string { return "http://mock.invalid" }

// Supports implements provider.FeatureSupport: the mock imitates
// Anthropic's API, and its wire is Anthropic's column of the feature table.
func (*Provider) Supports(name string) provider.Support { return provider.AnthropicWire.Supports(name) }

// Transport implements provider.Transporter: the answers are made in-process.
func (p *Provider) Transport() http.RoundTripper { return p.transport }

// NewRequest implements provider.Provider: the request provider anthropic
// would send, the client's anthropic-* headers forwarded and the API
// version set when the client named none, without a credential.
func (p *Provider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	req, err := c.NewRequest(ctx, http.MethodPost, p.BaseURL()+c.Path, c.Body())
	if err != nil {
		return nil, err
	}
	c.ForwardHeaders(req.Header)
	if req.Header.Get("Anthropic-Version") == "" {
		req.Header.Set("Anthropic-Version", provider.AnthropicVersion)
	}
	req.Header.Set(mockChannelHeader, c.Channel)
	return req, nil
}

// mockChannelHeader tells the in-process transport which channel it
// answers for.
const mockChannelHeader = "X-Relay-Mock-Channel"

// Response implements provider.Provider: the mock answers in Anthropic's wire.
func (*Provider) Response(resp *http.Response, _ *provider.Call) (*http.Response, error) {
	return resp, nil
}

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	latency   <duration>
//	tokens    <n>         (the reply length; N/period is the channel's limit)
//	fail_rate <fraction|percent>
func (p *Provider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return provider.UnmarshalOptions(d, p.CaddyfileOptions(), p.check)
}

// CaddyfileOptions implements provider.OptionsProvider.
func (p *Provider) CaddyfileOptions() provider.Options {
	return provider.Options{Ints: map[string]*int{"tokens": &p.ReplyTokens}, Durations: map[string]*caddy.Duration{"latency": &p.Latency},
		Ratios: map[string]*float64{"fail_rate": &p.FailRate}}
}

// mockTransport makes the mock's answers, where a channel's HTTP transport
// would send the request.
type mockTransport struct {
	latency  time.Duration
	tokens   int
	failRate float64
}

const defaultMockTokens = 16

// RoundTrip implements http.RoundTripper.
func (m *mockTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	channel := req.Header.Get(mockChannelHeader)
	body, err := io.ReadAll(req.Body)
	_ = req.Body.Close()
	if err != nil {
		return nil, err
	}
	id := "req_mock_" + strconv.FormatUint(rand.Uint64(), 36)
	// what the real API refuses, the mock refuses, at once and always (a
	// fail_rate does not hide it): the rules of the tests' strict upstream,
	// without their credential check
	rules := apirules.Rules{RequestID: id}
	if f := rules.Check(apirules.WireOf(req.Method, req.URL.Path), req.Header, body); f != nil {
		resp := mockResponse(req, f.Status, "application/json", id, f.Body)
		for k, vs := range f.Header {
			resp.Header[k] = vs
		}
		return resp, nil
	}
	if m.latency > 0 {
		t := time.NewTimer(m.latency)
		select {
		case <-t.C:
		case <-req.Context().Done():
			t.Stop()
			return nil, req.Context().Err()
		}
	}
	if m.failRate > 0 && rand.Float64() < m.failRate {
		return mockResponse(req, 529, "application/json", id,
			[]byte(`{"type":"error","error":{"type":"overloaded_error","message":"Overloaded (mock channel `+channel+` fail_rate)"},"request_id":"`+id+`"}`)), nil
	}
	inputTokens := max(1, len(body)/4) // the usual rough estimate of 4 bytes a token
	if strings.HasSuffix(req.URL.Path, "/count_tokens") {
		return mockResponse(req, 200, "application/json", id, []byte(`{"input_tokens":`+strconv.Itoa(inputTokens)+`}`)), nil
	}
	model := gjson.GetBytes(body, "model").String()
	out := m.tokens
	if mt := gjson.GetBytes(body, "max_tokens"); mt.Exists() && int(mt.Int()) < out {
		out = max(int(mt.Int()), 0)
	}
	words := mockReply(channel, out)
	msgID := "msg_mock_" + strconv.FormatUint(rand.Uint64(), 36)
	stop := "end_turn"
	if out < m.tokens {
		stop = "max_tokens"
	}
	if gjson.GetBytes(body, "stream").Bool() {
		return mockResponse(req, 200, "text/event-stream; charset=utf-8", id, mockStream(msgID, model, words, stop, inputTokens, out)), nil
	}
	return mockResponse(req, 200, "application/json", id, mockMessage(msgID, model, strings.Join(words, ""), stop, inputTokens, out)), nil
}

// mockReply returns n tokens of text (one word each) that say which
// channel answered.
func mockReply(channel string, n int) []string {
	base := strings.Fields(channel + ": hello from caddy-relay's mock provider. This reply is made in-process; no upstream was called.")
	words := make([]string, n)
	for i := range words {
		w := base[i%len(base)]
		if i > 0 {
			w = " " + w
		}
		words[i] = w
	}
	return words
}

func mockResponse(req *http.Request, status int, contentType, requestID string, body []byte) *http.Response {
	h := http.Header{}
	h.Set("Content-Type", contentType)
	h.Set("Request-Id", requestID)
	cl := int64(len(body))
	if strings.HasPrefix(contentType, "text/event-stream") {
		cl = -1
	} else {
		h.Set("Content-Length", strconv.Itoa(len(body)))
	}
	return &http.Response{
		Status:        strconv.Itoa(status) + " " + http.StatusText(status),
		StatusCode:    status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        h,
		Body:          io.NopCloser(bytes.NewReader(body)),
		ContentLength: cl,
		Request:       req,
	}
}

type mockUsage struct {
	InputTokens              int `json:"input_tokens"`
	CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
	CacheReadInputTokens     int `json:"cache_read_input_tokens"`
	OutputTokens             int `json:"output_tokens"`
}

type mockContent struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

type mockMsg struct {
	ID           string        `json:"id"`
	Type         string        `json:"type"`
	Role         string        `json:"role"`
	Model        string        `json:"model"`
	Content      []mockContent `json:"content"`
	StopReason   *string       `json:"stop_reason"`
	StopSequence *string       `json:"stop_sequence"`
	Usage        mockUsage     `json:"usage"`
}

func mockMessage(id, model, text, stop string, in, out int) []byte {
	b, _ := json.Marshal(mockMsg{
		ID: id, Type: "message", Role: "assistant", Model: model,
		Content:    []mockContent{{Type: "text", Text: text}},
		StopReason: &stop, Usage: mockUsage{InputTokens: in, OutputTokens: out},
	})
	return b
}

// Event payloads of a mock stream, with fields in Anthropic's order.
type (
	mockTyped struct {
		Type string `json:"type"`
	}
	mockStart struct {
		Type    string  `json:"type"`
		Message mockMsg `json:"message"`
	}
	mockBlockStart struct {
		Type         string      `json:"type"`
		Index        int         `json:"index"`
		ContentBlock mockContent `json:"content_block"`
	}
	mockBlockDelta struct {
		Type  string      `json:"type"`
		Index int         `json:"index"`
		Delta mockContent `json:"delta"`
	}
	mockBlockStop struct {
		Type  string `json:"type"`
		Index int    `json:"index"`
	}
	mockDelta struct {
		Type  string `json:"type"`
		Delta struct {
			StopReason   string  `json:"stop_reason"`
			StopSequence *string `json:"stop_sequence"`
		} `json:"delta"`
		Usage mockUsage `json:"usage"`
	}
)

// mockStream renders the event sequence of a streamed Messages reply in
// Anthropic's exact framing.
func mockStream(id, model string, words []string, stop string, in, out int) []byte {
	var b bytes.Buffer
	event := func(name string, data any) {
		j, _ := json.Marshal(data)
		b.WriteString("event: ")
		b.WriteString(name)
		b.WriteString("\ndata: ")
		b.Write(j)
		b.WriteString("\n\n")
	}
	start := mockMsg{ID: id, Type: "message", Role: "assistant", Model: model, Content: []mockContent{},
		Usage: mockUsage{InputTokens: in, OutputTokens: 1}}
	event("message_start", mockStart{Type: "message_start", Message: start})
	event("content_block_start", mockBlockStart{Type: "content_block_start", ContentBlock: mockContent{Type: "text"}})
	event("ping", mockTyped{Type: "ping"})
	for _, w := range words {
		event("content_block_delta", mockBlockDelta{Type: "content_block_delta", Delta: mockContent{Type: "text_delta", Text: w}})
	}
	event("content_block_stop", mockBlockStop{Type: "content_block_stop"})
	delta := mockDelta{Type: "message_delta", Usage: mockUsage{InputTokens: in, OutputTokens: out}}
	delta.Delta.StopReason = stop
	event("message_delta", delta)
	event("message_stop", mockTyped{Type: "message_stop"})
	return b.Bytes()
}

// Interface guards
var (
	_ provider.Provider        = (*Provider)(nil)
	_ provider.Transporter     = (*Provider)(nil)
	_ provider.FeatureSupport  = (*Provider)(nil)
	_ provider.OptionsProvider = (*Provider)(nil)
	_ caddy.Provisioner        = (*Provider)(nil)
	_ caddyfile.Unmarshaler    = (*Provider)(nil)
)
