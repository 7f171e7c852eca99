package relay

import (
	"bytes"
	"cmp"
	"errors"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/rope"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// PathChatCompletions is OpenAI's Chat Completions route. The relay
// translates its requests into Messages requests up front, relays them as
// any other message (same selection, limits, failover, commit point and
// accounting), and translates the answer back as it is written
// (openai_answer.go).
const PathChatCompletions = "/v1/chat/completions"

// defaultChatMaxTokens is the max_tokens of a chat completion that sets no
// limit, for a model whose maximum output the pricing table does not know:
// Messages requires one, Chat Completions does not. A known model is asked
// for its maximum output, which is also what the request holds against its
// budgets.
const defaultChatMaxTokens = 8192

// reasoningBudgets are the thinking budgets (budget_tokens) reasoning_effort
// asks for; "none" asks for no thinking.
var reasoningBudgets = map[string]int64{
	"none":    0,
	"minimal": 1024,
	"low":     4096,
	"medium":  8192,
	"high":    16384,
	"xhigh":   24576,
}

// minThinkingBudget is the smallest budget_tokens Messages accepts.
const minThinkingBudget = 1024

// chat is what the relay keeps of a Chat Completions request for writing
// its answer in OpenAI's shape.
type chat struct {
	includeUsage bool   // stream_options.include_usage
	param        string // the parameter a refused request got wrong
}

// chatRequest is the part of a Chat Completions request the relay reads.
// A member it does not know is refused (Unknown), as OpenAI does, so that
// nothing a client asks for is silently dropped.
//
// The arrays a client can make as long as its body allows (messages, with
// their parts and tool calls; tools; stop; modalities; logit_bias) are
// translated or checked one element at a time as they are decoded, and
// never held as Go values: a translation costs a small multiple of the
// body's size, whatever the body holds (docs/security.md, promise 2).
type chatRequest struct {
	Model               string           `json:"model"`
	Messages            chatConversation `json:"messages"`
	MaxTokens           *int64           `json:"max_tokens"`
	MaxCompletionTokens *int64           `json:"max_completion_tokens"`
	Stop                chatStop         `json:"stop"`
	Temperature         *float64         `json:"temperature"`
	TopP                *float64         `json:"top_p"`
	Stream              *bool            `json:"stream"`
	StreamOptions       *chatStreamOpts  `json:"stream_options"`
	Tools               chatTools        `json:"tools"`
	ToolChoice          jsontext.Value   `json:"tool_choice"`
	ParallelToolCalls   *bool            `json:"parallel_tool_calls"`
	ResponseFormat      *chatFormat      `json:"response_format"`
	ReasoningEffort     *string          `json:"reasoning_effort"`
	User                *string          `json:"user"`
	SafetyIdentifier    *string          `json:"safety_identifier"`

	// accepted only at the value that asks for nothing
	N                *int64         `json:"n"`
	FrequencyPenalty *float64       `json:"frequency_penalty"`
	PresencePenalty  *float64       `json:"presence_penalty"`
	Logprobs         *bool          `json:"logprobs"`
	TopLogprobs      *int64         `json:"top_logprobs"`
	LogitBias        chatLogitBias  `json:"logit_bias"`
	Modalities       chatModalities `json:"modalities"`

	// accepted and not carried: they change nothing in the answer
	Store                jsontext.Value `json:"store"`
	Metadata             jsontext.Value `json:"metadata"`
	ServiceTier          jsontext.Value `json:"service_tier"`
	Seed                 jsontext.Value `json:"seed"`
	PromptCacheKey       jsontext.Value `json:"prompt_cache_key"`
	PromptCacheRetention jsontext.Value `json:"prompt_cache_retention"`

	Unknown jsontext.Value `json:",embed"`
}

type chatStreamOpts struct {
	IncludeUsage       bool           `json:"include_usage"`
	IncludeObfuscation jsontext.Value `json:"include_obfuscation"`
}

// chatMessage is one message of a conversation, as chatConversation decodes
// it.
type chatMessage struct {
	Role       string         `json:"role"`
	Content    chatContent    `json:"content"`
	Name       string         `json:"name"`
	ToolCalls  chatToolCalls  `json:"tool_calls"`
	ToolCallID string         `json:"tool_call_id"`
	Refusal    *string        `json:"refusal"`
	Unknown    jsontext.Value `json:",embed"`
}

type chatPart struct {
	Type     string         `json:"type"`
	Text     string         `json:"text"`
	Refusal  string         `json:"refusal"`
	ImageURL *chatImageURL  `json:"image_url"`
	Unknown  jsontext.Value `json:",embed"`
}

type chatImageURL struct {
	URL    string `json:"url"`
	Detail string `json:"detail"`
}

type chatToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type chatTool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string         `json:"name"`
		Description string         `json:"description"`
		Parameters  jsontext.Value `json:"parameters"`
		Strict      *bool          `json:"strict"`
	} `json:"function"`
}

type chatFormat struct {
	Type       string `json:"type"`
	JSONSchema *struct {
		Name        string         `json:"name"`
		Description string         `json:"description"`
		Schema      jsontext.Value `json:"schema"`
		Strict      *bool          `json:"strict"`
	} `json:"json_schema"`
}

// msgRequest is the Messages request a chat completion becomes. Its
// arrays were encoded as their elements were translated (system: text
// blocks; messages: turns, {"role","content"} with msgBlocks;
// stop_sequences: strings; tools: msgTools); here they hold placeholders,
// and come before any member that holds a client's object (writeSpliced).
type msgRequest struct {
	Model         string           `json:"model"`
	MaxTokens     int64            `json:"max_tokens"`
	System        jsontext.Value   `json:"system,omitzero"`
	Messages      jsontext.Value   `json:"messages"`
	StopSequences jsontext.Value   `json:"stop_sequences,omitzero"`
	Temperature   *float64         `json:"temperature,omitzero"`
	TopP          *float64         `json:"top_p,omitzero"`
	Tools         jsontext.Value   `json:"tools,omitzero"`
	ToolChoice    *msgToolChoice   `json:"tool_choice,omitzero"`
	Thinking      *msgThinking     `json:"thinking,omitzero"`
	OutputConfig  *msgOutputConfig `json:"output_config,omitzero"`
	Metadata      *msgMetadata     `json:"metadata,omitzero"`
	Stream        bool             `json:"stream,omitzero"`

	spliced spliced
}

// msgBlock is a content block of any type: the fields of its type are set.
// (A text block is never empty: Messages refuses those.)
type msgBlock struct {
	Type      string         `json:"type"`
	Text      string         `json:"text,omitzero"`
	Source    *msgSource     `json:"source,omitzero"`
	ID        string         `json:"id,omitzero"`
	Name      string         `json:"name,omitzero"`
	Input     jsontext.Value `json:"input,omitzero"`
	ToolUseID string         `json:"tool_use_id,omitzero"`
	Content   []msgBlock     `json:"content,omitzero"`
}

type msgSource struct {
	Type      string `json:"type"`
	MediaType string `json:"media_type,omitzero"`
	Data      string `json:"data,omitzero"`
	URL       string `json:"url,omitzero"`
}

type msgTool struct {
	Name        string         `json:"name"`
	Description string         `json:"description,omitzero"`
	InputSchema jsontext.Value `json:"input_schema"`
	Strict      *bool          `json:"strict,omitzero"`
}

type msgToolChoice struct {
	Type                   string `json:"type"`
	Name                   string `json:"name,omitzero"`
	DisableParallelToolUse bool   `json:"disable_parallel_tool_use,omitzero"`
}

type msgThinking struct {
	Type         string `json:"type"`
	BudgetTokens int64  `json:"budget_tokens,omitzero"`
}

type msgOutputConfig struct {
	Format *msgFormat `json:"format,omitzero"`
}

type msgFormat struct {
	Type   string         `json:"type"`
	Schema jsontext.Value `json:"schema"`
}

type msgMetadata struct {
	UserID string `json:"user_id"`
}

// emptySchema is the input schema of a function tool without parameters.
var emptySchema = jsontext.Value(`{"type":"object","properties":{}}`)

// chatError is a Chat Completions request the relay refuses: a 400 naming
// the parameter, in OpenAI's terms.
type chatError struct {
	param, msg string
}

func (e *chatError) Error() string { return e.msg }

func badParam(param, msg string) *chatError { return &chatError{param: param, msg: param + ": " + msg} }

// translateChat writes to dst the Messages body that is relayed in place
// of a Chat Completions body. Every parameter is either carried over,
// accepted at a value that asks for nothing, or refused with a 400 naming
// it. A body with several problems is refused for the first of them in
// this order: a value of the wrong type (in the order of the body), then
// the parameters in the order toMessages reads them.
func translateChat(dst *bytes.Buffer, body []byte) (chat, *chatError) {
	var req chatRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return chat{}, chatJSONError(err)
	}
	var out msgRequest
	c, cerr := req.toMessages(&out)
	if cerr != nil {
		return chat{}, cerr
	}
	if err := writeSpliced(dst, &out, out.spliced); err != nil {
		return chat{}, errTranslation(err)
	}
	return c, nil
}

// errTranslation is a request whose translation could not be encoded.
func errTranslation(err error) *chatError {
	return &chatError{msg: "could not translate the request: " + err.Error()}
}

// translateChat replaces the request's Chat Completions body by its
// Messages translation, in a pooled buffer of its own.
func (in *inbound) translateChat() *relayError {
	buf := bodyPool.Get().(*bytes.Buffer)
	c, cerr := translateChat(buf, in.body)
	if cerr != nil {
		releaseBody(buf)
		in.chat.param = cerr.param
		return errInvalid(cerr.msg)
	}
	c.param = ""
	*in.chat = c
	in.releaseBody()
	in.bodyBuf, in.body = buf, buf.Bytes()
	return nil
}

// chatJSONError says where a body that does not decode went wrong, without
// echoing it.
func chatJSONError(err error) *chatError {
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
			return &chatError{msg: "request body is not valid JSON: duplicate key at " + strconv.Quote(string(sx.JSONPointer)[:min(len(sx.JSONPointer), 128)])}
		}
		return &chatError{msg: "request body is not valid JSON: error at byte offset " + strconv.FormatInt(sx.ByteOffset, 10)}
	}
	return &chatError{msg: "request body is not valid JSON"}
}

func kindName(k jsontext.Kind) string {
	switch k {
	case '"':
		return "string"
	case '0':
		return "number"
	case 't', 'f':
		return "boolean"
	case 'n':
		return "null"
	case '{':
		return "object"
	case '[':
		return "array"
	}
	return "value"
}

// unknownParam names the first member of an object's unknown members.
func unknownParam(v jsontext.Value) string {
	dec := jsontext.NewDecoder(bytes.NewReader(v))
	if _, err := dec.ReadToken(); err != nil {
		return ""
	}
	tok, err := dec.ReadToken()
	if err != nil || tok.Kind() != '"' {
		return ""
	}
	name := tok.String()
	return name[:min(len(name), 64)]
}

// toMessages fills out with the Messages request of r.
func (r *chatRequest) toMessages(out *msgRequest) (chat, *chatError) {
	var c chat
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
	modelMax := maxOutputTokens(r.Model)
	out.MaxTokens = cmp.Or(modelMax, defaultChatMaxTokens)
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
				out.MaxTokens = budget + defaultChatMaxTokens // the answer's room, beside the thinking
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
		c.includeUsage = r.StreamOptions != nil && r.StreamOptions.IncludeUsage
	}
	return c, nil
}

// refuseUnsupported refuses the parameters Claude has no equivalent of,
// unless they are at the value that asks for nothing.
func (r *chatRequest) refuseUnsupported() *chatError {
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

// chatConversation is a request's messages. Each is translated as soon as
// it is decoded, into Messages' system prompt and turns (w), so no
// conversation is ever held as Go values: however many messages a body
// holds, one is. System and developer messages, wherever they are, make
// the system prompt in order; tool messages become tool_result blocks of
// a user turn; consecutive turns of one role are merged.
//
// The first message the translation refuses is kept (err) and the ones
// after it only decoded: a value of the wrong type further on is still
// the request's first problem, as it always was.
type chatConversation struct {
	n     int        // messages decoded
	err   *chatError // the first one refused
	w     turnWriter
	m     chatMessage      // the message being decoded
	parts bytes.Buffer     // m's content, when it is parts, as JSON
	calls rope.Rope        // the tool_use blocks of m's calls
	dec   jsontext.Decoder // reads the parts of m
	part  chatPart
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (cv *chatConversation) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[chatMessage](dec); !ok {
		return err
	}
	for ; dec.PeekKind() != ']'; cv.n++ {
		cv.parts.Reset()
		cv.calls.Reset()
		cv.m = chatMessage{Content: chatContent{parts: &cv.parts}, ToolCalls: chatToolCalls{out: &cv.calls}}
		if err := json.UnmarshalDecode(dec, &cv.m); err != nil {
			return err
		}
		if cv.err == nil {
			cv.err = cv.translate(cv.n)
		}
	}
	_, err := dec.ReadToken()
	return err
}

// msgAt names message i in a refusal, as OpenAI does.
func msgAt(i int) string { return "messages[" + strconv.Itoa(i) + "]" }

// translate adds message i, just decoded, to the conversation. A message
// that translates to no block (an empty text) adds nothing: Messages
// refuses an empty turn.
func (cv *chatConversation) translate(i int) *chatError {
	m, w := &cv.m, &cv.w
	if len(m.Unknown) > 0 {
		return badParam(msgAt(i)+"."+unknownParam(m.Unknown), "not supported")
	}
	c := &m.Content
	switch c.kind {
	case 0, 'n', '"', '[':
	default:
		return badParam(msgAt(i)+".content", "must be a string or an array of content parts")
	}
	// the message's first refusal; the types of its parts come first
	var err *chatError
	switch m.Role {
	case "system", "developer", "user", "assistant":
	case "tool":
		if m.ToolCallID == "" {
			err = badParam(msgAt(i)+".tool_call_id", "required")
		} else {
			w.beginResult(m.ToolCallID, c.kind == '[')
		}
	case "function":
		err = badParam(msgAt(i)+".role", "function messages are deprecated; use tool messages")
	default:
		err = badParam(msgAt(i)+".role", "must be system, developer, user, assistant or tool")
	}
	if c.kind == '"' && c.text != "" && err == nil {
		cv.text(c.text)
	}
	if c.kind == '[' {
		cv.dec.Reset(c.parts)
		if _, rerr := cv.dec.ReadToken(); rerr != nil {
			return partsError(i, rerr)
		}
		for j := 0; cv.dec.PeekKind() != ']'; j++ {
			cv.part = chatPart{}
			if derr := json.UnmarshalDecode(&cv.dec, &cv.part); derr != nil {
				return partsError(i, derr)
			}
			if err == nil {
				err = cv.addPart(i, j)
			}
		}
	}
	if err != nil {
		return err
	}
	switch m.Role {
	case "tool":
		w.endResult()
	case "assistant":
		if r := m.Refusal; r != nil && *r != "" && c.kind != '[' && c.text == "" {
			cv.text(*r)
		}
		if e := m.ToolCalls.err; e != nil {
			return &chatError{param: msgAt(i) + "." + e.param, msg: msgAt(i) + "." + e.msg}
		}
		if m.ToolCalls.n > 0 {
			_, _ = cv.calls.WriteTo(w.next("assistant"))
		}
	}
	return nil
}

// partsError is the refusal of message i whose parts did not decode.
func partsError(i int, err error) *chatError {
	if ce := chatJSONError(err); ce.param != "" {
		return badParam(msgAt(i)+".content."+ce.param, strings.TrimPrefix(ce.msg, ce.param+": "))
	}
	return badParam(msgAt(i)+".content", "must be a string or an array of content parts")
}

// text adds a text block of the message's role.
func (cv *chatConversation) text(s string) {
	switch role := cv.m.Role; role {
	case "tool":
		cv.w.resultText(s)
	case "developer":
		cv.w.text("system", s)
	default:
		cv.w.text(role, s)
	}
}

// addPart adds part j of message i: system, developer and tool messages
// take text parts, user messages text and images, assistant messages text
// and refusals.
func (cv *chatConversation) addPart(i, j int) *chatError {
	p, role := &cv.part, cv.m.Role
	at := func() string { return msgAt(i) + ".content[" + strconv.Itoa(j) + "]" }
	switch role {
	case "system", "developer", "tool":
		if p.Type != "text" || len(p.Unknown) > 0 {
			return badParam(at(), "a "+role+" message takes text parts only")
		}
	case "user":
		if len(p.Unknown) > 0 {
			return badParam(at()+"."+unknownParam(p.Unknown), "not supported")
		}
		switch p.Type {
		case "text":
		case "image_url":
			if p.ImageURL == nil {
				return badParam(at()+".image_url", "required")
			}
			src, err := imageSource(p.ImageURL.URL)
			if err != nil {
				return badParam(at()+".image_url.url", err.Error())
			}
			if err := cv.w.image(src); err != nil {
				return errTranslation(err)
			}
			return nil
		default:
			return badParam(at()+".type", strconv.Quote(p.Type)+" parts are not supported; text and image_url are")
		}
	case "assistant":
		switch p.Type {
		case "text":
		case "refusal":
			if p.Refusal != "" {
				cv.text(p.Refusal)
			}
			return nil
		default:
			return badParam(at()+".type", "an assistant message takes text and refusal parts")
		}
	}
	if p.Text != "" {
		cv.text(p.Text)
	}
	return nil
}

// chatContent is a message's content as decoded: a string, or an array of
// parts kept as JSON until the message's role, which may come after it,
// says how to read them.
type chatContent struct {
	kind  jsontext.Kind // of its JSON value; 0 when absent
	text  string
	parts *bytes.Buffer // the array (chatConversation's)
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (c *chatContent) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	c.kind = dec.PeekKind()
	if c.kind == '"' {
		return json.UnmarshalDecode(dec, &c.text)
	}
	v, err := dec.ReadValue()
	if err == nil && c.kind == '[' {
		c.parts.Write(v)
	}
	return err
}

// chatToolCalls is a message's tool_calls, each checked and encoded as a
// tool_use block as it is decoded. They count in an assistant message
// only, after its content, so the first one refused waits (err, naming
// the call within the message) for the message's role and content, which
// may come after them.
type chatToolCalls struct {
	out   *rope.Rope // the tool_use blocks, comma-separated (chatConversation's)
	n     int
	err   *chatError
	call  chatToolCall // the one being decoded
	block msgBlock
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (t *chatToolCalls) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[chatToolCall](dec); !ok {
		return err
	}
	for ; dec.PeekKind() != ']'; t.n++ {
		t.call = chatToolCall{}
		if err := json.UnmarshalDecode(dec, &t.call); err != nil {
			return err
		}
		if t.err == nil {
			t.err = t.add(t.n)
		}
	}
	_, err := dec.ReadToken()
	return err
}

// add encodes call j as a tool_use block.
func (t *chatToolCalls) add(j int) *chatError {
	tc := &t.call
	at := func() string { return "tool_calls[" + strconv.Itoa(j) + "]" }
	if tc.Type != "function" {
		return badParam(at()+".type", "must be function")
	}
	if tc.ID == "" || tc.Function.Name == "" {
		return badParam(at(), "needs an id and a function name")
	}
	args := jsontext.Value(strings.TrimSpace(tc.Function.Arguments))
	if len(args) == 0 {
		args = jsontext.Value("{}")
	}
	if !args.IsValid() || args.Kind() != '{' {
		return badParam(at()+".function.arguments", "must be a JSON object")
	}
	t.block = msgBlock{Type: "tool_use", ID: tc.ID, Name: tc.Function.Name, Input: args}
	sep(t.out)
	if err := json.MarshalWrite(t.out, &t.block); err != nil {
		return errTranslation(err)
	}
	return nil
}

// turnWriter writes a Messages conversation as the messages of a chat
// arrive: the system prompt's text blocks, and the turns. A block is
// encoded as soon as it is translated; consecutive blocks of one role
// share a turn.
type turnWriter struct {
	system  rope.Rope // text blocks, comma-separated
	turns   rope.Rope // turns, comma-separated; the last one open
	role    string    // the open turn's; "" before the first turn
	content rope.Mark // where the open turn's content starts
	results bool      // the open turn starts with a tool_result block
	held    []byte    // its content, while a tool_result is put before it
	move    bool      // the tool_result being written goes before it
	listed  bool      // it has its content list open
	texts   int       // text blocks in it so far
	block   msgBlock
	source  msgSource
	buf     []byte // a block being encoded
}

// next readies for one more block of role ("system" for the system
// prompt): a turn of another role is closed and one of role opened.
func (w *turnWriter) next(role string) *rope.Rope {
	switch {
	case role == "system":
		sep(&w.system)
		return &w.system
	case role == w.role:
		_ = w.turns.WriteByte(',')
		return &w.turns
	case w.role != "":
		w.turns.WriteString(`]},`)
	}
	w.turns.WriteString(`{"role":"`)
	w.turns.WriteString(role)
	w.turns.WriteString(`","content":[`)
	w.role, w.content, w.results = role, w.turns.Mark(), false
	return &w.turns
}

// text adds a text block to role's turn, or to the system prompt.
func (w *turnWriter) text(role, s string) {
	r := w.next(role)
	w.buf = appendText(w.buf[:0], s)
	_, _ = r.Write(w.buf)
}

// appendText appends the text block of s: what encoding msgBlock{Type:
// "text", Text: s} gives, written directly (text is most of what a
// conversation holds).
func appendText(b []byte, s string) []byte {
	b = append(b, `{"type":"text","text":`...)
	b, _ = jsontext.AppendQuote(b, s) // valid UTF-8: it was decoded
	return append(b, '}')
}

// image adds an image block to the user turn.
func (w *turnWriter) image(src msgSource) error {
	w.source = src
	w.block = msgBlock{Type: "image", Source: &w.source}
	return json.MarshalWrite(w.next("user"), &w.block)
}

// beginResult opens the tool_result block of a tool message, for the call
// id, in the user turn; resultText adds its text, endResult closes it. Its
// content is listed when there is text, or when the message had parts
// (even none). Tool results open their turn, as Messages wants: the
// content of a turn that a tool result follows is held aside while the
// result is written, and put back after it.
func (w *turnWriter) beginResult(id string, parts bool) {
	w.move = w.role == "user" && !w.results
	if w.move {
		w.held = w.turns.Cut(w.content, w.held[:0])
	} else {
		w.next("user")
	}
	w.results = true
	w.turns.WriteString(`{"type":"tool_result","tool_use_id":`)
	w.buf, _ = jsontext.AppendQuote(w.buf[:0], id) // valid UTF-8: it was decoded
	_, _ = w.turns.Write(w.buf)
	w.listed, w.texts = false, 0
	if parts {
		w.list()
	}
}

// list opens the tool_result's content list.
func (w *turnWriter) list() {
	if !w.listed {
		w.turns.WriteString(`,"content":[`)
		w.listed = true
	}
}

func (w *turnWriter) resultText(s string) {
	w.list()
	if w.texts > 0 {
		_ = w.turns.WriteByte(',')
	}
	w.texts++
	w.buf = appendText(w.buf[:0], s)
	_, _ = w.turns.Write(w.buf)
}

func (w *turnWriter) endResult() {
	if w.listed {
		_ = w.turns.WriteByte(']')
	}
	_ = w.turns.WriteByte('}')
	if w.move {
		_ = w.turns.WriteByte(',')
		_, _ = w.turns.Write(w.held)
	}
}

// close ends the conversation, and reports whether it has a turn.
func (w *turnWriter) close() bool {
	if w.role == "" {
		return false
	}
	w.turns.WriteString("]}")
	return true
}

// imageSource is the Messages image source of an image_url: a data URL
// becomes base64 data, an http(s) URL a url source.
func imageSource(u string) (msgSource, error) {
	if rest, ok := strings.CutPrefix(u, "data:"); ok {
		meta, data, ok := strings.Cut(rest, ",")
		mediaType, isBase64 := strings.CutSuffix(meta, ";base64")
		if !ok || !isBase64 || !strings.HasPrefix(mediaType, "image/") {
			return msgSource{}, errors.New("a data URL must be data:image/<type>;base64,<data>")
		}
		return msgSource{Type: "base64", MediaType: mediaType, Data: data}, nil
	}
	if strings.HasPrefix(u, "https://") || strings.HasPrefix(u, "http://") {
		return msgSource{Type: "url", URL: u}, nil
	}
	return msgSource{}, errors.New("must be an https URL or a base64 data URL")
}

// chatTools is a request's tools, each checked and encoded as a Messages
// tool as it is decoded; the first one refused waits (err) for its turn
// among the parameters.
type chatTools struct {
	n    int
	err  *chatError
	out  rope.Rope // the tools, comma-separated
	tool chatTool  // the one being decoded
	msg  msgTool
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (t *chatTools) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[chatTool](dec); !ok {
		return err
	}
	for ; dec.PeekKind() != ']'; t.n++ {
		t.tool = chatTool{}
		if err := json.UnmarshalDecode(dec, &t.tool); err != nil {
			return err
		}
		if t.err == nil {
			t.err = t.add(t.n)
		}
	}
	_, err := dec.ReadToken()
	return err
}

// add encodes tool i.
func (t *chatTools) add(i int) *chatError {
	f := &t.tool.Function
	at := func() string { return "tools[" + strconv.Itoa(i) + "]" }
	if t.tool.Type != "function" {
		return badParam(at()+".type", "only function tools are supported")
	}
	if f.Name == "" {
		return badParam(at()+".function.name", "required")
	}
	schema := f.Parameters
	if len(schema) == 0 || schema.Kind() == 'n' {
		schema = emptySchema
	} else if schema.Kind() != '{' {
		return badParam(at()+".function.parameters", "must be a JSON schema object")
	}
	t.msg = msgTool{Name: f.Name, Description: f.Description, InputSchema: schema, Strict: f.Strict}
	sep(&t.out)
	if err := json.MarshalWrite(&t.out, &t.msg); err != nil {
		return errTranslation(err)
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

// jsonStrings is an array of strings (stop sequences), encoded again one
// at a time as it is decoded.
type jsonStrings struct {
	out   rope.Rope // the strings, comma-separated
	s     string    // the one being decoded
	buf   []byte
	array bool // an array was decoded, if an empty one
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom: an array of strings,
// or null for none.
func (js *jsonStrings) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[string](dec); !ok {
		return err
	}
	js.array = true
	for dec.PeekKind() != ']' {
		if err := js.decode(dec); err != nil {
			return err
		}
	}
	_, err := dec.ReadToken()
	return err
}

// decode adds the string dec holds next (null is "").
func (js *jsonStrings) decode(dec *jsontext.Decoder) error {
	js.s = ""
	if err := json.UnmarshalDecode(dec, &js.s); err != nil {
		return err
	}
	js.add()
	return nil
}

func (js *jsonStrings) add() {
	js.array = true
	sep(&js.out)
	js.buf, _ = jsontext.AppendQuote(js.buf[:0], js.s) // valid UTF-8: it was decoded
	_, _ = js.out.Write(js.buf)
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

// sep writes what goes before one more element of the comma-separated
// list r holds.
func sep(r *rope.Rope) {
	if r.Len() > 0 {
		_ = r.WriteByte(',')
	}
}

// placeholder marks the place of an array in a request whose arrays are
// held in ropes, for writeSpliced.
var placeholder = jsontext.Value("[]")

// spliced lists the array members of a request that hold placeholders:
// their names, and their elements (comma-separated) in ropes.
type spliced []splicedArray

type splicedArray struct {
	name  string
	elems *rope.Rope
}

// add lists the array name, of elems, and returns its placeholder.
func (s *spliced) add(name string, elems *rope.Rope) jsontext.Value {
	*s = append(*s, splicedArray{name, elems})
	return placeholder
}

// writeSpliced writes req as JSON to dst, with the elements of each array
// of arrays in place of its placeholder. An array member's name occurs
// first, unescaped, where the member is: what comes before it are
// scalars, strings and placeholders. dst grows once, to the size it ends
// up with.
func writeSpliced(dst *bytes.Buffer, req any, arrays spliced) error {
	frame, err := json.Marshal(req)
	if err != nil {
		return err
	}
	type cut struct {
		at    int // just after the placeholder's '['
		elems *rope.Rope
	}
	cuts := make([]cut, 0, len(arrays))
	n := len(frame)
	for _, a := range arrays {
		i := bytes.Index(frame, []byte(`"`+a.name+`":[]`))
		if i < 0 {
			return errors.New("no placeholder for " + a.name)
		}
		cuts = append(cuts, cut{i + len(a.name) + len(`"":[`), a.elems})
		n += a.elems.Len()
	}
	slices.SortFunc(cuts, func(a, b cut) int { return a.at - b.at })
	dst.Grow(n)
	prev := 0
	for _, c := range cuts {
		dst.Write(frame[prev:c.at])
		_, _ = c.elems.WriteTo(dst)
		prev = c.at
	}
	dst.Write(frame[prev:])
	return nil
}

// openArray reads the '[' that opens an array of T, and reports whether it
// did: null is read as no array, and any other value fails with the error
// unmarshaling it into []T gives.
func openArray[T any](dec *jsontext.Decoder) (bool, error) {
	switch dec.PeekKind() {
	case '[':
		_, err := dec.ReadToken()
		return err == nil, err
	case 'n':
		_, err := dec.ReadToken()
		return false, err
	}
	var wrong []T
	return false, json.UnmarshalDecode(dec, &wrong)
}

// translateTools carries tools, tool_choice and parallel_tool_calls over.
func translateTools(r *chatRequest, out *msgRequest) *chatError {
	if r.Tools.err != nil {
		return r.Tools.err
	}
	if r.Tools.n > 0 {
		out.Tools = out.spliced.add("tools", &r.Tools.out)
	}
	if len(r.ToolChoice) > 0 && r.ToolChoice.Kind() != 'n' {
		var tc msgToolChoice
		if r.ToolChoice.Kind() == '"' {
			var s string
			_ = json.Unmarshal(r.ToolChoice, &s)
			switch s {
			case "none":
				tc.Type = "none"
			case "auto":
				tc.Type = "auto"
			case "required":
				tc.Type = "any"
			default:
				return badParam("tool_choice", "must be none, auto, required or a function")
			}
		} else {
			var named struct {
				Type     string `json:"type"`
				Function struct {
					Name string `json:"name"`
				} `json:"function"`
			}
			if err := json.Unmarshal(r.ToolChoice, &named); err != nil || named.Type != "function" || named.Function.Name == "" {
				return badParam("tool_choice", "must be none, auto, required or {\"type\":\"function\",\"function\":{\"name\":...}}")
			}
			tc.Type, tc.Name = "tool", named.Function.Name
		}
		out.ToolChoice = &tc
	}
	if p := r.ParallelToolCalls; p != nil && !*p && r.Tools.n > 0 {
		if out.ToolChoice == nil {
			out.ToolChoice = &msgToolChoice{Type: "auto"}
		}
		if out.ToolChoice.Type != "none" {
			out.ToolChoice.DisableParallelToolUse = true
		}
	}
	return nil
}
