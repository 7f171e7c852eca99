package relay

import (
	"bytes"
	"net/http"
	"strconv"

	"github.com/caddy-relay/relay/internal/sse"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/tidwall/gjson"
)

// chatWriter writes the answer of a Chat Completions request in OpenAI's
// shape. The relay serves the request as a message and writes Anthropic's
// wire to it (a message, an event stream, an error); it translates what it
// is given. Only Chat Completions requests go through it, so the Messages
// path pays nothing for it.
//
// A non-streaming answer or an error is held until finish, which writes it
// whole; an event stream is translated event by event as the relay writes
// and flushes it, so the commit point and flushing stay the relay's.
type chatWriter struct {
	w       http.ResponseWriter
	in      *inbound
	status  int // 0 until WriteHeader
	stream  bool
	held    bytes.Buffer // a non-streaming body, until finish
	created int64

	// the stream's state
	events  *sse.Reader
	src     bytes.Reader
	prefix  []byte      // `data: {"id":..,"object":..,"created":..,"model":..,"choices":`
	tools   map[int]int // a tool_use block's index -> its tool call's index
	out     []byte
	stopped bool // message_stop or error was written: nothing follows
}

func newChatWriter(w http.ResponseWriter, in *inbound) *chatWriter {
	return &chatWriter{w: w, in: in, created: in.start.Unix()}
}

// Header implements http.ResponseWriter.
func (cw *chatWriter) Header() http.Header { return cw.w.Header() }

// Unwrap lets http.ResponseController reach the connection (read
// deadlines).
func (cw *chatWriter) Unwrap() http.ResponseWriter { return cw.w }

// WriteHeader implements http.ResponseWriter: a successful event stream
// starts at once, anything else waits for its body.
func (cw *chatWriter) WriteHeader(status int) {
	if cw.status != 0 {
		return
	}
	cw.status = status
	if status >= 200 && status < 300 && isEventStream(cw.w.Header()) {
		cw.stream = true
		cw.w.Header().Del("Content-Length")
		cw.w.WriteHeader(status)
	}
}

// Write implements http.ResponseWriter.
func (cw *chatWriter) Write(p []byte) (int, error) {
	if cw.status == 0 {
		cw.WriteHeader(http.StatusOK)
	}
	if !cw.stream {
		return cw.held.Write(p)
	}
	if err := cw.translateEvents(p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// FlushError flushes a stream (http.ResponseController calls it); a held
// answer waits for finish.
func (cw *chatWriter) FlushError() error {
	if !cw.stream {
		return nil
	}
	return http.NewResponseController(cw.w).Flush()
}

// finish writes a held answer: a message as a chat.completion, an error in
// OpenAI's error shape.
func (cw *chatWriter) finish() {
	if cw.stream || cw.status == 0 {
		return
	}
	var body []byte
	if cw.status >= 200 && cw.status < 300 {
		body = cw.completion(cw.held.Bytes())
	} else {
		body = chatErrorBody(cw.status, cw.held.Bytes(), cw.in.chatParam())
	}
	h := cw.w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	cw.w.WriteHeader(cw.status)
	_, _ = cw.w.Write(body)
}

// finishReasons maps Messages' stop reasons onto Chat Completions' finish
// reasons.
var finishReasons = map[string]string{
	"end_turn":                      "stop",
	"stop_sequence":                 "stop",
	"pause_turn":                    "stop",
	"max_tokens":                    "length",
	"model_context_window_exceeded": "length",
	"tool_use":                      "tool_calls",
	"refusal":                       "content_filter",
}

func finishReason(stop string) string {
	if f, ok := finishReasons[stop]; ok {
		return f
	}
	return "stop"
}

type chatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   chatUsage    `json:"usage"`
}

type chatChoice struct {
	Index        int            `json:"index"`
	Message      chatAnswer     `json:"message"`
	FinishReason string         `json:"finish_reason"`
	Logprobs     jsontext.Value `json:"logprobs"`
}

type chatAnswer struct {
	Role             string         `json:"role"`
	Content          *string        `json:"content"`
	Refusal          *string        `json:"refusal"`
	ReasoningContent string         `json:"reasoning_content,omitempty"`
	ToolCalls        []chatToolCall `json:"tool_calls,omitempty"`
}

type chatUsage struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	TotalTokens         int64 `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// chatUsageOf is a message's usage in OpenAI's terms: every input token is
// a prompt token, cache reads are its cached tokens.
func chatUsageOf(u usage) chatUsage {
	var c chatUsage
	c.PromptTokens = u.prompt()
	c.CompletionTokens = u.output
	c.TotalTokens = c.PromptTokens + c.CompletionTokens
	c.PromptTokensDetails.CachedTokens = u.cacheRead
	return c
}

var jsonNull = jsontext.Value("null")

// completion translates a Messages answer into a chat.completion.
func (cw *chatWriter) completion(msg []byte) []byte {
	m := gjson.ParseBytes(msg)
	var text, thinking []byte
	var calls []chatToolCall
	m.Get("content").ForEach(func(_, b gjson.Result) bool {
		switch b.Get("type").Str {
		case "text":
			text = append(text, b.Get("text").Str...)
		case "thinking":
			thinking = append(thinking, b.Get("thinking").Str...)
		case "tool_use":
			var tc chatToolCall
			tc.ID, tc.Type = b.Get("id").Str, "function"
			tc.Function.Name = b.Get("name").Str
			tc.Function.Arguments = cmpOr(b.Get("input").Raw, "{}")
			calls = append(calls, tc)
		}
		return true
	})
	ans := chatAnswer{Role: "assistant", ReasoningContent: string(thinking), ToolCalls: calls}
	if len(text) > 0 || len(calls) == 0 {
		s := string(text)
		ans.Content = &s
	}
	out := chatCompletion{
		ID: m.Get("id").Str, Object: "chat.completion", Created: cw.created,
		Model:   cmpOr(m.Get("model").Str, cw.in.target),
		Choices: []chatChoice{{Message: ans, FinishReason: finishReason(m.Get("stop_reason").Str), Logprobs: jsonNull}},
		Usage:   chatUsageOf(cw.in.usage),
	}
	b, _ := json.Marshal(&out)
	return b
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// translateEvents translates whole Anthropic events (the relay writes
// events whole: the held ones at the commit point, then one at a time)
// into chat.completion.chunk events.
func (cw *chatWriter) translateEvents(p []byte) error {
	if cw.events == nil {
		cw.events = sse.NewReader(nil, maxEvent)
	}
	cw.src.Reset(p)
	cw.events.Reset(&cw.src)
	cw.out = cw.out[:0]
	for {
		ev, err := cw.events.Next()
		if err != nil {
			break
		}
		cw.event(string(ev.Name), ev.Data)
	}
	if len(cw.out) == 0 {
		return nil
	}
	_, err := cw.w.Write(cw.out)
	return err
}

// event appends the chunks of one Anthropic event to cw.out.
func (cw *chatWriter) event(name string, data []byte) {
	if cw.stopped {
		return
	}
	d := gjson.ParseBytes(data)
	switch name {
	case "message_start":
		m := d.Get("message")
		cw.prefix = append(cw.prefix[:0], `data: {"id":`...)
		cw.prefix, _ = jsontext.AppendQuote(cw.prefix, m.Get("id").Str)
		cw.prefix = append(cw.prefix, `,"object":"chat.completion.chunk","created":`...)
		cw.prefix = strconv.AppendInt(cw.prefix, cw.created, 10)
		cw.prefix = append(cw.prefix, `,"model":`...)
		cw.prefix, _ = jsontext.AppendQuote(cw.prefix, cmpOr(m.Get("model").Str, cw.in.target))
		cw.prefix = append(cw.prefix, `,"choices":`...)
		cw.chunk(`{"role":"assistant","content":""}`, "")
	case "content_block_start":
		b := d.Get("content_block")
		switch b.Get("type").Str {
		case "text":
			if t := b.Get("text"); t.Str != "" {
				cw.chunkRaw(`{"content":`, t.Raw, `}`)
			}
		case "tool_use":
			if cw.tools == nil {
				cw.tools = map[int]int{}
			}
			n := len(cw.tools)
			cw.tools[int(d.Get("index").Int())] = n
			delta := `{"tool_calls":[{"index":` + strconv.Itoa(n) + `,"id":` + b.Get("id").Raw +
				`,"type":"function","function":{"name":` + b.Get("name").Raw + `,"arguments":""}}]}`
			cw.chunk(delta, "")
		}
	case "content_block_delta":
		delta := d.Get("delta")
		switch delta.Get("type").Str {
		case "text_delta":
			cw.chunkRaw(`{"content":`, delta.Get("text").Raw, `}`)
		case "thinking_delta":
			cw.chunkRaw(`{"reasoning_content":`, delta.Get("thinking").Raw, `}`)
		case "input_json_delta":
			if n, ok := cw.tools[int(d.Get("index").Int())]; ok {
				cw.chunkRaw(`{"tool_calls":[{"index":`+strconv.Itoa(n)+`,"function":{"arguments":`, delta.Get("partial_json").Raw, `}}]}`)
			}
		}
	case "message_delta":
		if stop := d.Get("delta.stop_reason"); stop.Exists() && stop.Type != gjson.Null {
			cw.chunk(`{}`, finishReason(stop.Str))
		}
	case "message_stop":
		if cw.in.chat.includeUsage {
			u, _ := json.Marshal(chatUsageOf(cw.in.usage))
			cw.out = append(cw.out, cw.prefix...)
			cw.out = append(cw.out, `[],"usage":`...)
			cw.out = append(cw.out, u...)
			cw.out = append(cw.out, "}\n\n"...)
		}
		cw.out = append(cw.out, "data: [DONE]\n\n"...)
		cw.stopped = true
	case "error":
		// no [DONE]: the SDK raises the error instead of ending cleanly
		typ := d.Get("error.type").Str
		cw.out = append(cw.out, "data: "...)
		cw.out = append(cw.out, chatErrorJSON(statusOfType(typ), typ, "", d.Get("error.message").Str, "")...)
		cw.out = append(cw.out, "\n\n"...)
		cw.stopped = true
	}
}

// chunk appends a chunk with delta (raw JSON) and a finish reason ("" for
// null).
func (cw *chatWriter) chunk(delta, finish string) {
	cw.out = append(cw.out, cw.prefix...)
	cw.out = append(cw.out, `[{"index":0,"delta":`...)
	cw.out = append(cw.out, delta...)
	cw.out = append(cw.out, `,"logprobs":null,"finish_reason":`...)
	if finish == "" {
		cw.out = append(cw.out, "null"...)
	} else {
		cw.out = append(cw.out, '"')
		cw.out = append(cw.out, finish...)
		cw.out = append(cw.out, '"')
	}
	cw.out = append(cw.out, "}]}\n\n"...)
}

// chunkRaw appends a chunk whose delta is open + a raw JSON string + end.
func (cw *chatWriter) chunkRaw(open, raw, end string) {
	if raw == "" {
		return
	}
	cw.out = append(cw.out, cw.prefix...)
	cw.out = append(cw.out, `[{"index":0,"delta":`...)
	cw.out = append(cw.out, open...)
	cw.out = append(cw.out, raw...)
	cw.out = append(cw.out, end...)
	cw.out = append(cw.out, `,"logprobs":null,"finish_reason":null}]}`+"\n\n"...)
}

// statusOfType is the status Anthropic answers an error type with, for an
// error that comes without one (in a stream).
func statusOfType(typ string) int {
	for _, c := range classes {
		if c.typ == typ {
			return c.status
		}
	}
	return http.StatusInternalServerError
}

// openAIErrors maps a status onto the error type and code OpenAI answers
// it with; the status itself is unchanged, and the SDKs pick their error
// class by it.
var openAIErrors = map[int]struct{ typ, code string }{
	http.StatusBadRequest:            {"invalid_request_error", ""},
	http.StatusUnauthorized:          {"invalid_request_error", "invalid_api_key"},
	http.StatusPaymentRequired:       {"insufficient_quota", "insufficient_quota"},
	http.StatusForbidden:             {"invalid_request_error", "permission_denied"},
	http.StatusNotFound:              {"invalid_request_error", "not_found"},
	http.StatusMethodNotAllowed:      {"invalid_request_error", "method_not_allowed"},
	http.StatusRequestTimeout:        {"invalid_request_error", "timeout"},
	http.StatusRequestEntityTooLarge: {"invalid_request_error", "request_too_large"},
	http.StatusTooManyRequests:       {"rate_limit_error", "rate_limit_exceeded"},
	http.StatusGatewayTimeout:        {"server_error", "timeout"},
	529:                              {"server_error", "overloaded"},
}

// chatErrorJSON renders {"error":{"message","type","param","code"}}. The
// relay's own code (key_rate_limited, no_healthy_channel...) wins over the
// status's.
func chatErrorJSON(status int, anthropicType, relayCode, msg, param string) []byte {
	e, ok := openAIErrors[status]
	if !ok {
		e.typ = "invalid_request_error"
		if status >= 500 {
			e.typ = "server_error"
		}
	}
	if anthropicType == "billing_error" {
		e.typ, e.code = "insufficient_quota", "insufficient_quota"
	}
	code := cmpOr(relayCode, e.code)
	var j struct {
		Error struct {
			Message string         `json:"message"`
			Type    string         `json:"type"`
			Param   jsontext.Value `json:"param"`
			Code    jsontext.Value `json:"code"`
		} `json:"error"`
	}
	j.Error.Message, j.Error.Type, j.Error.Param, j.Error.Code = msg, e.typ, jsonNull, jsonNull
	if param != "" {
		j.Error.Param, _ = jsontext.AppendQuote(nil, param)
	}
	if code != "" {
		j.Error.Code, _ = jsontext.AppendQuote(nil, code)
	}
	b, _ := json.Marshal(&j)
	return b
}

// chatErrorBody translates an Anthropic error body (the relay's own, or an
// upstream's passed through) into OpenAI's shape, keeping its message.
func chatErrorBody(status int, body []byte, param string) []byte {
	e := gjson.GetBytes(body, "error")
	msg := e.Get("message").Str
	if msg == "" {
		msg = http.StatusText(status)
	}
	return chatErrorJSON(status, e.Get("type").Str, e.Get("code").Str, msg, param)
}

// chatParam is the parameter a refused Chat Completions request got wrong.
func (in *inbound) chatParam() string {
	if in.chat == nil {
		return ""
	}
	return in.chat.param
}
