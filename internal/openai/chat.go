// Package openai translates between OpenAI's Chat Completions and
// Anthropic's Messages, both ways: a Chat Completions request into a
// Messages request and the Messages answer back (the relay's
// /v1/chat/completions route), and a Messages request into a Chat
// Completions request and that answer back (provider openai).
//
// It holds one model of each wire, which both directions use: chat.go is
// OpenAI's, messages.go Anthropic's. A request has two forms there: as it
// is read (chatRequest, msgRequest: its arrays translated as they are
// decoded) and as it is written (chatFrame, msgFrame: the same members,
// the arrays spliced in from what their translation wrote); the objects
// in it (messages, parts, blocks, tools, tool calls, choices) have one.
// Stop reasons (stop_reason.go), thinking budgets (reasoning.go) and
// usage (usage.go) are each one table or rule, read both ways.
//
// It is pure wire code: it reads and writes bodies, and says what it
// refuses with Go errors (ParamError, UpstreamError) that the relay turns
// into its own answers.
//
// Requests are translated one array element at a time as they are
// decoded (jsontext's streaming decoder, ropes for the output), so a
// translation costs a small multiple of the body's size, whatever the
// body holds (docs/security.md, promise 2).
package openai

import "github.com/go-json-experiment/json/jsontext"

// chatRequest is a Chat Completions request as a client sends it, the
// part the translation reads. A member it does not know is refused
// (Unknown), as OpenAI does, so that nothing a client asks for is
// silently dropped.
//
// The arrays a client can make as long as its body allows (messages, with
// their parts and tool calls; tools; stop; modalities; logit_bias) are
// translated or checked one element at a time as they are decoded, and
// never held as Go values.
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

// chatFrame is a Chat Completions request as provider openai writes it:
// the members it can fill, in the order they are written. Its arrays
// were encoded as their elements were translated (messages: chat
// messages; stop: strings; tools: chatTools); here they hold
// placeholders, and come before any member that holds a client's object
// (writeSpliced).
type chatFrame struct {
	Model             string          `json:"model"`
	Messages          jsontext.Value  `json:"messages"`
	MaxTokens         int64           `json:"max_tokens,omitzero"`
	Stop              jsontext.Value  `json:"stop,omitzero"`
	Temperature       *float64        `json:"temperature,omitzero"`
	TopP              *float64        `json:"top_p,omitzero"`
	Tools             jsontext.Value  `json:"tools,omitzero"`
	ToolChoice        jsontext.Value  `json:"tool_choice,omitzero"`
	ParallelToolCalls *bool           `json:"parallel_tool_calls,omitzero"`
	ReasoningEffort   string          `json:"reasoning_effort,omitzero"`
	ResponseFormat    *chatFormat     `json:"response_format,omitzero"`
	User              string          `json:"user,omitzero"`
	Stream            bool            `json:"stream,omitzero"`
	StreamOptions     *chatStreamOpts `json:"stream_options,omitzero"`

	spliced spliced
}

// chatStreamOpts is stream_options. Written, include_obfuscation is null.
type chatStreamOpts struct {
	IncludeUsage       bool           `json:"include_usage"`
	IncludeObfuscation jsontext.Value `json:"include_obfuscation"`
}

// chatMessage is one message of a conversation, as chatConversation
// decodes it. (Written, a message is encoded by hand, member by member:
// antConversation.)
type chatMessage struct {
	Role       string         `json:"role"`
	Content    chatContent    `json:"content"`
	Name       string         `json:"name"`
	ToolCalls  chatToolCalls  `json:"tool_calls"`
	ToolCallID string         `json:"tool_call_id"`
	Refusal    *string        `json:"refusal"`
	Unknown    jsontext.Value `json:",embed"`
}

// chatPart is a content part of a message: text, an image, a refusal.
// Read, a member it does not know is kept (Unknown) to be refused.
type chatPart struct {
	Type     string         `json:"type"`
	Text     string         `json:"text,omitzero"`
	Refusal  string         `json:"refusal,omitzero"`
	ImageURL *chatImageURL  `json:"image_url,omitzero"`
	Unknown  jsontext.Value `json:",embed"`
}

// chatImageURL is an image_url part's image.
type chatImageURL struct {
	URL    string `json:"url"`
	Detail string `json:"detail,omitzero"`
}

// chatToolCall is an assistant message's call of a function, in a
// request or an answer.
type chatToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// chatTool is a tool a request offers: a function, with its parameters'
// JSON schema.
type chatTool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string         `json:"name"`
		Description string         `json:"description,omitzero"`
		Parameters  jsontext.Value `json:"parameters,omitzero"`
		Strict      *bool          `json:"strict,omitzero"`
	} `json:"function"`
}

// chatToolChoice is a tool_choice that names a function; the others are
// the strings none, auto and required.
type chatToolChoice struct {
	Type     string `json:"type"`
	Function struct {
		Name string `json:"name"`
	} `json:"function"`
}

// chatFormat is response_format: text, or a JSON schema the answer
// follows.
type chatFormat struct {
	Type       string          `json:"type"`
	JSONSchema *chatJSONSchema `json:"json_schema,omitzero"`
}

// chatJSONSchema is a json_schema response format.
type chatJSONSchema struct {
	Name        string         `json:"name"`
	Description string         `json:"description,omitzero"`
	Strict      *bool          `json:"strict,omitzero"`
	Schema      jsontext.Value `json:"schema"`
}

// chatCompletion is a whole (non-streaming) answer, chat.completion.
type chatCompletion struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   chatUsage    `json:"usage"`
}

// chatChoice is an answer's choice: Claude answers one.
type chatChoice struct {
	Index        int            `json:"index"`
	Message      chatAnswer     `json:"message"`
	FinishReason string         `json:"finish_reason"`
	Logprobs     jsontext.Value `json:"logprobs"`
}

// chatAnswer is a choice's message.
type chatAnswer struct {
	Role             string         `json:"role"`
	Content          *string        `json:"content"`
	Refusal          *string        `json:"refusal"`
	ReasoningContent string         `json:"reasoning_content,omitempty"`
	ToolCalls        []chatToolCall `json:"tool_calls,omitempty"`
}

// chatUsage is an answer's token counts.
type chatUsage struct {
	PromptTokens        int64 `json:"prompt_tokens"`
	CompletionTokens    int64 `json:"completion_tokens"`
	TotalTokens         int64 `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int64 `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// chatError is the body of an error answer, {"error":{...}}.
type chatError struct {
	Error struct {
		Message string         `json:"message"`
		Type    string         `json:"type"`
		Param   jsontext.Value `json:"param"`
		Code    jsontext.Value `json:"code"`
	} `json:"error"`
}

// jsonNull is JSON's null, for the members an answer always has.
var jsonNull = jsontext.Value("null")
