package apirules

import (
	"fmt"
	"strings"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/tidwall/gjson"
)

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
	return gjson.Parse(jsonscan.String(body))
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
func (r *Rules) anthropicBody(body []byte, prefix string, s *schema) *Refusal {
	if f := s.check(body); f.kind != noFlaw {
		return r.invalid(anthropicMessage(f, prefix))
	}
	return nil
}

var (
	batchSchema        = newSchema([]string{"requests"}, "")
	batchRequestSchema = newSchema([]string{"custom_id", "params"}, "")
)

// batchBody checks a batch's creation: requests, each a custom_id and the
// params of a Messages request.
func (r *Rules) batchBody(body []byte) *Refusal {
	root := parse(body)
	if f := batchSchema.checkValue(root); f.kind != noFlaw {
		return r.invalid(anthropicMessage(f, ""))
	}
	var out *Refusal
	root.Get("requests").ForEach(func(i, req gjson.Result) bool {
		prefix := fmt.Sprintf("requests.%d.", i.Int())
		if f := batchRequestSchema.checkValue(req); f.kind != noFlaw {
			out = r.invalid(anthropicMessage(f, prefix))
			return false
		}
		if f := messagesSchema.checkValue(req.Get("params")); f.kind != noFlaw {
			out = r.invalid(anthropicMessage(f, prefix+"params."))
			return false
		}
		return true
	})
	return out
}

// bedrockBody checks an InvokeModel body as Bedrock's schema validation
// does.
func (r *Rules) bedrockBody(body []byte) *Refusal {
	const malformed = "Malformed input request: #: %s, please reformat your input and try again."
	switch f := bedrockSchema.check(body); f.kind {
	case missing:
		return r.bedrockRefusal(400, "ValidationException", fmt.Sprintf(malformed, "required key ["+f.field+"] not found"))
	case extra:
		return r.bedrockRefusal(400, "ValidationException", fmt.Sprintf(malformed, "extraneous key ["+f.field+"] is not permitted"))
	}
	return nil
}

// openAIBody checks a chat completion's body as OpenAI's API does.
func openAIBody(body []byte) *Refusal {
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
