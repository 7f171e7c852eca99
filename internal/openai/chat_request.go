package openai

import (
	"bytes"
	"cmp"
	"errors"
	"math"
	"strconv"
	"strings"

	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// defaultMaxTokens is the max_tokens of a chat completion that sets no
// limit, for a model whose maximum output is not known: Messages requires
// one, Chat Completions does not. A known model is asked for its maximum
// output.
const defaultMaxTokens = 8192

// Chat is what the translation of a Chat Completions request tells about
// its answer.
type Chat struct {
	IncludeUsage bool // stream_options.include_usage: the stream ends with a chunk of usage
}

// ParamError is a Chat Completions request the translation refuses: a 400
// naming the parameter (Param, "" when none is to blame), in OpenAI's
// terms.
type ParamError struct {
	Param, Msg string
}

// Error implements error.
func (e *ParamError) Error() string { return e.Msg }

// badParam is the refusal of param, for msg.
func badParam(param, msg string) *ParamError {
	return &ParamError{Param: param, Msg: param + ": " + msg}
}

// errTranslation is a request whose translation could not be encoded.
func errTranslation(err error) *ParamError {
	return &ParamError{Msg: "could not translate the request: " + err.Error()}
}

// TranslateChat writes to dst the Messages body that is relayed in place
// of a Chat Completions body. maxOutput is the most output tokens a model
// writes in one answer, 0 when it is not known (nil knows no model).
//
// Every parameter is either carried over, accepted at a value that asks
// for nothing, or refused with a 400 naming it. A body with several
// problems is refused for the first of them in this order: a value of the
// wrong type (in the order of the body), then the parameters in the order
// toMessages reads them.
func TranslateChat(dst *bytes.Buffer, body []byte, maxOutput func(model string) int64) (Chat, *ParamError) {
	var req chatRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return Chat{}, jsonError(err)
	}
	var out msgFrame
	modelMax := int64(0)
	if maxOutput != nil {
		modelMax = maxOutput(req.Model)
	}
	c, perr := req.toMessages(&out, modelMax)
	if perr != nil {
		return Chat{}, perr
	}
	if err := writeSpliced(dst, &out, out.spliced); err != nil {
		return Chat{}, errTranslation(err)
	}
	return c, nil
}

// jsonError says where a body that does not decode went wrong, without
// echoing it.
func jsonError(err error) *ParamError {
	var se *json.SemanticError
	if errors.As(err, &se) && se.JSONPointer != "" {
		p := strings.TrimPrefix(string(se.JSONPointer), "/")
		p = p[:min(len(p), 128)]
		msg := "has the wrong type"
		if se.JSONKind != 0 {
			msg = "must not be a JSON " + kindName(se.JSONKind)
		}
		return badParam(strings.ReplaceAll(p, "/", "."), msg)
	}
	var sx *jsontext.SyntacticError
	if errors.As(err, &sx) {
		if errors.Is(sx.Err, jsontext.ErrDuplicateName) {
			return &ParamError{Msg: "request body is not valid JSON: duplicate key at " + strconv.Quote(string(sx.JSONPointer)[:min(len(sx.JSONPointer), 128)])}
		}
		return &ParamError{Msg: "request body is not valid JSON: error at byte offset " + strconv.FormatInt(sx.ByteOffset, 10)}
	}
	return &ParamError{Msg: "request body is not valid JSON"}
}

// toMessages fills out with the Messages request of r, for a model that
// writes at most modelMax tokens (0: not known).
func (r *chatRequest) toMessages(out *msgFrame, modelMax int64) (Chat, *ParamError) {
	var c Chat
	if len(r.Unknown) > 0 {
		name := unknownParam(r.Unknown)
		return c, badParam(name, "not supported by this relay (a Claude model behind an OpenAI-compatible endpoint)")
	}
	if err := r.refuseUnsupported(); err != nil {
		return c, err
	}
	if r.Model == "" {
		return c, badParam("model", "required")
	}
	out.Model = r.Model
	if r.Messages.n == 0 {
		return c, badParam("messages", "must hold at least one message")
	}
	if r.Messages.err != nil {
		return c, r.Messages.err
	}
	if !r.Messages.w.close() {
		return c, badParam("messages", "must hold a user message, not only system messages")
	}
	out.Messages = out.spliced.add("messages", &r.Messages.w.turns)
	if r.Messages.w.system.Len() > 0 {
		out.System = out.spliced.add("system", &r.Messages.w.system)
	}

	// limits
	out.MaxTokens = cmp.Or(modelMax, defaultMaxTokens)
	switch {
	case r.MaxCompletionTokens != nil:
		out.MaxTokens = *r.MaxCompletionTokens
		if out.MaxTokens < 1 {
			return c, badParam("max_completion_tokens", "must be at least 1")
		}
	case r.MaxTokens != nil:
		out.MaxTokens = *r.MaxTokens
		if out.MaxTokens < 1 {
			return c, badParam("max_tokens", "must be at least 1")
		}
	}
	if r.ReasoningEffort != nil {
		budget, ok := reasoningBudgets[*r.ReasoningEffort]
		if !ok {
			return c, badParam("reasoning_effort", "must be one of none, minimal, low, medium, high, xhigh")
		}
		if budget > 0 {
			if r.MaxCompletionTokens == nil && r.MaxTokens == nil && modelMax == 0 {
				out.MaxTokens = budget + defaultMaxTokens // the answer's room, beside the thinking
			}
			// the budget counts in max_tokens and must stay below it
			budget = min(budget, out.MaxTokens-1)
			if budget < minThinkingBudget {
				return c, badParam("reasoning_effort", "needs max_completion_tokens above "+strconv.Itoa(minThinkingBudget)+" (Claude thinks in at least that many tokens)")
			}
			out.Thinking = &msgThinking{Type: "enabled", BudgetTokens: budget}
		}
	}
	if r.Stop.bad {
		return c, badParam("stop", "must be a string or an array of strings")
	}
	if r.Stop.seqs.array {
		out.StopSequences = out.spliced.add("stop_sequences", &r.Stop.seqs.out)
	}
	if t := r.Temperature; t != nil {
		if *t < 0 || *t > 1 {
			return c, badParam("temperature", "Claude takes a temperature from 0 to 1")
		}
		out.Temperature = t
	}
	out.TopP = r.TopP

	if err := translateTools(r, out); err != nil {
		return c, err
	}
	if f := r.ResponseFormat; f != nil {
		switch f.Type {
		case "text":
		case "json_schema":
			if f.JSONSchema == nil || len(f.JSONSchema.Schema) == 0 || f.JSONSchema.Schema.Kind() != '{' {
				return c, badParam("response_format.json_schema.schema", "required: a JSON schema object")
			}
			out.OutputConfig = &msgOutputConfig{Format: &msgFormat{Type: "json_schema", Schema: f.JSONSchema.Schema}}
		case "json_object":
			return c, badParam("response_format", "json_object has no Claude equivalent; use json_schema with a schema")
		default:
			return c, badParam("response_format.type", "must be text or json_schema")
		}
	}
	user := r.User
	if user == nil {
		user = r.SafetyIdentifier
	}
	if user != nil && *user != "" {
		out.Metadata = &msgMetadata{UserID: *user}
	}
	if r.Stream != nil && *r.Stream {
		out.Stream = true
		c.IncludeUsage = r.StreamOptions != nil && r.StreamOptions.IncludeUsage
	}
	return c, nil
}

// refuseUnsupported refuses the parameters Claude has no equivalent of,
// unless they are at the value that asks for nothing.
func (r *chatRequest) refuseUnsupported() *ParamError {
	switch {
	case r.N != nil && *r.N != 1:
		return badParam("n", "Claude answers one choice per request; send n requests instead")
	case r.FrequencyPenalty != nil && *r.FrequencyPenalty != 0:
		return badParam("frequency_penalty", "not supported by Claude")
	case r.PresencePenalty != nil && *r.PresencePenalty != 0:
		return badParam("presence_penalty", "not supported by Claude")
	case r.Logprobs != nil && *r.Logprobs:
		return badParam("logprobs", "not supported by Claude")
	case r.TopLogprobs != nil && *r.TopLogprobs != 0:
		return badParam("top_logprobs", "not supported by Claude")
	case r.LogitBias.n > 0:
		return badParam("logit_bias", "not supported by Claude")
	case r.Modalities.other:
		return badParam("modalities", "Claude answers in text only")
	}
	if p := r.TopP; p != nil && (math.IsNaN(*p) || *p < 0 || *p > 1) {
		return badParam("top_p", "must be from 0 to 1")
	}
	return nil
}

// chatStop is stop, a string or an array of strings, encoded as
// stop_sequences as it is decoded. Any other value is refused when the
// translation comes to it (bad).
type chatStop struct {
	seqs jsonStrings
	bad  bool
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (st *chatStop) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	switch dec.PeekKind() {
	case '"':
		if err := json.UnmarshalDecode(dec, &st.seqs.s); err != nil {
			return err
		}
		st.seqs.add()
		return nil
	case '[':
	default: // null is none; anything else is refused
		st.bad = dec.PeekKind() != 'n'
		return dec.SkipValue()
	}
	if _, err := dec.ReadToken(); err != nil {
		return err
	}
	st.seqs.array = true
	for dec.PeekKind() != ']' {
		if k := dec.PeekKind(); k != '"' && k != 'n' { // null: "", as it always was
			st.bad = true
			if err := dec.SkipValue(); err != nil {
				return err
			}
			continue
		}
		if err := st.seqs.decode(dec); err != nil {
			return err
		}
	}
	_, err := dec.ReadToken()
	return err
}

// chatModalities is modalities, of which Claude serves text only: each is
// checked as it is decoded.
type chatModalities struct {
	other bool // one is not text
	s     string
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (mo *chatModalities) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[string](dec); !ok {
		return err
	}
	for dec.PeekKind() != ']' {
		mo.s = ""
		if err := json.UnmarshalDecode(dec, &mo.s); err != nil {
			return err
		}
		mo.other = mo.other || mo.s != "text"
	}
	_, err := dec.ReadToken()
	return err
}

// chatLogitBias is logit_bias, which only an empty map passes: its
// entries are decoded (a value must be a number) and counted, never kept.
type chatLogitBias struct {
	n    int
	bias float64
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (b *chatLogitBias) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	switch dec.PeekKind() {
	case '{':
	case 'n':
		_, err := dec.ReadToken()
		return err
	default:
		var wrong map[string]float64
		return json.UnmarshalDecode(dec, &wrong) // the type error it always was
	}
	if _, err := dec.ReadToken(); err != nil {
		return err
	}
	for ; dec.PeekKind() != '}'; b.n++ {
		if _, err := dec.ReadToken(); err != nil { // the name
			return err
		}
		if err := json.UnmarshalDecode(dec, &b.bias); err != nil {
			return err
		}
	}
	_, err := dec.ReadToken()
	return err
}
