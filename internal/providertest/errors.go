package providertest

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/provider"
)

// ErrorCase is an upstream's error answer and what its provider must make
// of it: the Anthropic error its Response gives (which the providers'
// tests check), and the outcome the relay's classification gives that
// error (which the relay's tests check).
type ErrorCase struct {
	// Name says what the case is, as its subtest's name.
	Name string
	// Status, Header and Body are the upstream's answer; every case's
	// header carries Retry-After: 7 too, which must survive.
	Status int
	Header http.Header
	Body   string
	// WantStatus and WantType are the Anthropic error's status and type.
	WantStatus int
	WantType   string
	// Message is its message, or with a trailing * only its start; ""
	// when the upstream's body passes unchanged.
	Message string
	// Outcome is how the relay classifies the error: client_error, auth,
	// rate_limited, overloaded or transient.
	Outcome string
	// RefusesModel: the provider says the upstream refused the model, not
	// the credential.
	RefusesModel bool
}

// Response is the upstream's answer of c.
func (c ErrorCase) Response() *http.Response {
	h := http.Header{"Retry-After": {"7"}}
	for k, v := range c.Header {
		h[http.CanonicalHeaderKey(k)] = v
	}
	return &http.Response{StatusCode: c.Status, Status: http.StatusText(c.Status), Header: h, Body: io.NopCloser(strings.NewReader(c.Body))}
}

// Check checks out, a provider's translation of c's answer: an Anthropic
// error of c's status, type and message, the upstream's headers kept, and
// the model refused or not.
func (c ErrorCase) Check(t testing.TB, out *http.Response) {
	t.Helper()
	body, err := io.ReadAll(out.Body)
	if err != nil {
		t.Fatal(err)
	}
	if out.StatusCode != c.WantStatus {
		t.Errorf("status %d, want %d", out.StatusCode, c.WantStatus)
	}
	var e struct {
		Type  string `json:"type"`
		Error struct{ Type, Message string }
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Type != "error" || e.Error.Type != c.WantType {
		t.Errorf("body %s: want an Anthropic %s (%v)", body, c.WantType, err)
	}
	switch prefix, start := strings.CutSuffix(c.Message, "*"); {
	case c.Message == "":
		if string(body) != c.Body {
			t.Errorf("body changed: %s", body)
		}
	case start && !strings.HasPrefix(e.Error.Message, prefix):
		t.Errorf("message %q, want it to start with %q", e.Error.Message, prefix)
	case !start && e.Error.Message != c.Message:
		t.Errorf("message %q, want %q", e.Error.Message, c.Message)
	}
	if out.Header.Get("Retry-After") != "7" {
		t.Errorf("the upstream's headers were lost: %v", out.Header)
	}
	if got := provider.RefusesModel(out); got != c.RefusesModel {
		t.Errorf("refuses the model: %v, want %v", got, c.RefusesModel)
	}
}

// bedrockError is the header of a Bedrock exception.
func bedrockError(name string) http.Header { return http.Header{"X-Amzn-ErrorType": {name}} }

// BedrockErrors are Bedrock's REST errors. Only AccessDeniedException
// refuses the model rather than the credential.
var BedrockErrors = []ErrorCase{
	{"throttling", 429, bedrockError("ThrottlingException:http://x/"), `{"message":"slow"}`, 429, "rate_limit_error", "bedrock: *", "rate_limited", false},
	{"service unavailable", 503, bedrockError("ServiceUnavailableException"), `{"message":"x"}`, 529, "overloaded_error", "bedrock: *", "overloaded", false},
	{"model not ready", 429, bedrockError("ModelNotReadyException"), `{"message":"x"}`, 529, "overloaded_error", "bedrock: *", "overloaded", false},
	{"model timeout", 408, bedrockError("ModelTimeoutException"), `{"message":"x"}`, 504, "timeout_error", "bedrock: *", "transient", false},
	{"model error", 424, bedrockError("ModelErrorException"), `{"message":"x"}`, 500, "api_error", "bedrock: *", "transient", false},
	{"internal", 500, bedrockError("InternalServerException"), `{"message":"x"}`, 500, "api_error", "bedrock: *", "transient", false},
	{"validation", 400, bedrockError("ValidationException"), `{"message":"Extra inputs are not permitted"}`, 400, "invalid_request_error", "bedrock: *", "client_error", false},
	{"quota", 400, bedrockError("ServiceQuotaExceededException"), `{"message":"x"}`, 429, "rate_limit_error", "bedrock: *", "rate_limited", false},
	{"access denied", 403, bedrockError("AccessDeniedException"), `{"message":"no"}`, 403, "permission_error", "bedrock: *", "auth", true},
	{"bad signature", 403, bedrockError("InvalidSignatureException"), `{"message":"no"}`, 403, "permission_error", "bedrock: *", "auth", false},
	{"expired token", 403, bedrockError("ExpiredTokenException"), `{"message":"no"}`, 403, "permission_error", "bedrock: *", "auth", false},
	{"unknown model", 404, bedrockError("ResourceNotFoundException"), `{"message":"no"}`, 404, "not_found_error", "bedrock: *", "client_error", false},
	{"name in the body", 429, nil, `{"__type":"com.amazon.bedrock#ThrottlingException","message":"x"}`, 429, "rate_limit_error", "bedrock: *", "rate_limited", false},
	{"stream error with the model's status", 424, bedrockError("ModelStreamErrorException"), `{"message":"x","originalStatusCode":529}`, 529, "overloaded_error", "bedrock: *", "overloaded", false},
	{"unknown 5xx", 502, bedrockError("SomethingNewException"), `{"message":"x"}`, 502, "api_error", "bedrock: *", "transient", false},
}

// vertexQuota is the message of Vertex's quota error.
const vertexQuota = "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model with base model: anthropic-claude-sonnet-4-5."

// jsonHeader is the header of a JSON answer.
var jsonHeader = http.Header{"Content-Type": {"application/json"}}

// VertexErrors are Google's platform errors as Vertex answers them, and
// the model's own (Anthropic's), which pass unchanged. A 403 (as
// PERMISSION_DENIED and FAILED_PRECONDITION become) refuses the model:
// every Vertex URL names one, and a bad credential is UNAUTHENTICATED.
var VertexErrors = []ErrorCase{
	{"resource exhausted", 429, jsonHeader, `{"error":{"code":429,"message":"` + vertexQuota + `","status":"RESOURCE_EXHAUSTED"}}`, 429, "rate_limit_error", "vertex: RESOURCE_EXHAUSTED: " + vertexQuota, "rate_limited", false},
	{"resource exhausted in an array", 429, jsonHeader, `[{"error":{"code":429,"message":"` + vertexQuota + `","status":"RESOURCE_EXHAUSTED"}}]`, 429, "rate_limit_error", "vertex: RESOURCE_EXHAUSTED: " + vertexQuota, "rate_limited", false},
	{"unavailable", 503, jsonHeader, `{"error":{"code":503,"message":"The service is currently unavailable.","status":"UNAVAILABLE"}}`, 529, "overloaded_error", "vertex: UNAVAILABLE: The service is currently unavailable.", "overloaded", false},
	{"deadline exceeded", 504, jsonHeader, `{"error":{"code":504,"message":"Deadline expired","status":"DEADLINE_EXCEEDED"}}`, 504, "timeout_error", "vertex: DEADLINE_EXCEEDED: Deadline expired", "transient", false},
	{"internal", 500, jsonHeader, `{"error":{"code":500,"message":"Internal error encountered.","status":"INTERNAL"}}`, 500, "api_error", "vertex: INTERNAL: Internal error encountered.", "transient", false},
	{"unknown", 500, jsonHeader, `{"error":{"code":500,"message":"?","status":"UNKNOWN"}}`, 500, "api_error", "vertex: UNKNOWN: ?", "transient", false},
	{"invalid argument", 400, jsonHeader, `{"error":{"code":400,"message":"Invalid JSON payload","status":"INVALID_ARGUMENT"}}`, 400, "invalid_request_error", "vertex: INVALID_ARGUMENT: Invalid JSON payload", "client_error", false},
	{"out of range", 400, jsonHeader, `{"error":{"code":400,"message":"max_tokens too large","status":"OUT_OF_RANGE"}}`, 400, "invalid_request_error", "vertex: OUT_OF_RANGE: max_tokens too large", "client_error", false},
	{"not found", 404, jsonHeader, `{"error":{"code":404,"message":"Publisher Model was not found","status":"NOT_FOUND"}}`, 404, "not_found_error", "vertex: NOT_FOUND: Publisher Model was not found", "client_error", false},
	{"unauthenticated", 401, jsonHeader, `{"error":{"code":401,"message":"Request had invalid authentication credentials.","status":"UNAUTHENTICATED"}}`, 401, "authentication_error", "vertex: UNAUTHENTICATED: Request had invalid authentication credentials.", "auth", false},
	{"permission denied", 403, jsonHeader, `{"error":{"code":403,"message":"Permission 'aiplatform.endpoints.predict' denied","status":"PERMISSION_DENIED"}}`, 403, "permission_error", "vertex: PERMISSION_DENIED: Permission 'aiplatform.endpoints.predict' denied", "auth", true},
	{"model not enabled", 400, jsonHeader, `{"error":{"code":400,"message":"Project p is not allowed to use Publisher Model claude","status":"FAILED_PRECONDITION"}}`, 403, "permission_error", "vertex: FAILED_PRECONDITION: Project p is not allowed to use Publisher Model claude", "auth", true},
	{"other status by HTTP status", 409, jsonHeader, `{"error":{"code":409,"message":"aborted","status":"ABORTED"}}`, 409, "invalid_request_error", "vertex: ABORTED: aborted", "client_error", false},
	{"not JSON", 502, jsonHeader, "<html>\n<b>Bad   Gateway</b></html>", 502, "api_error", "vertex: HTTP 502 Bad Gateway: <html> <b>Bad Gateway</b></html>", "transient", false},
	{"anthropic 529 as is", 529, jsonHeader, string(fakeupstream.ErrorBody("overloaded_error", "Overloaded")), 529, "overloaded_error", "", "overloaded", false},
	{"anthropic 400 as is", 400, jsonHeader, string(fakeupstream.ErrorBody("invalid_request_error", "messages: required")), 400, "invalid_request_error", "", "client_error", false},
}

// openAIRequestID is the header of an OpenAI answer.
var openAIRequestID = http.Header{"X-Request-Id": {"req-9"}}

// OpenAIErrors are OpenAI-format errors. A model the upstream does not
// have is refused as a model, and a spent quota as the account's.
var OpenAIErrors = []ErrorCase{
	{"bad request", 400, openAIRequestID, `{"error":{"message":"bad","type":"invalid_request_error","code":null}}`, 400, provider.ErrorType(400), "openai upstream: *", "client_error", false},
	{"bad key", 401, openAIRequestID, `{"error":{"message":"Incorrect API key","type":"invalid_request_error","code":"invalid_api_key"}}`, 401, provider.ErrorType(401), "openai upstream: *", "auth", false},
	{"rate limited", 429, openAIRequestID, `{"error":{"message":"slow","type":"requests","code":"rate_limit_exceeded"}}`, 429, provider.ErrorType(429), "openai upstream: *", "rate_limited", false},
	{"quota spent", 429, openAIRequestID, `{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}`, 402, provider.ErrorType(402), "openai upstream: *", "auth", false},
	{"no such model", 404, openAIRequestID, `{"error":{"message":"The model x does not exist","type":"invalid_request_error","code":"model_not_found"}}`, 403, provider.ErrorType(403), "openai upstream: *", "auth", true},
	{"server error", 500, openAIRequestID, `{"error":{"message":"oops","type":"server_error"}}`, 500, provider.ErrorType(500), "openai upstream: *", "transient", false},
	{"overloaded", 503, openAIRequestID, `{"error":{"message":"overloaded","type":"server_error"}}`, 529, provider.ErrorType(529), "openai upstream: *", "overloaded", false},
	{"error as a string", 502, openAIRequestID, `{"error":"bad gateway"}`, 502, provider.ErrorType(502), "openai upstream: *", "transient", false},
	{"not JSON", 502, openAIRequestID, `<html>bad gateway</html>`, 502, provider.ErrorType(502), "openai upstream: *", "transient", false},
}
