package openai

import (
	"cmp"
	"errors"
	"net/http"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/tidwall/gjson"
)

// UpstreamError is an OpenAI-format upstream's error answer in Anthropic's
// terms: the status Anthropic would answer with, and a message that says
// it came from the upstream.
type UpstreamError struct {
	Status       int
	Message      string
	RefusesModel bool // the upstream refused the model, not the credential
}

// Error implements error.
func (e UpstreamError) Error() string { return e.Message }

// ErrorOf is an OpenAI error answer, of status, in Anthropic's terms. The
// status mostly stays; OpenAI's own conditions move to the status
// Anthropic gives them: an exhausted quota (429 insufficient_quota) is a
// billing error, a model the upstream does not have (404
// model_not_found) a refusal of that model, an overloaded engine (503) an
// overload.
func ErrorOf(status int, body []byte) UpstreamError {
	e := gjson.GetBytes(body, "error")
	if e.Type == gjson.String { // some servers answer {"error":"..."}
		e = gjson.Parse(`{"message":` + e.Raw + `}`)
	}
	code := cmp.Or(e.Get("code").String(), e.Get("type").String())
	msg := e.Get("message").String()
	if msg == "" {
		msg = http.StatusText(status)
	}
	out := UpstreamError{Status: status, Message: "openai upstream: " + msg}
	switch {
	case code == "insufficient_quota":
		out.Status = http.StatusPaymentRequired
	case status == http.StatusNotFound && code == "model_not_found":
		out.Status, out.RefusesModel = http.StatusForbidden, true
	case status == http.StatusServiceUnavailable:
		out.Status = 529
	case status == http.StatusUnprocessableEntity:
		out.Status = http.StatusBadRequest
	case status == http.StatusRequestTimeout:
		out.Status = http.StatusGatewayTimeout
	}
	return out
}

// statusFromChunk guesses the status of an error chunk from its type.
func statusFromChunk(e gjson.Result) int {
	switch cmp.Or(e.Get("code").String(), e.Get("type").String()) {
	case "rate_limit_exceeded", "rate_limit_error", "requests", "tokens":
		return http.StatusTooManyRequests
	case "insufficient_quota":
		return http.StatusTooManyRequests
	case "invalid_request_error":
		return http.StatusBadRequest
	case "server_overloaded", "overloaded":
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// errNoChoices is a chat.completion that answers nothing.
var errNoChoices = errors.New("openai upstream: an answer without choices")

// ChatToMessage translates an upstream's chat.completion into a Messages
// answer.
func ChatToMessage(body []byte) ([]byte, error) {
	r := gjson.ParseBytes(body)
	choice := r.Get("choices.0")
	if !choice.Exists() {
		return nil, errNoChoices
	}
	msg := choice.Get("message")
	var content []jsontext.Value
	if t := msg.Get("content"); t.Str != "" {
		content = append(content, jsontext.Value(`{"type":"text","text":`+t.Raw+`}`))
	} else if t := msg.Get("refusal"); t.Str != "" {
		content = append(content, jsontext.Value(`{"type":"text","text":`+t.Raw+`}`))
	}
	for _, tc := range msg.Get("tool_calls").Array() {
		input := tc.Get("function.arguments").Str
		if !gjson.Valid(input) || !gjson.Parse(input).IsObject() {
			input = "{}"
		}
		content = append(content, jsontext.Value(`{"type":"tool_use","id":`+string(jsonString(tc.Get("id").Str))+
			`,"name":`+string(jsonString(tc.Get("function.name").Str))+`,"input":`+input+`}`))
	}
	if content == nil {
		content = []jsontext.Value{}
	}
	out := msgAnswer{
		ID: r.Get("id").Str, Type: "message", Role: "assistant", Model: r.Get("model").Str, Content: content,
		StopReason: stopReason(choice.Get("finish_reason").Str), StopSequence: jsonNull, Usage: msgUsage(r.Get("usage")),
	}
	return json.Marshal(&out)
}
