package fakeupstream

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"unsafe"

	"github.com/tidwall/gjson"
)

// A fake upstream is strict by default: before its handler sees a request,
// it refuses what the real API of the request's wire refuses, with that
// API's status and error shape, so that a relay bug only the real API would
// catch fails a test. The wire is told by the path:
//
//   - Anthropic (/v1/messages, /v1/messages/count_tokens,
//     /v1/messages/batches..., /v1/files..., /v1/models..., after any
//     prefix): a credential (x-api-key, or Authorization: Bearer) that the
//     upstream accepts, an anthropic-version header, and for the JSON
//     bodies no unknown top-level field and every required one (a Messages
//     body: model, messages with at least one message, max_tokens;
//     count_tokens: model and messages; a batch: requests, each with
//     custom_id and a valid Messages params).
//   - Bedrock (/model/{id}/invoke, invoke-with-response-stream,
//     count-tokens): an Authorization header, a SigV4 one for the service
//     bedrock (whose signature the test checks if it cares) or a Bedrock API
//     key the upstream accepts, and an InvokeModel body with
//     anthropic_version, max_tokens and messages and no field InvokeModel
//     does not take (model and stream among them); CountTokens' inner body
//     alike.
//   - Vertex (.../publishers/anthropic/models/{model}:rawPredict,
//     :streamRawPredict, count-tokens:rawPredict): a bearer token (which
//     tokens are valid is for the test's token endpoint to say), and a body
//     with anthropic_version, without model (but for count-tokens, which
//     needs it) and without unknown fields.
//   - OpenAI (.../chat/completions): a bearer key the upstream accepts, and
//     a body with model and a non-empty messages and no unknown parameter.
//
// Any other path is the handler's alone. A body that is not a JSON object
// is the handler's to judge too.

// Key is the credential a fake upstream accepts unless told otherwise
// (AcceptKeys): the tests' channels give it as their api_key.
const Key = "sk-ant-api03-fake-upstream-key"

// An Option changes what a fake upstream accepts.
type Option func(*Upstream)

// AcceptKeys makes the upstream accept keys in place of Key: for a channel
// whose credential a test names itself (a second organisation, a Bedrock API
// key, an OpenAI key).
func AcceptKeys(keys ...string) Option {
	return func(u *Upstream) { u.keys = keys }
}

// Lenient lets every request through to the handler unchecked: for a test
// whose upstream is deliberately not the real API (an odd reseller, a
// handler that judges requests itself). Say why where it is used.
func Lenient() Option {
	return func(u *Upstream) { u.lenient = true }
}

// Refusals lists what the upstream refused so far, one line a request: the
// method, the path and the refusal's message. One that records nothing
// keeps none.
func (u *Upstream) Refusals() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.refused...)
}

// refusal is a strict upstream's answer to a request the real API refuses.
type refusal struct {
	status int
	header http.Header
	body   []byte
	msg    string
}

func (f *refusal) write(w http.ResponseWriter) {
	for k, vs := range f.header {
		w.Header()[k] = vs
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(f.status)
	_, _ = w.Write(f.body)
}

// anthropicRefusal is an error in Anthropic's shape, with its request-id.
func anthropicRefusal(status int, typ, msg string) *refusal {
	return &refusal{status: status, header: http.Header{"Request-Id": {"req_fake_error"}}, body: ErrorBody(typ, msg), msg: msg}
}

// bedrockRefusal is an AWS REST error: the name in X-Amzn-ErrorType, the
// message in the body.
func bedrockRefusal(status int, name, msg string) *refusal {
	b, _ := json.Marshal(map[string]string{"message": msg})
	return &refusal{status: status, body: b, msg: name + ": " + msg, header: http.Header{
		"X-Amzn-Errortype": {name + ":http://internal.amazon.com/coral/com.amazon.bedrock/"},
		"X-Amzn-Requestid": {"fake-0000-request"},
	}}
}

// googleRefusal is a Google platform error, as Vertex answers for its own
// checks.
func googleRefusal(code int, status, msg string) *refusal {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"code": code, "message": msg, "status": status}})
	return &refusal{status: code, body: b, msg: status + ": " + msg}
}

// openAIRefusal is an error in OpenAI's shape; param and code are null
// when empty.
func openAIRefusal(status int, msg, param, code string) *refusal {
	orNull := func(s string) any {
		if s == "" {
			return nil
		}
		return s
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "invalid_request_error", "param": orNull(param), "code": orNull(code)}})
	return &refusal{status: status, body: b, msg: msg}
}

// wire is the API a request speaks, and which endpoint of it.
type wire uint8

const (
	wireOther wire = iota
	anthropicMessages
	anthropicCountTokens
	anthropicBatchCreate
	anthropicOther // files, models, batches but their creation: headers only
	bedrockInvoke
	bedrockCountTokens
	vertexPredict
	vertexCountTokens
	openAIChat
)

// wireOf tells a request's wire by its path.
func wireOf(r *http.Request) wire {
	p := r.URL.Path
	post := r.Method == http.MethodPost
	switch {
	case strings.Contains(p, "/publishers/anthropic/models/"):
		switch {
		case strings.HasSuffix(p, "/count-tokens:rawPredict"):
			return vertexCountTokens
		case strings.HasSuffix(p, ":rawPredict"), strings.HasSuffix(p, ":streamRawPredict"):
			return vertexPredict
		}
		return wireOther
	case strings.Contains(p, "/model/"):
		switch {
		case strings.HasSuffix(p, "/count-tokens"):
			return bedrockCountTokens
		case strings.HasSuffix(p, "/invoke"), strings.HasSuffix(p, "/invoke-with-response-stream"):
			return bedrockInvoke
		}
		return wireOther
	case strings.HasSuffix(p, "/chat/completions"):
		return openAIChat
	}
	_, rest, ok := strings.Cut(p, "/v1/")
	if !ok {
		return wireOther
	}
	switch {
	case rest == "messages" && post:
		return anthropicMessages
	case rest == "messages/count_tokens" && post:
		return anthropicCountTokens
	case rest == "messages/batches" && post:
		return anthropicBatchCreate
	case rest == "messages", rest == "messages/count_tokens",
		under(rest, "messages/batches"), under(rest, "files"), under(rest, "models"):
		return anthropicOther
	}
	return wireOther
}

// under reports whether p is dir or below it.
func under(p, dir string) bool {
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// readsBody reports whether the checks of w read the body.
func (w wire) readsBody() bool { return w != wireOther && w != anthropicOther }

// check is what a strict upstream answers to r (whose body is body) in
// place of its handler, or nil to let the handler answer.
func (u *Upstream) check(r *http.Request, w wire, body []byte) *refusal {
	switch w {
	case anthropicMessages, anthropicCountTokens, anthropicBatchCreate, anthropicOther:
		if f := u.anthropicHeaders(r.Header); f != nil {
			return f
		}
		switch w {
		case anthropicMessages:
			if f := anthropicBody(body, "", messagesSchema); f != nil {
				return f
			}
			return u.thinkingRules(body) // thinking.go
		case anthropicCountTokens:
			return anthropicBody(body, "", countTokensSchema)
		case anthropicBatchCreate:
			return batchBody(body)
		}
	case bedrockInvoke, bedrockCountTokens:
		if f := u.bedrockAuth(r.Header); f != nil {
			return f
		}
		if w == bedrockCountTokens {
			inner := gjson.GetBytes(body, "input.invokeModel.body")
			if inner.Type != gjson.String {
				return nil // not a CountTokens body the fake knows how to read
			}
			var err error
			if body, err = base64.StdEncoding.DecodeString(inner.Str); err != nil {
				return bedrockRefusal(400, "ValidationException", "input.invokeModel.body is not valid base64")
			}
		}
		return bedrockBody(body)
	case vertexPredict, vertexCountTokens:
		if !strings.HasPrefix(r.Header.Get("Authorization"), "Bearer ") {
			return googleRefusal(401, "UNAUTHENTICATED", "Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project.")
		}
		s := vertexSchema
		if w == vertexCountTokens {
			s = vertexCountSchema
		}
		return anthropicBody(body, "", s)
	case openAIChat:
		if f := u.openAIAuth(r.Header); f != nil {
			return f
		}
		return openAIBody(body)
	}
	return nil
}

func (u *Upstream) accepts(key string) bool {
	for _, k := range u.keys {
		if key == k {
			return true
		}
	}
	return false
}

// anthropicHeaders checks what every request of Anthropic's API carries:
// a credential, then the API version.
func (u *Upstream) anthropicHeaders(h http.Header) *refusal {
	if key := h.Get("X-Api-Key"); key != "" {
		if !u.accepts(key) {
			return anthropicRefusal(401, "authentication_error", "invalid x-api-key")
		}
	} else if token, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer "); ok {
		if !u.accepts(token) {
			return anthropicRefusal(401, "authentication_error", "Invalid bearer token")
		}
	} else {
		return anthropicRefusal(401, "authentication_error", "x-api-key header is required")
	}
	if h.Get("Anthropic-Version") == "" {
		return anthropicRefusal(400, "invalid_request_error", "anthropic-version: header is required")
	}
	return nil
}

// bedrockAuth checks a Bedrock request's Authorization: a Bedrock API key
// the upstream accepts, or a SigV4 signature scoped to bedrock.
func (u *Upstream) bedrockAuth(h http.Header) *refusal {
	auth := h.Get("Authorization")
	if auth == "" {
		return bedrockRefusal(403, "MissingAuthenticationTokenException", "Missing Authentication Token")
	}
	if token, ok := strings.CutPrefix(auth, "Bearer "); ok {
		if !u.accepts(token) {
			return bedrockRefusal(403, "UnrecognizedClientException", "The security token included in the request is invalid.")
		}
		return nil
	}
	sig, ok := strings.CutPrefix(auth, "AWS4-HMAC-SHA256 ")
	if !ok || !strings.Contains(sig, "Credential=") || !strings.Contains(sig, "SignedHeaders=") || !strings.Contains(sig, "Signature=") {
		return bedrockRefusal(403, "IncompleteSignatureException", "Authorization header requires 'Credential', 'Signature' and 'SignedHeaders' parameters.")
	}
	if !strings.Contains(sig, "/bedrock/aws4_request") {
		return bedrockRefusal(403, "InvalidSignatureException", "Credential should be scoped to correct service: 'bedrock'.")
	}
	return nil
}

// openAIAuth checks an OpenAI request's bearer key.
func (u *Upstream) openAIAuth(h http.Header) *refusal {
	key, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer ")
	if !ok || key == "" {
		return openAIRefusal(401, "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", "", "")
	}
	if !u.accepts(key) {
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

// schema is what a JSON body may hold at its top level.
type schema struct {
	fields   map[string]bool
	required []string // in the order they are reported
	// nonEmpty names the array that must hold an element ("messages")
	nonEmpty string
}

func newSchema(required []string, nonEmpty string, fields ...string) *schema {
	s := &schema{fields: map[string]bool{}, required: required, nonEmpty: nonEmpty}
	for _, f := range append(fields, required...) {
		s.fields[f] = true
	}
	return s
}

// The Messages fields of Anthropic's API, first-party only ones included.
var messageFields = []string{
	"cache_control", "container", "context_management", "fallbacks", "inference_geo", "mcp_servers",
	"metadata", "output_config", "output_format", "service_tier", "speed", "stop_sequences", "stream",
	"system", "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p",
}

// The fields count_tokens takes besides model and messages: no max_tokens,
// no stream, no sampling.
var countTokensFields = []string{
	"cache_control", "context_management", "mcp_servers", "output_config", "output_format",
	"system", "thinking", "tool_choice", "tools",
}

var (
	messagesSchema    = newSchema([]string{"model", "messages", "max_tokens"}, "messages", messageFields...)
	countTokensSchema = newSchema([]string{"model", "messages"}, "messages", countTokensFields...)
	// Vertex: the model is in the URL, the version in the body
	vertexSchema      = newSchema([]string{"anthropic_version", "messages", "max_tokens"}, "messages", messageFields...)
	vertexCountSchema = newSchema([]string{"anthropic_version", "model", "messages"}, "messages", countTokensFields...)
	// Bedrock's InvokeModel takes these and no other field
	bedrockSchema = newSchema([]string{"anthropic_version", "max_tokens", "messages"}, "",
		"anthropic_beta", "context_management", "metadata", "output_config", "stop_sequences", "system",
		"temperature", "thinking", "tool_choice", "tools", "top_k", "top_p")
	openAISchema = newSchema([]string{"model", "messages"}, "messages",
		"audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
		"max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
		"prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_retention", "reasoning_effort",
		"response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
		"stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
		"verbosity", "web_search_options")
)

// flawKind is what is wrong with a body.
type flawKind uint8

const (
	noFlaw  flawKind = iota
	missing          // a required field is absent
	extra            // a field the schema does not take
	empty            // the nonEmpty array is empty
)

// flaw is the first thing wrong with a body: a required field missing
// (in the schema's order), else the first unknown field, else an empty
// nonEmpty array.
type flaw struct {
	kind  flawKind
	field string
}

// check finds the first flaw of body; a body that is not a JSON object has
// none the fake can name.
func (s *schema) check(body []byte) flaw {
	return s.checkValue(parse(body))
}

// parse reads body in place: gjson.ParseBytes would copy it, and the
// benchmarks' upstream checks every request. Nothing of the result outlives
// the check.
func parse(body []byte) gjson.Result {
	return gjson.Parse(unsafe.String(unsafe.SliceData(body), len(body)))
}

func (s *schema) checkValue(root gjson.Result) flaw {
	if !root.IsObject() {
		return flaw{}
	}
	var have uint64 // bit i: required[i] is present
	var unknown, emptied flaw
	root.ForEach(func(k, v gjson.Result) bool {
		for i, f := range s.required {
			if k.Str == f {
				have |= 1 << i
			}
		}
		switch {
		case !s.fields[k.Str]:
			if unknown.kind == noFlaw {
				unknown = flaw{extra, k.Str}
			}
		case k.Str == s.nonEmpty && emptyArray(v):
			emptied = flaw{empty, k.Str}
		}
		return true
	})
	for i, f := range s.required {
		if have&(1<<i) == 0 {
			return flaw{missing, f}
		}
	}
	if unknown.kind != noFlaw {
		return unknown
	}
	return emptied
}

// emptyArray reports whether v is [].
func emptyArray(v gjson.Result) bool {
	return v.IsArray() && strings.TrimSpace(strings.TrimSuffix(strings.TrimPrefix(v.Raw, "["), "]")) == ""
}

// anthropicMessage renders a flaw as Anthropic's validation messages do:
// the field's path, a colon, what is wrong.
func anthropicMessage(f flaw, prefix string) string {
	switch f.kind {
	case missing:
		return prefix + f.field + ": Field required"
	case extra:
		return prefix + f.field + ": Extra inputs are not permitted"
	case empty:
		return prefix + f.field + ": at least one message is required"
	}
	return ""
}

// anthropicBody checks a JSON body against s, its fields' paths starting
// with prefix.
func anthropicBody(body []byte, prefix string, s *schema) *refusal {
	if f := s.check(body); f.kind != noFlaw {
		return anthropicRefusal(400, "invalid_request_error", anthropicMessage(f, prefix))
	}
	return nil
}

var (
	batchSchema        = newSchema([]string{"requests"}, "")
	batchRequestSchema = newSchema([]string{"custom_id", "params"}, "")
)

// batchBody checks a batch's creation: requests, each a custom_id and the
// params of a Messages request.
func batchBody(body []byte) *refusal {
	root := parse(body)
	if f := batchSchema.checkValue(root); f.kind != noFlaw {
		return anthropicRefusal(400, "invalid_request_error", anthropicMessage(f, ""))
	}
	var out *refusal
	root.Get("requests").ForEach(func(i, req gjson.Result) bool {
		prefix := fmt.Sprintf("requests.%d.", i.Int())
		if f := batchRequestSchema.checkValue(req); f.kind != noFlaw {
			out = anthropicRefusal(400, "invalid_request_error", anthropicMessage(f, prefix))
			return false
		}
		if f := messagesSchema.checkValue(req.Get("params")); f.kind != noFlaw {
			out = anthropicRefusal(400, "invalid_request_error", anthropicMessage(f, prefix+"params."))
			return false
		}
		return true
	})
	return out
}

// bedrockBody checks an InvokeModel body as Bedrock's schema validation
// does.
func bedrockBody(body []byte) *refusal {
	const malformed = "Malformed input request: #: %s, please reformat your input and try again."
	switch f := bedrockSchema.check(body); f.kind {
	case missing:
		return bedrockRefusal(400, "ValidationException", fmt.Sprintf(malformed, "required key ["+f.field+"] not found"))
	case extra:
		return bedrockRefusal(400, "ValidationException", fmt.Sprintf(malformed, "extraneous key ["+f.field+"] is not permitted"))
	}
	return nil
}

// openAIBody checks a chat completion's body as OpenAI's API does.
func openAIBody(body []byte) *refusal {
	switch f := openAISchema.check(body); f.kind {
	case missing:
		if f.field == "model" {
			return openAIRefusal(400, "you must provide a model parameter", "", "")
		}
		return openAIRefusal(400, "Missing required parameter: '"+f.field+"'.", f.field, "missing_required_parameter")
	case extra:
		return openAIRefusal(400, "Unrecognized request argument supplied: "+f.field, "", "")
	case empty:
		return openAIRefusal(400, "Invalid '"+f.field+"': empty array. Expected an array with minimum length 1, but got an empty array instead.", f.field, "empty_array")
	}
	return nil
}
