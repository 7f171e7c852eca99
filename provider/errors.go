package provider

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// MaxErrorBody bounds how much of an upstream's error body a provider (and
// the relay) reads.
const MaxErrorBody = 1 << 20

// UpstreamError is an upstream's error in Anthropic's terms, for a
// provider whose upstream speaks another error shape: the status Anthropic
// answers the same condition with (the relay's classification table gives
// what it does about it), and a message for the client.
type UpstreamError struct {
	// Status is the status Anthropic's API answers the condition with.
	Status int
	// Message is the error's message, for the client: it names the
	// upstream's own error, never a secret.
	Message string
	// RequestID is the upstream's id of the request, if it gave one.
	RequestID string
	// RefusesModel says that the upstream refused the model, not the
	// credential: the relay sets the model aside on the channel instead of
	// cooling it.
	RefusesModel bool
}

// Error makes an UpstreamError an error a provider's NewRequest may
// return: the attempt then ends as if the upstream had answered it, so a
// request the provider cannot carry is the client's 400, not a failure of
// the channel.
func (e UpstreamError) Error() string { return e.Message }

// Body is the error's Anthropic error body.
func (e UpstreamError) Body() []byte { return ErrorBody(ErrorType(e.Status), e.Message, e.RequestID) }

// Response replaces resp with the Anthropic error, keeping resp's headers,
// so the relay's classification and the client see what Anthropic would
// send.
func (e UpstreamError) Response(resp *http.Response) *http.Response {
	out := ReplaceBody(resp, "application/json", e.Body())
	out.Body.(*replacedBody).refusesModel = e.RefusesModel
	out.StatusCode, out.Status = e.Status, strconv.Itoa(e.Status)+" "+http.StatusText(e.Status)
	return out
}

// errorTypes are the error types Anthropic's API gives its statuses.
// Statuses it answers without a type of their own (501, 502, 503) are not
// listed.
var errorTypes = map[int]string{
	http.StatusBadRequest:            "invalid_request_error",
	http.StatusUnauthorized:          "authentication_error",
	http.StatusPaymentRequired:       "billing_error",
	http.StatusForbidden:             "permission_error",
	http.StatusNotFound:              "not_found_error",
	http.StatusRequestEntityTooLarge: "request_too_large",
	http.StatusTooManyRequests:       "rate_limit_error",
	http.StatusInternalServerError:   "api_error",
	http.StatusGatewayTimeout:        "timeout_error",
	529:                              "overloaded_error",
}

// ErrorType is the Anthropic error type of a status, for an upstream's
// error that names none: Anthropic's own, else api_error from 500 up, else
// invalid_request_error (which the API uses for other 4xx).
func ErrorType(status int) string {
	if t, ok := errorTypes[status]; ok {
		return t
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

// ErrorStatus is the status Anthropic's API answers an error type with;
// false for a type that is not Anthropic's.
func ErrorStatus(typ string) (int, bool) {
	for s, t := range errorTypes {
		if t == typ {
			return s, true
		}
	}
	return 0, false
}

// ErrorBody is an Anthropic error body:
// {"type":"error","error":{"type":typ,"message":message},"request_id":requestID},
// without request_id when requestID is empty.
func ErrorBody(typ, message, requestID string) []byte {
	var j struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
		RequestID string `json:"request_id,omitempty"`
	}
	j.Type, j.Error.Type, j.Error.Message, j.RequestID = "error", typ, message, requestID
	b, _ := json.Marshal(j)
	return b
}

// ErrorEvent is the same error as an SSE `event: error`, as Anthropic
// sends one in a stream.
func ErrorEvent(typ, message, requestID string) []byte {
	b := ErrorBody(typ, message, requestID)
	out := make([]byte, 0, len(b)+24)
	out = append(out, "event: error\ndata: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}
