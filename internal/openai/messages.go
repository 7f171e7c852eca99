package openai

import (
	"bytes"

	"github.com/go-json-experiment/json/jsontext"
)

// msgRequest is a Messages request as a client sends it, the part
// provider openai reads: what an OpenAI upstream can be given. Its arrays
// (messages and their blocks, tools, stop_sequences) are translated one
// element at a time as they are decoded, never held as Go values.
type msgRequest struct {
	Model         string           `json:"model"`
	MaxTokens     int64            `json:"max_tokens"`
	System        jsontext.Value   `json:"system"`
	Messages      msgConversation  `json:"messages"`
	StopSequences jsonStrings      `json:"stop_sequences"`
	Temperature   *float64         `json:"temperature"`
	TopP          *float64         `json:"top_p"`
	Tools         msgTools         `json:"tools"`
	ToolChoice    *msgToolChoice   `json:"tool_choice"`
	Thinking      *msgThinking     `json:"thinking"`
	OutputConfig  *msgOutputConfig `json:"output_config"`
	Metadata      *msgMetadata     `json:"metadata"`
	Stream        bool             `json:"stream"`
	Rest          jsontext.Value   `json:",embed"` // top_k, cache_control, service_tier...: refused or dropped
}

// msgFrame is a Messages request as the Chat Completions route writes it:
// msgRequest's members, in the same order. Its arrays were encoded as
// their elements were translated (system: text blocks; messages: turns,
// {"role","content"} with msgBlocks; stop_sequences: strings; tools:
// msgTools); here they hold placeholders, and come before any member that
// holds a client's object (writeSpliced).
type msgFrame struct {
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

// msgMessage is one message of a conversation, as msgConversation
// decodes it. (Written, a turn is encoded by hand: turnWriter.)
type msgMessage struct {
	Role    string     `json:"role"`
	Content msgContent `json:"content"`
}

// msgContent is a message's content (a string, blocks, or null), kept as
// JSON until the message's role, which may come after it, says how to
// read it.
type msgContent struct {
	raw *bytes.Buffer // msgConversation's
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (c *msgContent) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	v, err := dec.ReadValue()
	c.raw.Write(v)
	return err
}

// msgBlock is a content block of any type: the fields of its type are
// set. (A text block is never empty: Messages refuses those.) A
// tool_result's content is kept as JSON: a string or blocks.
type msgBlock struct {
	Type      string         `json:"type"`
	Text      string         `json:"text,omitzero"`
	Source    *msgSource     `json:"source,omitzero"`
	ID        string         `json:"id,omitzero"`
	Name      string         `json:"name,omitzero"`
	Input     jsontext.Value `json:"input,omitzero"`
	ToolUseID string         `json:"tool_use_id,omitzero"`
	Content   jsontext.Value `json:"content,omitzero"`
	IsError   bool           `json:"is_error,omitzero"`
}

// msgSource is an image block's source: base64 data, or a URL.
type msgSource struct {
	Type      string `json:"type"`
	MediaType string `json:"media_type,omitzero"`
	Data      string `json:"data,omitzero"`
	URL       string `json:"url,omitzero"`
}

// msgTool is a tool a request offers. Without a type it is a client tool
// with an input schema; with one (other than custom), a server tool.
type msgTool struct {
	Type        string         `json:"type,omitzero"`
	Name        string         `json:"name"`
	Description string         `json:"description,omitzero"`
	InputSchema jsontext.Value `json:"input_schema"`
	Strict      *bool          `json:"strict,omitzero"`
}

// msgToolChoice is tool_choice: auto, any, none, or a named tool.
type msgToolChoice struct {
	Type                   string `json:"type"`
	Name                   string `json:"name,omitzero"`
	DisableParallelToolUse bool   `json:"disable_parallel_tool_use,omitzero"`
}

// msgThinking is thinking: enabled with a budget, adaptive, or disabled.
type msgThinking struct {
	Type         string `json:"type"`
	BudgetTokens int64  `json:"budget_tokens,omitzero"`
}

// msgOutputConfig is output_config: an effort, a format.
type msgOutputConfig struct {
	Effort string     `json:"effort,omitzero"`
	Format *msgFormat `json:"format,omitzero"`
}

// msgFormat is output_config's format: a JSON schema the answer follows.
type msgFormat struct {
	Type   string         `json:"type"`
	Schema jsontext.Value `json:"schema"`
}

// msgMetadata is metadata: the end user's id.
type msgMetadata struct {
	UserID string `json:"user_id"`
}

// emptySchema is the input schema of a function tool without parameters.
var emptySchema = jsontext.Value(`{"type":"object","properties":{}}`)

// msgAnswer is a whole (non-streaming) Messages answer, as provider
// openai writes it: its content blocks encoded already.
type msgAnswer struct {
	ID           string           `json:"id"`
	Type         string           `json:"type"`
	Role         string           `json:"role"`
	Model        string           `json:"model"`
	Content      []jsontext.Value `json:"content"`
	StopReason   string           `json:"stop_reason"`
	StopSequence jsontext.Value   `json:"stop_sequence"`
	Usage        jsontext.Value   `json:"usage"`
}
