package openai

import (
	"bytes"
	"cmp"
	"net/http"
	"strconv"

	"github.com/caddy-relay/relay/internal/sse"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/tidwall/gjson"
)

// Completion translates a Messages answer into a chat.completion, created
// at created (Unix seconds), of model when the answer names none, with
// the usage the relay counted.
func Completion(msg []byte, created int64, model string, u Usage) []byte {
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
			tc.Function.Arguments = cmp.Or(b.Get("input").Raw, "{}")
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
		ID: m.Get("id").Str, Object: "chat.completion", Created: created,
		Model:   cmp.Or(m.Get("model").Str, model),
		Choices: []chatChoice{{Message: ans, FinishReason: finishReason(m.Get("stop_reason").Str), Logprobs: jsonNull}},
		Usage:   u.chat(),
	}
	b, _ := json.Marshal(&out)
	return b
}

// Chunks translates a Messages event stream into chat.completion.chunk
// events, as it is written: the relay writes events whole (the held ones
// at its commit point, then one at a time), and each is translated as it
// comes. Its exported fields are set before a write; the relay keeps
// Model and Usage current, as they may change as the stream goes.
type Chunks struct {
	Created      int64  // the chunks' created time, Unix seconds
	Model        string // their model when message_start names none
	IncludeUsage bool   // the stream ends with a chunk of usage
	Usage        Usage  // the usage the relay counted so far, read at message_stop
	MaxEvent     int    // the size of the largest event read

	// StatusOf is the status Anthropic answers an error type with, for an
	// error event, which comes without one.
	StatusOf func(errorType string) int

	events  *sse.Reader
	src     bytes.Reader
	prefix  []byte      // `data: {"id":..,"object":..,"created":..,"model":..,"choices":`
	tools   map[int]int // a tool_use block's index -> its tool call's index
	out     []byte
	stopped bool // message_stop or error was written: nothing follows
}

// Translate translates the whole events of p, and returns their chunks,
// valid until the next call.
func (c *Chunks) Translate(p []byte) []byte {
	if c.events == nil {
		c.events = sse.NewReader(nil, c.MaxEvent)
	}
	c.src.Reset(p)
	c.events.Reset(&c.src)
	c.out = c.out[:0]
	for {
		ev, err := c.events.Next()
		if err != nil {
			break
		}
		c.event(string(ev.Name), ev.Data)
	}
	return c.out
}

// event appends the chunks of one Anthropic event to c.out.
func (c *Chunks) event(name string, data []byte) {
	if c.stopped {
		return
	}
	d := gjson.ParseBytes(data)
	switch name {
	case "message_start":
		m := d.Get("message")
		c.prefix = append(c.prefix[:0], `data: {"id":`...)
		c.prefix, _ = jsontext.AppendQuote(c.prefix, m.Get("id").Str)
		c.prefix = append(c.prefix, `,"object":"chat.completion.chunk","created":`...)
		c.prefix = strconv.AppendInt(c.prefix, c.Created, 10)
		c.prefix = append(c.prefix, `,"model":`...)
		c.prefix, _ = jsontext.AppendQuote(c.prefix, cmp.Or(m.Get("model").Str, c.Model))
		c.prefix = append(c.prefix, `,"choices":`...)
		c.chunk(`{"role":"assistant","content":""}`, "")
	case "content_block_start":
		b := d.Get("content_block")
		switch b.Get("type").Str {
		case "text":
			if t := b.Get("text"); t.Str != "" {
				c.chunkRaw(`{"content":`, t.Raw, `}`)
			}
		case "tool_use":
			if c.tools == nil {
				c.tools = map[int]int{}
			}
			n := len(c.tools)
			c.tools[int(d.Get("index").Int())] = n
			delta := `{"tool_calls":[{"index":` + strconv.Itoa(n) + `,"id":` + b.Get("id").Raw +
				`,"type":"function","function":{"name":` + b.Get("name").Raw + `,"arguments":""}}]}`
			c.chunk(delta, "")
		}
	case "content_block_delta":
		delta := d.Get("delta")
		switch delta.Get("type").Str {
		case "text_delta":
			c.chunkRaw(`{"content":`, delta.Get("text").Raw, `}`)
		case "thinking_delta":
			c.chunkRaw(`{"reasoning_content":`, delta.Get("thinking").Raw, `}`)
		case "input_json_delta":
			if n, ok := c.tools[int(d.Get("index").Int())]; ok {
				c.chunkRaw(`{"tool_calls":[{"index":`+strconv.Itoa(n)+`,"function":{"arguments":`, delta.Get("partial_json").Raw, `}}]}`)
			}
		}
	case "message_delta":
		if stop := d.Get("delta.stop_reason"); stop.Exists() && stop.Type != gjson.Null {
			c.chunk(`{}`, finishReason(stop.Str))
		}
	case "message_stop":
		if c.IncludeUsage {
			u, _ := json.Marshal(c.Usage.chat())
			c.out = append(c.out, c.prefix...)
			c.out = append(c.out, `[],"usage":`...)
			c.out = append(c.out, u...)
			c.out = append(c.out, "}\n\n"...)
		}
		c.out = append(c.out, "data: [DONE]\n\n"...)
		c.stopped = true
	case "error":
		// no [DONE]: the SDK raises the error instead of ending cleanly
		typ := d.Get("error.type").Str
		c.out = append(c.out, "data: "...)
		c.out = append(c.out, errorJSON(c.StatusOf(typ), typ, "", d.Get("error.message").Str, "")...)
		c.out = append(c.out, "\n\n"...)
		c.stopped = true
	}
}

// chunk appends a chunk with delta (raw JSON) and a finish reason ("" for
// null).
func (c *Chunks) chunk(delta, finish string) {
	c.out = append(c.out, c.prefix...)
	c.out = append(c.out, `[{"index":0,"delta":`...)
	c.out = append(c.out, delta...)
	c.out = append(c.out, `,"logprobs":null,"finish_reason":`...)
	if finish == "" {
		c.out = append(c.out, "null"...)
	} else {
		c.out = append(c.out, '"')
		c.out = append(c.out, finish...)
		c.out = append(c.out, '"')
	}
	c.out = append(c.out, "}]}\n\n"...)
}

// chunkRaw appends a chunk whose delta is open + a raw JSON string + end.
func (c *Chunks) chunkRaw(open, raw, end string) {
	if raw == "" {
		return
	}
	c.out = append(c.out, c.prefix...)
	c.out = append(c.out, `[{"index":0,"delta":`...)
	c.out = append(c.out, open...)
	c.out = append(c.out, raw...)
	c.out = append(c.out, end...)
	c.out = append(c.out, `,"logprobs":null,"finish_reason":null}]}`+"\n\n"...)
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

// errorJSON renders {"error":{"message","type","param","code"}}. The
// relay's own code (key_rate_limited, no_healthy_channel...) wins over the
// status's.
func errorJSON(status int, anthropicType, relayCode, msg, param string) []byte {
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
	code := cmp.Or(relayCode, e.code)
	var j chatError
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

// ErrorBody translates an Anthropic error body of status (the relay's
// own, or an upstream's passed through) into OpenAI's shape, keeping its
// message; param names the parameter a refused request got wrong.
func ErrorBody(status int, body []byte, param string) []byte {
	e := gjson.GetBytes(body, "error")
	msg := e.Get("message").Str
	if msg == "" {
		msg = http.StatusText(status)
	}
	return errorJSON(status, e.Get("type").Str, e.Get("code").Str, msg, param)
}
