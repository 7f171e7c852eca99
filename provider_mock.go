package relay

import (
	"bytes"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/tidwall/gjson"
)

// mockTransport answers Anthropic requests in-process, so the relay can be
// tried, and clients chaos-tested, without any credential. It sits where a
// channel's HTTP transport would, so a mock answer goes through exactly the
// same classification, commit point and streaming as a real one.
type mockTransport struct {
	channel  string
	latency  time.Duration
	tokens   int
	failRate float64
}

const defaultMockTokens = 16

func newMockTransport(cfg *Channel) *mockTransport {
	m := &mockTransport{channel: cfg.Name, latency: time.Duration(cfg.Latency), tokens: cfg.ReplyTokens, failRate: cfg.FailRate}
	if m.tokens == 0 {
		m.tokens = defaultMockTokens
	}
	return m
}

// RoundTrip implements http.RoundTripper.
func (m *mockTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	body, err := io.ReadAll(req.Body)
	_ = req.Body.Close()
	if err != nil {
		return nil, err
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
	id := "req_mock_" + strconv.FormatUint(rand.Uint64(), 36)
	if m.failRate > 0 && rand.Float64() < m.failRate {
		return mockResponse(req, 529, "application/json", id,
			[]byte(`{"type":"error","error":{"type":"overloaded_error","message":"Overloaded (mock channel `+m.channel+` fail_rate)"},"request_id":"`+id+`"}`)), nil
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
	words := m.reply(out)
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

// reply returns n tokens of text (one word each) that say which channel
// answered.
func (m *mockTransport) reply(n int) []string {
	base := strings.Fields(m.channel + ": hello from caddy-relay's mock provider. This reply is made in-process; no upstream was called.")
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
