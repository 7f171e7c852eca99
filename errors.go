package relay

import (
	"encoding/json"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
)

// relayError is an error the relay answers itself, in the Anthropic shape:
// {"type":"error","error":{"type":..,"message":..,"code":..},"request_id":..}.
type relayError struct {
	status     int
	typ        string // error.type
	code       string // error.code, only for the relay's own conditions
	msg        string
	retryAfter time.Duration // sets retry-after and retry-after-ms when > 0
	noRetry    bool          // sets x-should-retry: false
	allow      string        // sets Allow, for 405
	cause      string        // for the cause label: causeClient unless set
}

func errNotFound(path string) *relayError {
	return &relayError{status: http.StatusNotFound, typ: "not_found_error",
		msg: "no such endpoint: " + path + " (the relay serves POST /v1/messages, POST /v1/messages/count_tokens, POST /v1/chat/completions, GET /v1/models, GET /v1/relay/usage, and the Message Batches and Files APIs)"}
}

func errMethod(method, allow string) *relayError {
	return &relayError{status: http.StatusMethodNotAllowed, typ: "invalid_request_error",
		msg: "method " + method + " is not allowed here; use " + allow, allow: allow}
}

func errAuth(msg string) *relayError {
	return &relayError{status: http.StatusUnauthorized, typ: "authentication_error", msg: msg}
}

// errKeyExpired answers a request whose key expired at at.
func errKeyExpired(name string, at time.Time) *relayError {
	e := errAuth("key " + strconv.Quote(name) + " expired at " + at.UTC().Format(time.RFC3339))
	e.code = "key_expired"
	return e
}

// errKeyDisabled answers a request whose key is disabled in the config.
func errKeyDisabled(name string) *relayError {
	e := errAuth("key " + strconv.Quote(name) + " is disabled")
	e.code = "key_disabled"
	return e
}

func errInvalid(msg string) *relayError {
	return &relayError{status: http.StatusBadRequest, typ: "invalid_request_error", msg: msg}
}

// errTooLarge answers a body over the limit that option (max_body_size,
// max_upload_size) sets, naming the option so that an operator knows what
// to raise.
func errTooLarge(option string, limit int64) *relayError {
	return &relayError{status: http.StatusRequestEntityTooLarge, typ: "request_too_large",
		msg: "request body is larger than the relay's " + option + " of " + mebibytes(limit) + " (" + strconv.FormatInt(limit, 10) + " bytes)"}
}

// errDecodeTooLarge answers a body whose decoding alone would take more
// than the node's decode budget, limit: no wait would make room for it.
func errDecodeTooLarge(cost, limit int64) *relayError {
	return &relayError{status: http.StatusRequestEntityTooLarge, typ: "request_too_large",
		msg: "decoding this request body would take about " + mebibytes(cost) + ", more than the relay's decode_memory of " + mebibytes(limit) +
			" (what all the bodies being decoded on this node may hold at once): a body that is mostly one object of very many members costs up to about 20 times its size to decode; send fewer members, or ask the relay's operator to raise decode_memory"}
}

// mebibytes formats a size in MiB with up to two decimals (in KiB below
// one MiB), as the size options are written.
func mebibytes(n int64) string {
	unit, div := " MiB", float64(1<<20)
	if n < 1<<20 {
		unit, div = " KiB", 1<<10
	}
	s := strconv.FormatFloat(float64(n)/div, 'f', 2, 64)
	return strings.TrimSuffix(strings.TrimRight(s, "0"), ".") + unit
}

// errBodyTimeout answers a client that did not send its body within
// read_body_timeout.
func errBodyTimeout(limit time.Duration) *relayError {
	return &relayError{status: http.StatusRequestTimeout, typ: "timeout_error",
		msg: "the request body did not arrive within the relay's read_body_timeout of " + limit.String()}
}

// errModelNotFound answers a model no channel of the group serves, and
// lists the models it does serve (the first few of them).
func errModelNotFound(model string, g *group) *relayError {
	msg := "no channel of group " + strconv.Quote(g.name) + " serves model " + strconv.Quote(model)
	if len(g.models) > 0 {
		msg += "; it serves " + strings.Join(g.models[:min(len(g.models), maxModelsListed)], ", ")
		if more := len(g.models) - maxModelsListed; more > 0 {
			msg += " and " + strconv.Itoa(more) + " more (GET /v1/models lists them all)"
		}
	}
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "model_not_found", msg: msg, noRetry: true}
}

// maxModelsListed bounds the models an unknown model's answer lists.
const maxModelsListed = 10

// errModelRefused answers a model that every channel serving it refused
// (403) recently: the relay does not ask them again before until.
func errModelRefused(model, group string, until time.Time) *relayError {
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "model_not_found",
		msg: "every channel of group " + strconv.Quote(group) + " that serves model " + strconv.Quote(model) +
			" was refused that model by its upstream (403); they are not asked for it again before " + until.UTC().Format(time.RFC3339),
		noRetry: true}
}

func errNoHealthyChannel(model string, wait time.Duration) *relayError {
	e := &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "no_healthy_channel",
		msg: "every channel serving " + strconv.Quote(model) + " is cooling down after failures; retry later", retryAfter: wait, cause: causeRelay}
	if wait <= 0 {
		e.msg, e.noRetry = "every channel serving "+strconv.Quote(model)+" is disabled", true
	}
	return e
}

// errRateLimitedUpstream answers a request whose every channel is out until
// its upstream's reset (a 429's wait, a spent anthropic-ratelimit-* quota),
// further off than the request may wait. It speaks the upstream's
// language, a 429, so that a client's backoff tells it from a failure.
func errRateLimitedUpstream(model string, wait time.Duration) *relayError {
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "no_healthy_channel",
		msg:        "every channel serving " + strconv.Quote(model) + " is rate-limited by its upstream until its reset; retry later",
		retryAfter: wait, cause: causeRelay}
}

// errOverloadedUpstream answers a request whose every channel is cooling
// after its upstream answered 529. It speaks the upstream's language, a
// 529 overloaded_error, on which a client such as Claude Code turns to its
// fallback model.
func errOverloadedUpstream(model string, wait time.Duration) *relayError {
	return &relayError{status: statusOverloaded, typ: "overloaded_error", code: "no_healthy_channel",
		msg:        "every channel serving " + strconv.Quote(model) + " is cooling down after its upstream said it is overloaded; retry later",
		retryAfter: wait, cause: causeRelay}
}

// statusOverloaded is Anthropic's status for an overloaded API.
const statusOverloaded = 529

// errCapability answers a request that needs features (missing) no
// channel of its group supports, or, when together, that each has a
// channel but none has them all.
func errCapability(missing []string, together bool, group string) *relayError {
	what := "supports " + strings.Join(missing, ", ")
	if together {
		what = "supports all of " + strings.Join(missing, ", ") + " together"
	}
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "capability_not_available",
		msg: "this request needs a feature no channel of group " + strconv.Quote(group) + " can serve: none " + what +
			" (features are body fields, server tools, anthropic-beta values and a long context)", noRetry: true}
}

// errQueue answers a request that could not wait for a busy channel: the
// queue was full, or its class's max_wait passed.
func errQueue(msg string, wait time.Duration) *relayError {
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "queue_timeout",
		msg: msg, retryAfter: max(wait, time.Second), cause: causeRelay}
}

// errStorageUnavailable answers a request that a fleet's limits could not
// admit because their store did not answer in time, when the storage says
// on_error deny.
func errStorageUnavailable() *relayError {
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "storage_unavailable",
		msg: "the relay's shared state (Redis) did not answer in time; retry later", retryAfter: time.Second, cause: causeRelay}
}

// errKeyLimited answers a request its key's (or user entry's) limit
// refused; who describes the key.
func errKeyLimited(who string, scope limits.Scope, wait time.Duration) *relayError {
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "key_rate_limited",
		msg: who + " is over its " + string(scope) + " limit", retryAfter: max(wait, time.Second)}
}

// errUserLimited answers a request whose end user (metadata.user_id) is
// over its key's user_rate or user_tokens; who describes the key. The
// message does not repeat the client's id.
func errUserLimited(who string, scope limits.Scope, wait time.Duration) *relayError {
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "user_rate_limited",
		msg: "this end user (metadata.user_id) is over the user_" + string(scope) + " limit of " + who, retryAfter: max(wait, time.Second)}
}

// errUpstreamFailed answers when the last attempt produced no response at all
// (refused connection, reset, timeout, broken stream before content). A
// retry may find the upstream back, so it says nothing of retrying.
func errUpstreamFailed(v verdict) *relayError {
	e := &relayError{status: http.StatusBadGateway, typ: "api_error", msg: "upstream request failed: " + v.reason, cause: causeUpstream}
	if v.timeout {
		e.status, e.typ = http.StatusGatewayTimeout, "timeout_error"
	}
	return e
}

// errorJSON is the wire shape of every error the relay writes.
type errorJSON struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
		Code    string `json:"code,omitempty"`
	} `json:"error"`
	RequestID string `json:"request_id,omitempty"`
}

func (e *relayError) body(requestID string) []byte {
	var j errorJSON
	j.Type = "error"
	j.Error.Type, j.Error.Message, j.Error.Code = e.typ, e.msg, e.code
	j.RequestID = requestID
	b, _ := json.Marshal(j)
	return b
}

// write sends the error as the whole response.
func (e *relayError) write(w http.ResponseWriter, requestID string) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	if e.retryAfter > 0 {
		setRetryAfter(h, e.retryAfter)
	}
	if e.noRetry {
		h.Set("X-Should-Retry", "false")
	}
	if e.allow != "" {
		h.Set("Allow", e.allow)
	}
	b := e.body(requestID)
	h.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(e.status)
	_, _ = w.Write(b)
}

// setRetryAfter sets retry-after in whole seconds (rounded up, as the header
// only takes integers) and retry-after-ms, which every Anthropic SDK reads
// first, so clients wait exactly as long as needed.
func setRetryAfter(h http.Header, d time.Duration) {
	secs := int64(math.Ceil(d.Seconds()))
	if secs < 1 {
		secs = 1
	}
	h.Set("Retry-After", strconv.FormatInt(secs, 10))
	h.Set("Retry-After-Ms", strconv.FormatInt((d+time.Millisecond-1).Milliseconds(), 10))
}

// sseError renders an Anthropic `event: error` frame, used to end a stream
// that broke after the commit point.
func sseError(typ, msg, requestID string) []byte {
	b := (&relayError{typ: typ, msg: msg}).body(requestID)
	out := make([]byte, 0, len(b)+24)
	out = append(out, "event: error\ndata: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}
