package relay

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/tidwall/gjson"
)

// outcome is what one attempt on one channel came to (internal/health's
// Outcome): it decides whether the relay commits, passes the answer
// through, or fails over, and how the channel's health changes.
type outcome = health.Outcome

// The outcomes, by the names the relay's code reads them.
const (
	outcomeSuccess      = health.Success
	outcomeClientError  = health.ClientError
	outcomeAuth         = health.Auth
	outcomeRateLimited  = health.RateLimited
	outcomeOverloaded   = health.Overloaded
	outcomeTransient    = health.Transient
	outcomeCanceled     = health.Canceled
	outcomeModelRefused = health.ModelRefused
	outcomeLacksFeature = health.LacksFeature
)

// verdict is an outcome with what the relay learned along with it.
type verdict struct {
	outcome outcome
	// wait is the upstream's own retry hint (retry-after-ms, retry-after,
	// anthropic-ratelimit-*-reset), zero when it gave none.
	wait    time.Duration
	timeout bool   // the attempt hit one of the relay's timeouts
	reason  string // short and secret-free, for logs and the relay's error messages
	model   string // with outcomeModelRefused: the model set aside (the client's name)
	// with outcomeLacksFeature: the features the channel lacks, which the
	// request carried
	features []string
	// with an outcome ByClass: the model class it cools on the channel;
	// "": the whole channel (a resource's call, which no model names)
	class string
}

// forHealth is what the channel's health takes of the verdict.
func (v verdict) forHealth() health.Verdict {
	return health.Verdict{Outcome: v.outcome, Wait: v.wait, Reason: v.reason, Model: v.model, Features: v.features, Class: v.class}
}

// classes is the classification table: each upstream status, the error
// type Anthropic sends with it (as provider.ErrorType gives it to
// providers), and what the relay does about it. The
// lookups below derive from it; a status not listed is the client's error
// below 500 and transient from 500 up, and a 2xx is a success.
var classes = [...]struct {
	status  int
	typ     string // Anthropic's error.type; "" when the status has none of its own
	outcome outcome
}{
	{http.StatusBadRequest, "invalid_request_error", outcomeClientError},
	{http.StatusUnauthorized, "authentication_error", outcomeAuth},
	{http.StatusPaymentRequired, "billing_error", outcomeAuth},
	{http.StatusForbidden, "permission_error", outcomeAuth},
	{http.StatusNotFound, "not_found_error", outcomeClientError},
	{http.StatusRequestEntityTooLarge, "request_too_large", outcomeClientError},
	{http.StatusTooManyRequests, "rate_limit_error", outcomeRateLimited},
	{http.StatusInternalServerError, "api_error", outcomeTransient},
	{http.StatusNotImplemented, "", outcomeClientError},
	{http.StatusBadGateway, "", outcomeTransient},
	{http.StatusServiceUnavailable, "", outcomeTransient},
	{http.StatusGatewayTimeout, "timeout_error", outcomeTransient},
	{529, "overloaded_error", outcomeOverloaded},
}

// statusOutcome is the table's outcome of an HTTP status.
func statusOutcome(status int) outcome {
	for _, c := range classes {
		if c.status == status {
			return c.outcome
		}
	}
	if status >= 500 {
		return outcomeTransient
	}
	return outcomeClientError
}

// typeOutcome is the table's outcome of an Anthropic error type, for an
// `event: error` that arrives in a 200 stream before any content: an
// unknown type is the request's own.
func typeOutcome(typ string) outcome {
	for _, c := range classes {
		if c.typ == typ && typ != "" {
			return c.outcome
		}
	}
	return outcomeClientError
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
	v.outcome = statusOutcome(status)
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
	return verdict{outcome: typeOutcome(typ), reason: "stream error " + typ}
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
