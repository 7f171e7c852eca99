package relay

import (
	"bytes"
	"errors"
	"math"
	"strconv"
	"strings"

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
// limit: Messages requires one, Chat Completions does not.
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
type chatRequest struct {
	Model               string          `json:"model"`
	Messages            []chatMessage   `json:"messages"`
	MaxTokens           *int64          `json:"max_tokens"`
	MaxCompletionTokens *int64          `json:"max_completion_tokens"`
	Stop                jsontext.Value  `json:"stop"`
	Temperature         *float64        `json:"temperature"`
	TopP                *float64        `json:"top_p"`
	Stream              *bool           `json:"stream"`
	StreamOptions       *chatStreamOpts `json:"stream_options"`
	Tools               []chatTool      `json:"tools"`
	ToolChoice          jsontext.Value  `json:"tool_choice"`
	ParallelToolCalls   *bool           `json:"parallel_tool_calls"`
	ResponseFormat      *chatFormat     `json:"response_format"`
	ReasoningEffort     *string         `json:"reasoning_effort"`
	User                *string         `json:"user"`
	SafetyIdentifier    *string         `json:"safety_identifier"`

	// accepted only at the value that asks for nothing
	N                *int64             `json:"n"`
	FrequencyPenalty *float64           `json:"frequency_penalty"`
	PresencePenalty  *float64           `json:"presence_penalty"`
	Logprobs         *bool              `json:"logprobs"`
	TopLogprobs      *int64             `json:"top_logprobs"`
	LogitBias        map[string]float64 `json:"logit_bias"`
	Modalities       []string           `json:"modalities"`

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

type chatMessage struct {
	Role       string         `json:"role"`
	Content    jsontext.Value `json:"content"` // a string, an array of parts, or null
	Name       string         `json:"name"`
	ToolCalls  []chatToolCall `json:"tool_calls"`
	ToolCallID string         `json:"tool_call_id"`
	Refusal    *string        `json:"refusal"`
	Unknown    jsontext.Value `json:",embed"`
	parts      []chatPart     // Content, when it is an array
	text       string         // Content, when it is a string
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

// msgRequest is the Messages request a chat completion becomes.
type msgRequest struct {
	Model         string           `json:"model"`
	MaxTokens     int64            `json:"max_tokens"`
	System        []msgBlock       `json:"system,omitzero"`
	Messages      []msgMessage     `json:"messages"`
	StopSequences []string         `json:"stop_sequences,omitzero"`
	Temperature   *float64         `json:"temperature,omitzero"`
	TopP          *float64         `json:"top_p,omitzero"`
	Tools         []msgTool        `json:"tools,omitzero"`
	ToolChoice    *msgToolChoice   `json:"tool_choice,omitzero"`
	Thinking      *msgThinking     `json:"thinking,omitzero"`
	OutputConfig  *msgOutputConfig `json:"output_config,omitzero"`
	Metadata      *msgMetadata     `json:"metadata,omitzero"`
	Stream        bool             `json:"stream,omitzero"`
}

type msgMessage struct {
	Role    string     `json:"role"`
	Content []msgBlock `json:"content"`
}

// msgBlock is a content block of any type: the fields of its type are set.
type msgBlock struct {
	Type      string         `json:"type"`
	Text      *string        `json:"text,omitzero"`
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
// it.
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
	if err := json.MarshalWrite(dst, &out); err != nil {
		return chat{}, &chatError{msg: "could not translate the request: " + err.Error()}
	}
	return c, nil
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
	if len(r.Messages) == 0 {
		return c, badParam("messages", "must hold at least one message")
	}
	if err := translateMessages(r.Messages, out); err != nil {
		return c, err
	}

	// limits
	out.MaxTokens = defaultChatMaxTokens
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
			if r.MaxCompletionTokens == nil && r.MaxTokens == nil {
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
	if len(r.Stop) > 0 && r.Stop.Kind() != 'n' {
		if r.Stop.Kind() == '"' {
			var s string
			_ = json.Unmarshal(r.Stop, &s)
			out.StopSequences = []string{s}
		} else if err := json.Unmarshal(r.Stop, &out.StopSequences); err != nil {
			return c, badParam("stop", "must be a string or an array of strings")
		}
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
	case len(r.LogitBias) > 0:
		return badParam("logit_bias", "not supported by Claude")
	}
	for _, m := range r.Modalities {
		if m != "text" {
			return badParam("modalities", "Claude answers in text only")
		}
	}
	if p := r.TopP; p != nil && (math.IsNaN(*p) || *p < 0 || *p > 1) {
		return badParam("top_p", "must be from 0 to 1")
	}
	return nil
}

// translateMessages turns the conversation into Messages' system prompt
// and turns. System and developer messages, wherever they are, make the
// system prompt in order; tool messages become tool_result blocks of a
// user turn; consecutive turns of one role are merged.
func translateMessages(msgs []chatMessage, out *msgRequest) *chatError {
	out.Messages = make([]msgMessage, 0, len(msgs))
	for i := range msgs {
		m := &msgs[i]
		at := "messages[" + strconv.Itoa(i) + "]"
		if len(m.Unknown) > 0 {
			return badParam(at+"."+unknownParam(m.Unknown), "not supported")
		}
		if err := m.decodeContent(at); err != nil {
			return err
		}
		var role string
		var blocks []msgBlock
		switch m.Role {
		case "system", "developer":
			b, err := m.textBlocks(at)
			if err != nil {
				return err
			}
			out.System = append(out.System, b...)
			continue
		case "user":
			role = "user"
			b, err := m.userBlocks(at)
			if err != nil {
				return err
			}
			blocks = b
		case "assistant":
			role = "assistant"
			b, err := m.assistantBlocks(at)
			if err != nil {
				return err
			}
			blocks = b
		case "tool":
			role = "user"
			if m.ToolCallID == "" {
				return badParam(at+".tool_call_id", "required")
			}
			b, err := m.textBlocks(at)
			if err != nil {
				return err
			}
			blocks = []msgBlock{{Type: "tool_result", ToolUseID: m.ToolCallID, Content: b}}
		case "function":
			return badParam(at+".role", "function messages are deprecated; use tool messages")
		default:
			return badParam(at+".role", "must be system, developer, user, assistant or tool")
		}
		if len(blocks) == 0 {
			continue // an empty turn says nothing; Messages refuses it
		}
		if n := len(out.Messages); n > 0 && out.Messages[n-1].Role == role {
			last := &out.Messages[n-1]
			if role == "user" && blocks[0].Type == "tool_result" && last.Content[0].Type != "tool_result" {
				// tool results open their turn, as Messages wants
				last.Content = append(blocks, last.Content...)
			} else {
				last.Content = append(last.Content, blocks...)
			}
			continue
		}
		out.Messages = append(out.Messages, msgMessage{Role: role, Content: blocks})
	}
	if len(out.Messages) == 0 {
		return badParam("messages", "must hold a user message, not only system messages")
	}
	return nil
}

// decodeContent reads a message's content: a string, an array of parts,
// or null.
func (m *chatMessage) decodeContent(at string) *chatError {
	switch m.Content.Kind() {
	case 0, 'n':
	case '"':
		_ = json.Unmarshal(m.Content, &m.text)
	case '[':
		if err := json.Unmarshal(m.Content, &m.parts); err != nil {
			if ce := chatJSONError(err); ce.param != "" {
				return badParam(at+".content."+ce.param, strings.TrimPrefix(ce.msg, ce.param+": "))
			}
			return badParam(at+".content", "must be a string or an array of content parts")
		}
	default:
		return badParam(at+".content", "must be a string or an array of content parts")
	}
	return nil
}

func textBlock(s string) msgBlock { return msgBlock{Type: "text", Text: &s} }

// textBlocks is a content of text only (system, developer and tool
// messages).
func (m *chatMessage) textBlocks(at string) ([]msgBlock, *chatError) {
	if m.parts == nil {
		if m.text == "" {
			return nil, nil
		}
		return []msgBlock{textBlock(m.text)}, nil
	}
	out := make([]msgBlock, 0, len(m.parts))
	for j, p := range m.parts {
		if p.Type != "text" || len(p.Unknown) > 0 {
			return nil, badParam(at+".content["+strconv.Itoa(j)+"]", "a "+m.Role+" message takes text parts only")
		}
		if p.Text != "" {
			out = append(out, textBlock(p.Text))
		}
	}
	return out, nil
}

// userBlocks is a user message's content: text and images.
func (m *chatMessage) userBlocks(at string) ([]msgBlock, *chatError) {
	if m.parts == nil {
		if m.text == "" {
			return nil, nil
		}
		return []msgBlock{textBlock(m.text)}, nil
	}
	out := make([]msgBlock, 0, len(m.parts))
	for j, p := range m.parts {
		pat := at + ".content[" + strconv.Itoa(j) + "]"
		if len(p.Unknown) > 0 {
			return nil, badParam(pat+"."+unknownParam(p.Unknown), "not supported")
		}
		switch p.Type {
		case "text":
			if p.Text != "" {
				out = append(out, textBlock(p.Text))
			}
		case "image_url":
			if p.ImageURL == nil {
				return nil, badParam(pat+".image_url", "required")
			}
			src, err := imageSource(p.ImageURL.URL)
			if err != nil {
				return nil, badParam(pat+".image_url.url", err.Error())
			}
			out = append(out, msgBlock{Type: "image", Source: src})
		default:
			return nil, badParam(pat+".type", strconv.Quote(p.Type)+" parts are not supported; text and image_url are")
		}
	}
	return out, nil
}

// imageSource is the Messages image source of an image_url: a data URL
// becomes base64 data, an http(s) URL a url source.
func imageSource(u string) (*msgSource, error) {
	if rest, ok := strings.CutPrefix(u, "data:"); ok {
		meta, data, ok := strings.Cut(rest, ",")
		mediaType, isBase64 := strings.CutSuffix(meta, ";base64")
		if !ok || !isBase64 || !strings.HasPrefix(mediaType, "image/") {
			return nil, errors.New("a data URL must be data:image/<type>;base64,<data>")
		}
		return &msgSource{Type: "base64", MediaType: mediaType, Data: data}, nil
	}
	if strings.HasPrefix(u, "https://") || strings.HasPrefix(u, "http://") {
		return &msgSource{Type: "url", URL: u}, nil
	}
	return nil, errors.New("must be an https URL or a base64 data URL")
}

// assistantBlocks is an assistant message's content and tool calls.
func (m *chatMessage) assistantBlocks(at string) ([]msgBlock, *chatError) {
	var out []msgBlock
	if m.parts == nil {
		if m.text != "" {
			out = append(out, textBlock(m.text))
		}
	} else {
		for j, p := range m.parts {
			switch {
			case p.Type == "text" && p.Text != "":
				out = append(out, textBlock(p.Text))
			case p.Type == "refusal" && p.Refusal != "":
				out = append(out, textBlock(p.Refusal))
			case p.Type != "text" && p.Type != "refusal":
				return nil, badParam(at+".content["+strconv.Itoa(j)+"].type", "an assistant message takes text and refusal parts")
			}
		}
	}
	if m.Refusal != nil && *m.Refusal != "" && m.parts == nil && m.text == "" {
		out = append(out, textBlock(*m.Refusal))
	}
	for j, tc := range m.ToolCalls {
		tat := at + ".tool_calls[" + strconv.Itoa(j) + "]"
		if tc.Type != "function" {
			return nil, badParam(tat+".type", "must be function")
		}
		if tc.ID == "" || tc.Function.Name == "" {
			return nil, badParam(tat, "needs an id and a function name")
		}
		args := jsontext.Value(strings.TrimSpace(tc.Function.Arguments))
		if len(args) == 0 {
			args = jsontext.Value("{}")
		}
		if !args.IsValid() || args.Kind() != '{' {
			return nil, badParam(tat+".function.arguments", "must be a JSON object")
		}
		out = append(out, msgBlock{Type: "tool_use", ID: tc.ID, Name: tc.Function.Name, Input: args})
	}
	return out, nil
}

// translateTools carries tools, tool_choice and parallel_tool_calls over.
func translateTools(r *chatRequest, out *msgRequest) *chatError {
	for i, t := range r.Tools {
		at := "tools[" + strconv.Itoa(i) + "]"
		if t.Type != "function" {
			return badParam(at+".type", "only function tools are supported")
		}
		if t.Function.Name == "" {
			return badParam(at+".function.name", "required")
		}
		schema := t.Function.Parameters
		if len(schema) == 0 || schema.Kind() == 'n' {
			schema = emptySchema
		} else if schema.Kind() != '{' {
			return badParam(at+".function.parameters", "must be a JSON schema object")
		}
		out.Tools = append(out.Tools, msgTool{Name: t.Function.Name, Description: t.Function.Description, InputSchema: schema, Strict: t.Function.Strict})
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
	if p := r.ParallelToolCalls; p != nil && !*p && len(out.Tools) > 0 {
		if out.ToolChoice == nil {
			out.ToolChoice = &msgToolChoice{Type: "auto"}
		}
		if out.ToolChoice.Type != "none" {
			out.ToolChoice.DisableParallelToolUse = true
		}
	}
	return nil
}
