// Package apirules holds what the real APIs the relay speaks to refuse in a
// request, with each API's status and error shape: Anthropic's Messages,
// count_tokens, batches, files and models; Bedrock's InvokeModel and
// CountTokens; Vertex's rawPredict; OpenAI's Chat Completions. The tests'
// fake upstreams (internal/fakeupstream) and provider mock check requests
// with it, so that a request the real API would refuse fails in a test, and
// on the quickstart's mock channels, as it would in production. Pure wire
// code: no dependency on the relay.
//
// The wire is told by the path:
//
//   - Anthropic (/v1/messages, /v1/messages/count_tokens,
//     /v1/messages/batches..., /v1/files..., /v1/models..., after any
//     prefix): a credential (x-api-key, or Authorization: Bearer) that the
//     upstream accepts, an anthropic-version header, and for the JSON
//     bodies no unknown top-level field and every required one (a Messages
//     body: model, messages with at least one message, max_tokens;
//     count_tokens: model and messages; a batch: requests, each with
//     custom_id and a valid Messages params), and the rules on thinking
//     blocks (thinking.go).
//   - Bedrock (/model/{id}/invoke, invoke-with-response-stream,
//     count-tokens): an Authorization header, a SigV4 one for the service
//     bedrock or a Bedrock API key the upstream accepts, and an InvokeModel
//     body with anthropic_version, max_tokens and messages and no field
//     InvokeModel does not take (model and stream among them); CountTokens'
//     inner body alike.
//   - Vertex (.../publishers/anthropic/models/{model}:rawPredict,
//     :streamRawPredict, count-tokens:rawPredict): a bearer token, and a
//     body with anthropic_version, without model (but for count-tokens,
//     which needs it) and without unknown fields.
//   - OpenAI (.../chat/completions): a bearer key the upstream accepts, and
//     a body with model and a non-empty messages and no unknown parameter.
//
// Every body these wires read must be a JSON object (valid JSON: the API
// parses it before anything else), and an Anthropic, Vertex or Bedrock
// body may carry at most four cache_control blocks (body.go). Any other
// path is unchecked.
package apirules

import (
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"

	"github.com/tidwall/gjson"
)

// Rules is one upstream's view of the rules: which credentials it takes,
// the request id its refusals carry, and how it verifies thinking blocks.
// The zero Rules checks everything but credentials and signatures.
type Rules struct {
	// Accepts reports whether the upstream takes a credential (an API key
	// or bearer token); nil checks none (provider mock has no credential).
	Accepts func(key string) bool

	// RequestID is the id a refusal carries (Anthropic's request_id and
	// Request-Id; Bedrock's X-Amzn-Requestid).
	RequestID string

	// Thinking reports whether an assistant message's thinking or
	// redacted_thinking block is one this upstream's account signed; nil
	// verifies none (thinking.go).
	Thinking func(block gjson.Result) bool
}

// Refusal is a real API's answer to a request it refuses.
type Refusal struct {
	Status int
	Header http.Header // besides Content-Type, which is application/json
	Body   []byte
	// Message is the refusal in one line, for a test's log.
	Message string
}

// Write answers with the refusal.
func (f *Refusal) Write(w http.ResponseWriter) {
	for k, vs := range f.Header {
		w.Header()[k] = vs
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(f.Status)
	_, _ = w.Write(f.Body)
}

// anthropicError is Anthropic's error body, fields in its order.
type anthropicError struct {
	Type  string `json:"type"`
	Error struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	} `json:"error"`
	RequestID string `json:"request_id"`
}

// ErrorBody is an Anthropic error body.
func ErrorBody(typ, msg, requestID string) []byte {
	e := anthropicError{Type: "error", RequestID: requestID}
	e.Error.Type, e.Error.Message = typ, msg
	b, _ := json.Marshal(e)
	return b
}

// anthropicRefusal is an error in Anthropic's shape, with its request-id.
func (r *Rules) anthropicRefusal(status int, typ, msg string) *Refusal {
	return &Refusal{Status: status, Header: http.Header{"Request-Id": {r.RequestID}}, Body: ErrorBody(typ, msg, r.RequestID), Message: msg}
}

// invalid is Anthropic's 400 invalid_request_error.
func (r *Rules) invalid(msg string) *Refusal {
	return r.anthropicRefusal(400, "invalid_request_error", msg)
}

// bedrockRefusal is an AWS REST error: the name in X-Amzn-ErrorType, the
// message in the body.
func (r *Rules) bedrockRefusal(status int, name, msg string) *Refusal {
	b, _ := json.Marshal(map[string]string{"message": msg})
	return &Refusal{Status: status, Body: b, Message: name + ": " + msg, Header: http.Header{
		"X-Amzn-Errortype": {name + ":http://internal.amazon.com/coral/com.amazon.bedrock/"},
		"X-Amzn-Requestid": {r.RequestID},
	}}
}

// googleRefusal is a Google platform error, as Vertex answers for its own
// checks.
func googleRefusal(code int, status, msg string) *Refusal {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"code": code, "message": msg, "status": status}})
	return &Refusal{Status: code, Body: b, Message: status + ": " + msg}
}

// openAIRefusal is an error in OpenAI's shape; param and code are null
// when empty.
func openAIRefusal(status int, msg, param, code string) *Refusal {
	orNull := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "invalid_request_error", "param": orNull(param), "code": orNull(code)}})
	return &Refusal{Status: status, Body: b, Message: msg}
}

// Wire is the API a request speaks, and which endpoint of it.
type Wire uint8

// The wires and endpoints the rules know.
const (
	Other Wire = iota
	AnthropicMessages
	AnthropicCountTokens
	AnthropicBatchCreate
	AnthropicOther // files, models, batches but their creation: headers only
	BedrockInvoke
	BedrockCountTokens
	VertexPredict
	VertexCountTokens
	OpenAIChat
)

// WireOf tells a request's wire by its method and path.
func WireOf(method, p string) Wire {
	post := method == http.MethodPost
	switch {
	case strings.Contains(p, "/publishers/anthropic/models/"):
		switch {
		case strings.HasSuffix(p, "/count-tokens:rawPredict"):
			return VertexCountTokens
		case strings.HasSuffix(p, ":rawPredict"), strings.HasSuffix(p, ":streamRawPredict"):
			return VertexPredict
		}
		return Other
	case strings.Contains(p, "/model/"):
		switch {
		case strings.HasSuffix(p, "/count-tokens"):
			return BedrockCountTokens
		case strings.HasSuffix(p, "/invoke"), strings.HasSuffix(p, "/invoke-with-response-stream"):
			return BedrockInvoke
		}
		return Other
	case strings.HasSuffix(p, "/chat/completions"):
		return OpenAIChat
	}
	_, rest, ok := strings.Cut(p, "/v1/")
	if !ok {
		return Other
	}
	switch {
	case rest == "messages" && post:
		return AnthropicMessages
	case rest == "messages/count_tokens" && post:
		return AnthropicCountTokens
	case rest == "messages/batches" && post:
		return AnthropicBatchCreate
	case rest == "messages", rest == "messages/count_tokens",
		under(rest, "messages/batches"), under(rest, "files"), under(rest, "models"):
		return AnthropicOther
	}
	return Other
}

// under reports whether p is dir or below it.
func under(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// ReadsBody reports whether the checks of w read the body.
func (w Wire) ReadsBody() bool { return w != Other && w != AnthropicOther }

// Check is the real API's answer to a request of wire w with header h and
// body body when it refuses it, or nil when it takes it.
func (r *Rules) Check(w Wire, h http.Header, body []byte) *Refusal {
	switch w {
	case AnthropicMessages, AnthropicCountTokens, AnthropicBatchCreate, AnthropicOther:
		if f := r.anthropicHeaders(h); f != nil {
			return f
		}
		if w != AnthropicOther {
			if f := r.anthropicJSON(body); f != nil { // body.go
				return f
			}
		}
		switch w {
		case AnthropicMessages:
			if f := r.anthropicBody(body, "", messagesSchema); f != nil {
				return f
			}
			return r.thinkingRules(body) // thinking.go
		case AnthropicCountTokens:
			return r.anthropicBody(body, "", countTokensSchema)
		case AnthropicBatchCreate:
			return r.batchBody(body)
		}
	case BedrockInvoke, BedrockCountTokens:
		if f := r.bedrockAuth(h); f != nil {
			return f
		}
		if f := r.bedrockJSON(body); f != nil { // body.go
			return f
		}
		if w == BedrockCountTokens {
			inner := gjson.GetBytes(body, "input.invokeModel.body")
			if inner.Type != gjson.String {
				return nil // not a CountTokens body the rules know how to read
			}
			var err error
			if body, err = base64.StdEncoding.DecodeString(inner.Str); err != nil {
				return r.bedrockRefusal(400, "ValidationException", "input.invokeModel.body is not valid base64")
			}
			if f := r.bedrockJSON(body); f != nil {
				return f
			}
		}
		return r.bedrockBody(body)
	case VertexPredict, VertexCountTokens:
		if r.Accepts != nil && !strings.HasPrefix(h.Get("Authorization"), "Bearer ") {
			return googleRefusal(401, "UNAUTHENTICATED", "Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project.")
		}
		if f := r.anthropicJSON(body); f != nil { // body.go
			return f
		}
		s := vertexSchema
		if w == VertexCountTokens {
			s = vertexCountSchema
		}
		return r.anthropicBody(body, "", s)
	case OpenAIChat:
		if f := r.openAIAuth(h); f != nil {
			return f
		}
		return openAIBody(body)
	}
	return nil
}

// anthropicHeaders checks what every request of Anthropic's API carries:
// a credential, then the API version.
func (r *Rules) anthropicHeaders(h http.Header) *Refusal {
	if r.Accepts != nil {
		if key := h.Get("X-Api-Key"); key != "" {
			if !r.Accepts(key) {
				return r.anthropicRefusal(401, "authentication_error", "invalid x-api-key")
			}
		} else if token, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer "); ok {
			if !r.Accepts(token) {
				return r.anthropicRefusal(401, "authentication_error", "Invalid bearer token")
			}
		} else {
			return r.anthropicRefusal(401, "authentication_error", "x-api-key header is required")
		}
	}
	if h.Get("Anthropic-Version") == "" {
		return r.invalid("anthropic-version: header is required")
	}
	return nil
}

// bedrockAuth checks a Bedrock request's Authorization: a Bedrock API key
// the upstream accepts, or a SigV4 signature scoped to bedrock.
func (r *Rules) bedrockAuth(h http.Header) *Refusal {
	if r.Accepts == nil {
		return nil
	}
	auth := h.Get("Authorization")
	if auth == "" {
		return r.bedrockRefusal(403, "MissingAuthenticationTokenException", "Missing Authentication Token")
	}
	if token, ok := strings.CutPrefix(auth, "Bearer "); ok {
		if !r.Accepts(token) {
			return r.bedrockRefusal(403, "UnrecognizedClientException", "The security token included in the request is invalid.")
		}
		return nil
	}
	sig, ok := strings.CutPrefix(auth, "AWS4-HMAC-SHA256 ")
	if !ok || !strings.Contains(sig, "Credential=") || !strings.Contains(sig, "SignedHeaders=") || !strings.Contains(sig, "Signature=") {
		return r.bedrockRefusal(403, "IncompleteSignatureException", "Authorization header requires 'Credential', 'Signature' and 'SignedHeaders' parameters.")
	}
	if !strings.Contains(sig, "/bedrock/aws4_request") {
		return r.bedrockRefusal(403, "InvalidSignatureException", "Credential should be scoped to correct service: 'bedrock'.")
	}
	return nil
}

// openAIAuth checks an OpenAI request's bearer key.
func (r *Rules) openAIAuth(h http.Header) *Refusal {
	if r.Accepts == nil {
		return nil
	}
	key, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
	if !ok || key == "" {
		return openAIRefusal(401, "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", "", "")
	}
	if !r.Accepts(key) {
		return openAIRefusal(401, "Incorrect API key provided: "+maskKey(key)+". You can find your API key at https://platform.openai.com/account/api-keys.", "", "invalid_api_key")
	}
	return nil
}

// maskKey shows a key as OpenAI's errors do: its ends only.
func maskKey(k string) string {
	if len(k) <= 8 {
		return "********"
	}
	return k[:3] + "*********" + k[len(k)-4:]
}
