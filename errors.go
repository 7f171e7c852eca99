package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/tidwall/gjson"
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
}

func errNotFound(path string) *relayError {
	return &relayError{status: http.StatusNotFound, typ: "not_found_error",
		msg: "no such endpoint: " + path + " (the relay serves POST /v1/messages, POST /v1/messages/count_tokens and GET /v1/models)"}
}

func errMethod(method, allow string) *relayError {
	return &relayError{status: http.StatusMethodNotAllowed, typ: "invalid_request_error",
		msg: "method " + method + " is not allowed here; use " + allow, allow: allow}
}

func errAuth(msg string) *relayError {
	return &relayError{status: http.StatusUnauthorized, typ: "authentication_error", msg: msg}
}

func errInvalid(msg string) *relayError {
	return &relayError{status: http.StatusBadRequest, typ: "invalid_request_error", msg: msg}
}

func errTooLarge(limit int64) *relayError {
	return &relayError{status: http.StatusRequestEntityTooLarge, typ: "request_too_large",
		msg: "request body is larger than the relay's limit of " + strconv.FormatInt(limit, 10) + " bytes"}
}

// errBodyTimeout answers a client that did not send its body within
// read_body_timeout.
func errBodyTimeout(limit time.Duration) *relayError {
	return &relayError{status: http.StatusRequestTimeout, typ: "timeout_error",
		msg: "the request body did not arrive within the relay's read_body_timeout of " + limit.String()}
}

func errModelNotFound(model, group string) *relayError {
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "model_not_found",
		msg: "no channel of group " + strconv.Quote(group) + " serves model " + strconv.Quote(model), noRetry: true}
}

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
		msg: "every channel serving " + strconv.Quote(model) + " is cooling down after failures; retry later", retryAfter: wait}
	if wait <= 0 {
		e.msg, e.noRetry = "every channel serving "+strconv.Quote(model)+" is disabled", true
	}
	return e
}

func errCapability(fields string) *relayError {
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "capability_not_available",
		msg: "no live channel of this group allows " + fields, noRetry: true}
}

// codeBusy marks the pick that found every channel busy: the request
// queues, or gets errQueue.
const codeBusy = "channels_busy"

func errAllBusy(freeAt, now time.Time) *relayError {
	e := &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: codeBusy, msg: "every channel is at its limit"}
	if !freeAt.IsZero() {
		e.retryAfter = freeAt.Sub(now)
	}
	return e
}

// errQueue answers a request that could not wait for a busy channel: the
// queue was full, or its class's max_wait passed.
func errQueue(msg string, wait time.Duration) *relayError {
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "queue_timeout",
		msg: msg, retryAfter: max(wait, time.Second)}
}

// errKeyLimited answers a request its key's limit refused.
func errKeyLimited(key string, scope limitScope, wait time.Duration) *relayError {
	return &relayError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "key_rate_limited",
		msg: "key " + strconv.Quote(key) + " is over its " + string(scope) + " limit", retryAfter: max(wait, time.Second)}
}

// errUpstreamFailed answers when the last attempt produced no response at all
// (refused connection, reset, timeout, broken stream before content).
func errUpstreamFailed(v verdict, retried bool) *relayError {
	e := &relayError{status: http.StatusBadGateway, typ: "api_error", msg: "upstream request failed: " + v.reason, noRetry: retried}
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

// outcome is what one attempt on one channel came to. It decides whether the
// relay commits, passes the answer through, or fails over, and how the
// channel's health changes.
type outcome uint8

const (
	outcomeSuccess      outcome = iota // 2xx: commit
	outcomeClientError                 // the request's own fault: pass through, channel stays healthy
	outcomeAuth                        // the channel's credential or account is unusable
	outcomeRateLimited                 // 429: the channel's quota is exhausted for a while
	outcomeOverloaded                  // 529: the provider is overloaded, not the credential
	outcomeTransient                   // 5xx, network error, timeout, broken stream
	outcomeCanceled                    // the client went away: nobody's fault
	outcomeModelRefused                // the channel may not serve this model: set aside for it alone
)

var outcomeNames = [...]string{"success", "client_error", "auth", "rate_limited", "overloaded", "transient", "canceled", "model_refused"}

func (o outcome) String() string { return outcomeNames[o] }

// retryable reports whether another channel should be tried.
func (o outcome) retryable() bool {
	switch o {
	case outcomeAuth, outcomeRateLimited, outcomeOverloaded, outcomeTransient, outcomeModelRefused:
		return true
	}
	return false
}

// verdict is an outcome with what the relay learned along with it.
type verdict struct {
	outcome outcome
	// wait is the upstream's own retry hint (retry-after-ms, retry-after,
	// anthropic-ratelimit-*-reset), zero when it gave none.
	wait    time.Duration
	timeout bool   // the attempt hit one of the relay's timeouts
	reason  string // short and secret-free, for logs and the relay's error messages
	model   string // with outcomeModelRefused: the model set aside (the client's name)
}

// statusOutcomes is the classification table of DESIGN.md for upstream HTTP
// statuses. A status not listed is the client's error when below 500 and
// transient from 500 up (see classifyStatus); 2xx is a success.
var statusOutcomes = map[int]outcome{
	http.StatusUnauthorized:        outcomeAuth,
	http.StatusPaymentRequired:     outcomeAuth,
	http.StatusForbidden:           outcomeAuth,
	http.StatusTooManyRequests:     outcomeRateLimited,
	529:                            outcomeOverloaded,
	http.StatusInternalServerError: outcomeTransient,
	http.StatusBadGateway:          outcomeTransient,
	http.StatusServiceUnavailable:  outcomeTransient,
	http.StatusGatewayTimeout:      outcomeTransient,
	http.StatusNotImplemented:      outcomeClientError,
}

// errorTypeOutcomes classifies an Anthropic error by its error.type, for an
// `event: error` that arrives in a 200 stream before any content.
var errorTypeOutcomes = map[string]outcome{
	"overloaded_error":     outcomeOverloaded,
	"rate_limit_error":     outcomeRateLimited,
	"api_error":            outcomeTransient,
	"timeout_error":        outcomeTransient,
	"authentication_error": outcomeAuth,
	"permission_error":     outcomeAuth,
	"billing_error":        outcomeAuth,
}

// accountRefusals are the starts of the messages with which Anthropic
// refuses a request because of the account, not the request: the channel
// is cooled for auth_cooldown. Only the start counts: Anthropic echoes
// request values (an unknown anthropic-beta, say) later in its messages,
// and a client must never be able to write a phrase that cools a channel.
var accountRefusals = []struct{ prefix, reason string }{
	{"Your credit balance is too low", "credit balance too low"},
	{"You have reached your specified workspace API usage limits", "workspace usage limit reached"},
}

// classifyStatus classifies a complete non-2xx upstream answer. body is the
// error body (bounded); it matters for the account-level conditions the
// status alone does not show.
func classifyStatus(status int, h http.Header, body []byte, now time.Time) verdict {
	v := verdict{reason: "status " + strconv.Itoa(status)}
	if status >= 200 && status < 300 {
		v.outcome = outcomeSuccess
		return v
	}
	o, listed := statusOutcomes[status]
	switch {
	case listed:
		v.outcome = o
	case status >= 500:
		v.outcome = outcomeTransient
	default:
		v.outcome = outcomeClientError
	}
	switch status {
	case http.StatusBadRequest:
		e := gjson.GetBytes(body, "error")
		if e.Get("type").String() == "billing_error" {
			v.outcome, v.reason = outcomeAuth, "billing error"
			break
		}
		msg := e.Get("message").String()
		for _, r := range accountRefusals {
			if strings.HasPrefix(msg, r.prefix) {
				v.outcome, v.reason = outcomeAuth, r.reason
				break
			}
		}
	case http.StatusTooManyRequests:
		if gjson.GetBytes(body, "error.details.error_code").String() == "enforced_spend_limit_reached" {
			v.outcome, v.reason = outcomeAuth, "spend limit reached"
			break
		}
		v.wait = retryAfter(h, now)
	}
	return v
}

// refusesModel reports whether a 403 refuses the model rather than the
// credential: the provider says so (Bedrock's AccessDeniedException,
// Vertex's PERMISSION_DENIED and FAILED_PRECONDITION), or the message names
// the model the channel was asked for (a reseller's "model X is not
// allowed"). A client chooses the model, so such a refusal sets the model
// aside on that channel (for capability_ttl) and never the whole channel.
// Matching the name can only ever narrow a refusal to one model.
func refusesModel(status int, body []byte, providerSays bool, upstreamModel string) bool {
	if status != http.StatusForbidden {
		return false
	}
	return providerSays || strings.Contains(gjson.GetBytes(body, "error.message").String(), upstreamModel)
}

// classifyStreamError classifies the data of an `event: error` received
// before the commit point.
func classifyStreamError(data []byte) verdict {
	typ := gjson.GetBytes(data, "error.type").String()
	o, ok := errorTypeOutcomes[typ]
	if !ok {
		o = outcomeClientError
	}
	return verdict{outcome: o, reason: "stream error " + typ}
}

// Causes the relay gives when it cancels an attempt itself.
var (
	errFirstByteTimeout    = errors.New("first byte timeout")
	errFirstContentTimeout = errors.New("first content timeout")
	errResponseTimeout     = errors.New("response timeout")
	errStreamIdle          = errors.New("stream idle timeout")
	// errResponseTooLarge fails an attempt whose non-streaming answer is
	// larger than max_response_size.
	errResponseTooLarge = errors.New("upstream answer larger than max_response_size")
)

// classifyError classifies an attempt that ended without a usable response:
// a transport error or a broken body. ctx is the attempt's context, whose
// cause tells the relay's own timeouts and the client's departure apart.
func classifyError(ctx context.Context, clientCtx context.Context, err error) verdict {
	if clientCtx.Err() != nil {
		return verdict{outcome: outcomeCanceled, reason: "client canceled"}
	}
	if cause := context.Cause(ctx); cause != nil && ctx.Err() != nil {
		switch cause {
		case errFirstByteTimeout, errFirstContentTimeout, errResponseTimeout, errStreamIdle:
			return verdict{outcome: outcomeTransient, timeout: true, reason: cause.Error()}
		}
	}
	v := verdict{outcome: outcomeTransient, reason: err.Error()}
	var dial reverseproxy.DialError
	if errors.As(err, &dial) {
		v.reason = "dial: " + dial.Error()
	}
	var ne interface{ Timeout() bool }
	if errors.As(err, &ne) && ne.Timeout() {
		v.timeout = true
	}
	return v
}

// retryAfter reads the upstream's wait hint: retry-after-ms, else
// retry-after (seconds or an HTTP date), else the reset time of the
// anthropic-ratelimit-* limit that ran out. Zero means no hint.
func retryAfter(h http.Header, now time.Time) time.Duration {
	if v := h.Get("Retry-After-Ms"); v != "" {
		if d := hint(v, time.Millisecond); d > 0 {
			return d
		}
	}
	if v := h.Get("Retry-After"); v != "" {
		if d := hint(v, time.Second); d > 0 {
			return d
		}
		if t, err := http.ParseTime(v); err == nil && t.After(now) {
			return min(t.Sub(now), maxRetryHint)
		}
	}
	return min(rateLimitReset(h, now), maxRetryHint)
}

// maxRetryHint bounds an upstream's wait hint, so a huge value cannot wrap
// around; every cooldown is capped far below it anyway.
const maxRetryHint = 24 * time.Hour

// hint parses a number of units; zero when it is not a positive, finite
// number.
func hint(v string, unit time.Duration) time.Duration {
	x, err := strconv.ParseFloat(v, 64)
	if err != nil || math.IsNaN(x) || math.IsInf(x, 0) || x <= 0 {
		return 0
	}
	if x >= float64(maxRetryHint/unit) {
		return maxRetryHint
	}
	return time.Duration(x * float64(unit))
}

// rateLimitHeaders names the anthropic-ratelimit-* headers of each limit.
var rateLimitHeaders = [...]struct{ remaining, reset string }{
	{"Anthropic-Ratelimit-Requests-Remaining", "Anthropic-Ratelimit-Requests-Reset"},
	{"Anthropic-Ratelimit-Tokens-Remaining", "Anthropic-Ratelimit-Tokens-Reset"},
	{"Anthropic-Ratelimit-Input-Tokens-Remaining", "Anthropic-Ratelimit-Input-Tokens-Reset"},
	{"Anthropic-Ratelimit-Output-Tokens-Remaining", "Anthropic-Ratelimit-Output-Tokens-Reset"},
}

// rateLimitReset returns the time until the latest reset among the
// anthropic-ratelimit-* limits whose remaining count is zero; when none says
// zero, the time until the earliest future reset.
func rateLimitReset(h http.Header, now time.Time) time.Duration {
	var exhausted, earliest time.Duration
	for _, hdr := range rateLimitHeaders {
		reset := h.Get(hdr.reset)
		if reset == "" {
			continue
		}
		t, err := time.Parse(time.RFC3339, reset)
		if err != nil || !t.After(now) {
			continue
		}
		d := t.Sub(now)
		if h.Get(hdr.remaining) == "0" && d > exhausted {
			exhausted = d
		}
		if earliest == 0 || d < earliest {
			earliest = d
		}
	}
	if exhausted > 0 {
		return exhausted
	}
	return earliest
}

// anthropicTypes is the Anthropic error type of a status.
var anthropicTypes = map[int]string{
	400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
	404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error",
}

// anthropicType is the Anthropic error type of a status, for a cloud's
// errors that name none: as listed, else api_error from 500 up, else
// invalid_request_error (which the API uses for other 4xx).
func anthropicType(status int) string {
	if typ, ok := anthropicTypes[status]; ok {
		return typ
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

// asAnthropicError replaces an upstream answer in another shape (a cloud's
// error) with an Anthropic error of status and type, keeping its headers,
// so the classification table and the client see what Anthropic would send.
// modelRefusal says that the cloud refused the model, not the credential.
func asAnthropicError(resp *http.Response, status int, typ, msg, requestID string, modelRefusal bool) *http.Response {
	out := withBody(resp, "application/json", (&relayError{typ: typ, msg: msg}).body(requestID))
	out.Body.(*translatedBody).modelRefusal = modelRefusal
	out.StatusCode, out.Status = status, strconv.Itoa(status)+" "+http.StatusText(status)
	return out
}

// translatedBody is the body of an upstream answer a provider rewrote. It
// carries what only the provider could tell from the original.
type translatedBody struct {
	*bytes.Reader
	modelRefusal bool
}

func (*translatedBody) Close() error { return nil }

// providerRefusedModel reports whether the provider translated this answer
// from a refusal of the model (see refusesModel).
func providerRefusedModel(resp *http.Response) bool {
	t, ok := resp.Body.(*translatedBody)
	return ok && t.modelRefusal
}

// withBody returns resp with body (of contentType) in place of its own,
// which it closes.
func withBody(resp *http.Response, contentType string, body []byte) *http.Response {
	_ = resp.Body.Close()
	out := *resp
	out.Header = resp.Header.Clone()
	out.Header.Set("Content-Type", contentType)
	out.Header.Set("Content-Length", strconv.Itoa(len(body)))
	out.ContentLength = int64(len(body))
	out.Body = &translatedBody{Reader: bytes.NewReader(body)}
	return &out
}
