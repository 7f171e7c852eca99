package relay

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/rope"
	"github.com/caddy-relay/relay/internal/sse"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/tidwall/gjson"
)

func init() {
	caddy.RegisterModule(OpenAIProvider{})
}

// defaultOpenAIURL is the base URL of OpenAI's API; a reseller's is its own.
const defaultOpenAIURL = "https://api.openai.com/v1"

// OpenAIProvider speaks OpenAI's Chat Completions to an upstream that
// serves Claude in that format (a reseller, a gateway): each Messages
// request is translated into a chat completion, and the answer back into
// Anthropic's wire: a message, the exact SSE events of a stream, or an
// error the relay classifies as Anthropic's.
type OpenAIProvider struct {
	// URL is the upstream's base URL, as OpenAI's SDKs take it: the path
	// /chat/completions is appended. Default: https://api.openai.com/v1.
	URL string `json:"url,omitempty"`

	// APIKey is the channel's credential, sent as a bearer token; usually a
	// placeholder such as `{env.RESELLER_KEY}`, resolved when the config
	// loads. Required.
	APIKey string `json:"api_key,omitempty"`

	base   string
	apiKey string
}

// CaddyModule returns the Caddy module information.
func (OpenAIProvider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.openai",
		New: func() caddy.Module { return new(OpenAIProvider) },
	}
}

// check validates what needs no secret; the Caddyfile adapter runs it too.
func (p *OpenAIProvider) check() error {
	if p.APIKey == "" {
		return fmt.Errorf("no api_key: an openai channel needs a credential")
	}
	return provider.CheckURL(p.URL)
}

// Provision resolves the credential.
func (p *OpenAIProvider) Provision(ctx caddy.Context) error {
	if err := p.check(); err != nil {
		return err
	}
	p.base = p.BaseURL()
	key, err := provider.Secret(ctx, "api_key", p.APIKey)
	p.apiKey = key
	return err
}

// BaseURL implements Provider.
func (p *OpenAIProvider) BaseURL() string {
	return strings.TrimSuffix(cmp.Or(p.URL, defaultOpenAIURL), "/")
}

// NewRequest implements Provider: the message becomes a chat completion.
// A request the format cannot carry is the client's error (a 400), never
// the channel's.
func (p *OpenAIProvider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	if c.CountTokens() {
		return nil, provider.UpstreamError{Status: http.StatusBadRequest, Message: "channel " + strconv.Quote(c.Channel) + " (provider openai) cannot count tokens: Chat Completions has no such endpoint"}
	}
	body, err := messagesToChat(c.Body(), c.Model)
	if err != nil {
		return nil, provider.UpstreamError{Status: http.StatusBadRequest, Message: "channel " + strconv.Quote(c.Channel) + " (provider openai): " + err.Error()}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.base+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+p.apiKey)
	if c.Stream {
		req.Header.Set("Accept", "text/event-stream")
	} else {
		req.Header.Set("Accept", "application/json")
	}
	req.Header["User-Agent"] = []string{c.Header.Get("User-Agent")}
	return req, nil
}

// Response implements Provider.
func (p *OpenAIProvider) Response(resp *http.Response, c *provider.Call) (*http.Response, error) {
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		if err != nil {
			return nil, err
		}
		return openAIUpstreamError(resp.StatusCode, body, resp.Header.Get("X-Request-Id")).Response(resp), nil
	}
	if isEventStream(resp.Header) {
		out := *resp
		out.Header = resp.Header.Clone()
		out.Header.Del("Content-Length")
		out.ContentLength = -1
		out.Body = newChatStreamSSE(resp.Body)
		return &out, nil
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, defaultMaxResponseSize))
	if err != nil {
		return nil, err
	}
	msg, err := chatToMessage(body)
	if err != nil {
		return nil, err
	}
	return provider.ReplaceBody(resp, "application/json", msg), nil
}

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	url     <base url, with /v1>
//	api_key <secret|{env.NAME}|{file./path}>
func (p *OpenAIProvider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return provider.UnmarshalOptions(d, p.CaddyfileOptions(), p.check)
}

// CaddyfileOptions implements provider.OptionsProvider.
func (p *OpenAIProvider) CaddyfileOptions() provider.Options {
	return provider.Options{Strings: map[string]*string{"url": &p.URL, "api_key": &p.APIKey}}
}

// openAIUpstreamError is an OpenAI error answer in Anthropic's terms. The
// status mostly stays; OpenAI's own conditions move to the status Anthropic
// gives them: an exhausted quota (429 insufficient_quota) is a billing
// error, a model the upstream does not have (404 model_not_found) a refusal
// of that model, an overloaded engine (503) an overload.
func openAIUpstreamError(status int, body []byte, requestID string) provider.UpstreamError {
	e := gjson.GetBytes(body, "error")
	if e.Type == gjson.String { // some servers answer {"error":"..."}
		e = gjson.Parse(`{"message":` + e.Raw + `}`)
	}
	code := cmp.Or(e.Get("code").String(), e.Get("type").String())
	msg := e.Get("message").String()
	if msg == "" {
		msg = http.StatusText(status)
	}
	out := provider.UpstreamError{Status: status, Message: "openai upstream: " + msg, RequestID: requestID}
	switch {
	case code == "insufficient_quota":
		out.Status = http.StatusPaymentRequired
	case status == http.StatusNotFound && code == "model_not_found":
		out.Status, out.RefusesModel = http.StatusForbidden, true
	case status == http.StatusServiceUnavailable:
		out.Status = 529
	case status == http.StatusUnprocessableEntity:
		out.Status = http.StatusBadRequest
	case status == http.StatusRequestTimeout:
		out.Status = http.StatusGatewayTimeout
	}
	return out
}

// antRequest is the part of a Messages request an OpenAI upstream can be
// given. Its arrays (messages and their blocks, tools, stop_sequences) are
// translated one element at a time as they are decoded, never held as Go
// values, so a translation costs a small multiple of the body's size
// whatever the body holds (docs/security.md, promise 2).
type antRequest struct {
	Model         string          `json:"model"`
	MaxTokens     int64           `json:"max_tokens"`
	System        jsontext.Value  `json:"system"`
	Messages      antConversation `json:"messages"`
	StopSequences jsonStrings     `json:"stop_sequences"`
	Temperature   *float64        `json:"temperature"`
	TopP          *float64        `json:"top_p"`
	Tools         antTools        `json:"tools"`
	ToolChoice    *msgToolChoice  `json:"tool_choice"`
	Thinking      *msgThinking    `json:"thinking"`
	OutputConfig  *antOutputCfg   `json:"output_config"`
	Metadata      *msgMetadata    `json:"metadata"`
	Stream        bool            `json:"stream"`
	Rest          jsontext.Value  `json:",embed"` // top_k, cache_control, service_tier...: refused or dropped
}

type antOutputCfg struct {
	Effort string     `json:"effort"`
	Format *msgFormat `json:"format"`
}

// antMessage is one message, as antConversation decodes it.
type antMessage struct {
	Role    string     `json:"role"`
	Content antContent `json:"content"`
}

// antContent is a message's content (a string, blocks, or null), kept as
// JSON until the message's role, which may come after it, says how to
// read it.
type antContent struct {
	raw *bytes.Buffer // antConversation's
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (c *antContent) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	v, err := dec.ReadValue()
	c.raw.Write(v)
	return err
}

type antBlock struct {
	Type      string         `json:"type"`
	Text      string         `json:"text"`
	Source    *msgSource     `json:"source"`
	ID        string         `json:"id"`
	Name      string         `json:"name"`
	Input     jsontext.Value `json:"input"`
	ToolUseID string         `json:"tool_use_id"`
	Content   jsontext.Value `json:"content"`
	IsError   bool           `json:"is_error"`
}

type antTool struct {
	Type        string         `json:"type"`
	Name        string         `json:"name"`
	Description string         `json:"description"`
	InputSchema jsontext.Value `json:"input_schema"`
	Strict      *bool          `json:"strict"`
}

// droppedFields are the top-level Messages fields an OpenAI upstream is not
// given, since Chat Completions has nothing for them: a cloud's body
// version, and top_k (no OpenAI sampler takes it). The feature fields
// (cache_control, service_tier, context_management...) never get here:
// the channel does not support them (Supports), so a request carrying one
// goes to another channel, unless the channel's config strips it.
var droppedFields = map[string]bool{"anthropic_version": true, "top_k": true}

// Supports implements FeatureSupport: Chat Completions carries
// output_config (as reasoning_effort and response_format) and a long
// prompt; no other feature field, no server tool and no anthropic-beta
// value.
func (*OpenAIProvider) Supports(name string) provider.Support {
	switch name {
	case "output_config", "long_context":
		return provider.Supported
	}
	return provider.Unsupported
}

// oaiRequest is the chat completion an OpenAI upstream is sent. Its
// arrays were encoded as their elements were translated (messages: chat
// messages; stop: strings; tools: oaiTools); here they hold placeholders,
// and come before any member that holds a client's object (writeSpliced).
type oaiRequest struct {
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
	ResponseFormat    jsontext.Value  `json:"response_format,omitzero"`
	User              string          `json:"user,omitzero"`
	Stream            bool            `json:"stream,omitzero"`
	StreamOptions     *chatStreamOpts `json:"stream_options,omitzero"`

	spliced spliced
}

type oaiTool struct {
	Type     string `json:"type"`
	Function struct {
		Name        string         `json:"name"`
		Description string         `json:"description,omitzero"`
		Parameters  jsontext.Value `json:"parameters,omitzero"`
		Strict      *bool          `json:"strict,omitzero"`
	} `json:"function"`
}

type oaiPart struct {
	Type     string       `json:"type"`
	Text     string       `json:"text,omitzero"`
	ImageURL *oaiImageURL `json:"image_url,omitzero"`
}

type oaiImageURL struct {
	URL string `json:"url"`
}

// messagesToChat translates a Messages body into a chat completion for
// model. A body with several problems is refused for the first of them in
// this order: a value of the wrong type (in the order of the body), a
// field the format cannot carry, the system prompt, the messages in
// order, the tools in order.
func messagesToChat(body []byte, model string) ([]byte, error) {
	var in antRequest
	if err := json.Unmarshal(body, &in); err != nil {
		return nil, fmt.Errorf("the request cannot be translated: %v", err)
	}
	if len(in.Rest) > 0 {
		var rest map[string]jsontext.Value
		_ = json.Unmarshal(in.Rest, &rest)
		for name := range rest {
			if !droppedFields[name] {
				return nil, fmt.Errorf("%s cannot be carried to an OpenAI-format upstream", name)
			}
		}
	}
	out := oaiRequest{Model: model, MaxTokens: in.MaxTokens, Temperature: in.Temperature, TopP: in.TopP}
	if in.StopSequences.array {
		out.Stop = out.spliced.add("stop", &in.StopSequences.out)
	}
	if in.Metadata != nil {
		out.User = in.Metadata.UserID
	}
	if in.Stream {
		out.Stream, out.StreamOptions = true, &chatStreamOpts{IncludeUsage: true}
	}
	sys, err := systemText(in.System)
	if err != nil {
		return nil, err
	}
	if in.Messages.err != nil {
		return nil, in.Messages.err
	}
	out.Messages = out.spliced.add("messages", in.Messages.close(sys))
	if in.Tools.err != nil {
		return nil, in.Tools.err
	}
	if in.Tools.n > 0 {
		out.Tools = out.spliced.add("tools", &in.Tools.out)
	}
	if tc := in.ToolChoice; tc != nil {
		switch tc.Type {
		case "auto":
			out.ToolChoice = jsontext.Value(`"auto"`)
		case "any":
			out.ToolChoice = jsontext.Value(`"required"`)
		case "none":
			out.ToolChoice = jsontext.Value(`"none"`)
		case "tool":
			out.ToolChoice = jsontext.Value(`{"type":"function","function":{"name":` + string(jsonString(tc.Name)) + `}}`)
		}
		if tc.DisableParallelToolUse {
			f := false
			out.ParallelToolCalls = &f
		}
	}
	out.ReasoningEffort = reasoningEffort(in.Thinking, in.OutputConfig)
	if oc := in.OutputConfig; oc != nil && oc.Format != nil {
		schema := oc.Format.Schema
		out.ResponseFormat = jsontext.Value(`{"type":"json_schema","json_schema":{"name":"output","strict":true,"schema":` + string(schema) + `}}`)
	}
	var buf bytes.Buffer
	if err := writeSpliced(&buf, &out, out.spliced); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// reasoningEffort is the reasoning_effort of a thinking config: the
// effort the client gave, else the effort its budget asks for.
func reasoningEffort(t *msgThinking, oc *antOutputCfg) string {
	if oc != nil && oc.Effort != "" {
		switch oc.Effort {
		case "max":
			return "xhigh"
		default:
			return oc.Effort
		}
	}
	if t == nil || t.Type == "disabled" {
		return ""
	}
	switch b := t.BudgetTokens; {
	case t.Type == "adaptive":
		return "medium"
	case b <= reasoningBudgets["minimal"]:
		return "minimal"
	case b <= reasoningBudgets["low"]:
		return "low"
	case b <= reasoningBudgets["medium"]:
		return "medium"
	case b <= reasoningBudgets["high"]:
		return "high"
	}
	return "xhigh"
}

func jsonString(s string) jsontext.Value {
	b, _ := jsontext.AppendQuote(nil, s)
	return b
}

// systemText joins a system prompt's text.
func systemText(v jsontext.Value) (string, error) {
	switch v.Kind() {
	case 0, 'n':
		return "", nil
	case '"':
		var s string
		_ = json.Unmarshal(v, &s)
		return s, nil
	case '[':
	default:
		var wrong []antBlock // the error it always was
		return "", fmt.Errorf("system: %v", json.Unmarshal(v, &wrong))
	}
	var r blockReader
	var sb strings.Builder
	derr, err := r.each(v, func(b *antBlock) error {
		if b.Type != "text" {
			return fmt.Errorf("system: %s blocks cannot be carried", b.Type)
		}
		if sb.Len() > 0 {
			sb.WriteString("\n\n")
		}
		sb.WriteString(b.Text)
		return nil
	})
	if derr != nil {
		return "", fmt.Errorf("system: %v", derr)
	}
	return sb.String(), err
}

// blockReader reads the blocks of a JSON array one at a time, in place.
type blockReader struct {
	src bytes.Buffer
	dec jsontext.Decoder
	b   antBlock
}

// each decodes the blocks of v, a JSON array, into one antBlock after the
// other and calls f with each until f refuses one (refused); the others
// are only decoded, since a block that does not decode (err) is the first
// problem.
func (r *blockReader) each(v []byte, f func(*antBlock) error) (err, refused error) {
	r.src = *bytes.NewBuffer(v) // read in place, never copied
	r.dec.Reset(&r.src)
	if _, err := r.dec.ReadToken(); err != nil {
		return err, nil
	}
	for r.dec.PeekKind() != ']' {
		r.b = antBlock{}
		if err := json.UnmarshalDecode(&r.dec, &r.b); err != nil {
			return err, nil
		}
		if refused == nil {
			refused = f(&r.b)
		}
	}
	return nil, refused
}

// antConversation is a Messages request's messages. Each is translated
// into chat messages as soon as it is decoded, so no conversation is ever
// held as Go values: a user turn's tool results become tool messages
// ahead of the rest of it, an assistant turn's tool_use blocks its tool
// calls. Thinking blocks are dropped: an OpenAI-format upstream takes no
// signed reasoning back. The first message refused is kept (err) and the
// ones after it only decoded.
type antConversation struct {
	n       int
	err     error
	out     rope.Rope    // the chat messages, comma-separated
	m       antMessage   // the message being decoded
	content bytes.Buffer // its content, as JSON
	blocks  blockReader  // reads its blocks
	results blockReader  // and a tool result's
	parts   rope.Rope    // a user turn's parts, comma-separated
	text    rope.Rope    // an assistant turn's text, as in a JSON string
	calls   rope.Rope    // and its tool calls, comma-separated
	part    oaiPart
	url     oaiImageURL
	call    chatToolCall
	raw     []byte
	buf     []byte
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (c *antConversation) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[antMessage](dec); !ok {
		return err
	}
	for ; dec.PeekKind() != ']'; c.n++ {
		c.content.Reset()
		c.m = antMessage{Content: antContent{raw: &c.content}}
		if err := json.UnmarshalDecode(dec, &c.m); err != nil {
			return err
		}
		if c.err == nil {
			if err := c.translate(); err != nil {
				c.err = fmt.Errorf("messages.%d: %v", c.n, err)
			}
		}
	}
	_, err := dec.ReadToken()
	return err
}

// translate writes the chat messages of the message just decoded.
func (c *antConversation) translate() error {
	content := c.content.Bytes()
	switch jsontext.Value(content).Kind() {
	case '"':
		// the string as encoding it gives: its escapes, canonical
		var err error
		if c.raw, err = jsontext.AppendUnquote(c.raw[:0], content); err != nil {
			return fmt.Errorf("content: %v", err)
		}
		c.begin(c.m.Role)
		c.out.WriteString(`,"content":`)
		c.buf, _ = jsontext.AppendQuote(c.buf[:0], c.raw) // valid UTF-8: it was decoded
		_, _ = c.out.Write(c.buf)
		c.out.WriteString(`}`)
		return nil
	case '[':
	default:
		var wrong []antBlock // null is no blocks; anything else the error it always was
		if err := json.Unmarshal(content, &wrong); err != nil {
			return fmt.Errorf("content: %v", err)
		}
		return nil
	}
	c.parts.Reset()
	c.text.Reset()
	c.calls.Reset()
	derr, err := c.blocks.each(content, c.add)
	if derr != nil {
		return fmt.Errorf("content: %v", derr)
	}
	if err != nil {
		return err
	}
	switch {
	case c.m.Role == "assistant":
		if c.text.Len() == 0 && c.calls.Len() == 0 {
			return nil
		}
		c.begin("assistant")
		if c.text.Len() > 0 {
			c.out.WriteString(`,"content":"`)
			_, _ = c.text.WriteTo(&c.out)
			c.out.WriteString(`"`)
		} else {
			c.out.WriteString(`,"content":null`)
		}
		if c.calls.Len() > 0 {
			c.out.WriteString(`,"tool_calls":[`)
			_, _ = c.calls.WriteTo(&c.out)
			c.out.WriteString(`]`)
		}
		c.out.WriteString(`}`)
	case c.parts.Len() > 0:
		c.begin(c.m.Role)
		c.out.WriteString(`,"content":[`)
		_, _ = c.parts.WriteTo(&c.out)
		c.out.WriteString(`]}`)
	}
	return nil
}

// add translates one block of the message: text and images are the parts
// of a user turn, text the content of an assistant turn, tool_use blocks
// its tool calls; a tool result is a tool message, written at once.
func (c *antConversation) add(b *antBlock) error {
	assistant := c.m.Role == "assistant"
	switch b.Type {
	case "text":
		if assistant {
			// the content's JSON string, less its quotes: escaping is
			// rune by rune, so the text's pieces can be escaped apart
			c.buf, _ = jsontext.AppendQuote(c.buf[:0], b.Text) // valid UTF-8: it was decoded
			_, _ = c.text.Write(c.buf[1 : len(c.buf)-1])
			return nil
		}
		c.part = oaiPart{Type: "text", Text: b.Text}
		return c.addPart()
	case "image":
		if c.m.Role != "user" || b.Source == nil {
			return fmt.Errorf("an image goes in a user turn, with a source")
		}
		switch b.Source.Type {
		case "base64":
			c.url = oaiImageURL{URL: "data:" + b.Source.MediaType + ";base64," + b.Source.Data}
		case "url":
			c.url = oaiImageURL{URL: b.Source.URL}
		default:
			return fmt.Errorf("image sources of type %s cannot be carried", b.Source.Type)
		}
		c.part = oaiPart{Type: "image_url", ImageURL: &c.url}
		return c.addPart()
	case "tool_use":
		if !assistant {
			return nil // a user turn's calls go nowhere, as they always did
		}
		c.call = chatToolCall{ID: b.ID, Type: "function"}
		c.call.Function.Name, c.call.Function.Arguments = b.Name, cmp.Or(string(b.Input), "{}")
		sep(&c.calls)
		return json.MarshalWrite(&c.calls, &c.call)
	case "tool_result":
		content, err := c.toolResultText(b)
		if err != nil {
			return err
		}
		c.begin("tool")
		c.out.WriteString(`,"content":`)
		c.quote(&c.out, content)
		if b.ToolUseID != "" {
			c.out.WriteString(`,"tool_call_id":`)
			c.quote(&c.out, b.ToolUseID)
		}
		c.out.WriteString(`}`)
		return nil
	case "thinking", "redacted_thinking":
		return nil
	}
	return fmt.Errorf("%s blocks cannot be carried to an OpenAI-format upstream", b.Type)
}

func (c *antConversation) addPart() error {
	sep(&c.parts)
	return json.MarshalWrite(&c.parts, &c.part)
}

// begin starts a chat message of role, {"role","content","tool_calls",
// "tool_call_id"}, the last three written by the caller, in this order,
// and the closing brace.
func (c *antConversation) begin(role string) {
	sep(&c.out)
	c.out.WriteString(`{"role":`)
	c.quote(&c.out, role)
}

// quote writes s as a JSON string.
func (c *antConversation) quote(r *rope.Rope, s string) {
	c.buf, _ = jsontext.AppendQuote(c.buf[:0], s) // valid UTF-8: it was decoded
	_, _ = r.Write(c.buf)
}

// close ends the messages: the system prompt's message, then the others.
func (c *antConversation) close(system string) *rope.Rope {
	if system == "" {
		return &c.out
	}
	var all rope.Rope
	all.WriteString(`{"role":"system","content":`)
	c.quote(&all, system)
	all.WriteString(`}`)
	if c.out.Len() > 0 {
		_ = all.WriteByte(',')
		all.Append(&c.out)
	}
	return &all
}

// toolResultText is a tool result's content as the text a tool message
// takes; an error result says so.
func (c *antConversation) toolResultText(b *antBlock) (string, error) {
	var s string
	switch b.Content.Kind() {
	case 0, 'n':
	case '"':
		c.raw, _ = jsontext.AppendUnquote(c.raw[:0], b.Content) // valid: it was decoded
		s = string(c.raw)
	case '[':
		var sb strings.Builder
		derr, err := c.results.each(b.Content, func(t *antBlock) error {
			if t.Type != "text" {
				return fmt.Errorf("tool_result content of type %s cannot be carried", t.Type)
			}
			sb.WriteString(t.Text)
			return nil
		})
		if derr != nil {
			return "", fmt.Errorf("tool_result content: %v", derr)
		}
		if err != nil {
			return "", err
		}
		s = sb.String()
	default:
		var wrong []antBlock // the error it always was
		return "", fmt.Errorf("tool_result content: %v", json.Unmarshal(b.Content, &wrong))
	}
	if b.IsError {
		s = "Error: " + s
	}
	return s, nil
}

// antTools is a request's tools, each checked and encoded as a chat tool
// as it is decoded; the first one refused is kept (err).
type antTools struct {
	n    int
	err  error
	out  rope.Rope // the tools, comma-separated
	tool antTool   // the one being decoded
	oai  oaiTool
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (t *antTools) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[antTool](dec); !ok {
		return err
	}
	for ; dec.PeekKind() != ']'; t.n++ {
		t.tool = antTool{}
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

// add encodes tool i. A tool must have a name, as Messages wants: a
// nameless one would become a function of no name, the size of several
// of it.
func (t *antTools) add(i int) error {
	in := &t.tool
	if in.Type != "" && in.Type != "custom" {
		return fmt.Errorf("tool %q of type %s is a server tool an OpenAI-format upstream does not run", in.Name, in.Type)
	}
	if in.Name == "" {
		return fmt.Errorf("tools.%d.name: Field required", i)
	}
	t.oai = oaiTool{Type: "function"}
	f := &t.oai.Function
	f.Name, f.Description, f.Parameters, f.Strict = in.Name, in.Description, in.InputSchema, in.Strict
	sep(&t.out)
	return json.MarshalWrite(&t.out, &t.oai)
}

// stopReasons maps Chat Completions' finish reasons onto Messages' stop
// reasons.
var stopReasons = map[string]string{
	"stop":           "end_turn",
	"length":         "max_tokens",
	"tool_calls":     "tool_use",
	"function_call":  "tool_use",
	"content_filter": "refusal",
}

func stopReason(finish string) string { return cmp.Or(stopReasons[finish], "end_turn") }

// antUsage renders a chat completion's usage as Messages': cached prompt
// tokens are cache reads, the rest input.
func antUsage(u gjson.Result) []byte {
	prompt, cached := u.Get("prompt_tokens").Int(), u.Get("prompt_tokens_details.cached_tokens").Int()
	b := []byte(`{"input_tokens":`)
	b = strconv.AppendInt(b, max(prompt-cached, 0), 10)
	b = append(b, `,"cache_creation_input_tokens":0,"cache_read_input_tokens":`...)
	b = strconv.AppendInt(b, cached, 10)
	b = append(b, `,"output_tokens":`...)
	b = strconv.AppendInt(b, u.Get("completion_tokens").Int(), 10)
	return append(b, '}')
}

// chatToMessage translates a chat.completion into a Messages answer.
func chatToMessage(body []byte) ([]byte, error) {
	r := gjson.ParseBytes(body)
	choice := r.Get("choices.0")
	if !choice.Exists() {
		return nil, fmt.Errorf("openai upstream: an answer without choices")
	}
	msg := choice.Get("message")
	var content []jsontext.Value
	if t := msg.Get("content"); t.Str != "" {
		content = append(content, jsontext.Value(`{"type":"text","text":`+t.Raw+`}`))
	} else if t := msg.Get("refusal"); t.Str != "" {
		content = append(content, jsontext.Value(`{"type":"text","text":`+t.Raw+`}`))
	}
	for _, tc := range msg.Get("tool_calls").Array() {
		input := tc.Get("function.arguments").Str
		if !gjson.Valid(input) || !gjson.Parse(input).IsObject() {
			input = "{}"
		}
		content = append(content, jsontext.Value(`{"type":"tool_use","id":`+string(jsonString(tc.Get("id").Str))+
			`,"name":`+string(jsonString(tc.Get("function.name").Str))+`,"input":`+input+`}`))
	}
	if content == nil {
		content = []jsontext.Value{}
	}
	out := struct {
		ID           string           `json:"id"`
		Type         string           `json:"type"`
		Role         string           `json:"role"`
		Model        string           `json:"model"`
		Content      []jsontext.Value `json:"content"`
		StopReason   string           `json:"stop_reason"`
		StopSequence jsontext.Value   `json:"stop_sequence"`
		Usage        jsontext.Value   `json:"usage"`
	}{
		ID: r.Get("id").Str, Type: "message", Role: "assistant", Model: r.Get("model").Str, Content: content,
		StopReason: stopReason(choice.Get("finish_reason").Str), StopSequence: jsonNull, Usage: antUsage(r.Get("usage")),
	}
	return json.Marshal(&out)
}

// chatStreamSSE turns an OpenAI chunk stream into the exact SSE events of
// a Messages stream: message_start, each content block (text, tool_use with
// input_json_delta) started, delta'd and stopped, then message_delta with
// the stop reason and the usage, and message_stop. An error chunk becomes
// an `event: error` and ends it; a stream cut before its end is left cut,
// for the relay to fail over or end with an error.
type chatStreamSSE struct {
	src     io.ReadCloser
	rd      *sse.Reader
	out     bytes.Buffer
	err     error
	started bool
	block   int    // index of the open block; -1: none
	kind    string // its type
	next    int    // index of the next block
	tools   map[int64]int
	stop    string
	usage   gjson.Result
}

func newChatStreamSSE(src io.ReadCloser) *chatStreamSSE {
	return &chatStreamSSE{src: src, rd: sse.NewReader(src, maxEvent), block: -1}
}

// Read implements io.Reader.
func (c *chatStreamSSE) Read(p []byte) (int, error) {
	for c.out.Len() == 0 {
		if c.err != nil {
			return 0, c.err
		}
		c.step()
	}
	return c.out.Read(p)
}

// Close implements io.Closer.
func (c *chatStreamSSE) Close() error { return c.src.Close() }

func (c *chatStreamSSE) emit(name string, data []byte) {
	c.out.WriteString("event: ")
	c.out.WriteString(name)
	c.out.WriteString("\ndata: ")
	c.out.Write(data)
	c.out.WriteString("\n\n")
}

// step reads one chunk and emits its events, or ends the stream.
func (c *chatStreamSSE) step() {
	ev, err := c.rd.Next()
	if err != nil {
		if err == io.EOF && c.stop != "" { // finished, without [DONE]
			c.finish()
		}
		c.err = err
		return
	}
	data := bytes.TrimSpace(ev.Data)
	if len(data) == 0 {
		return
	}
	if string(data) == "[DONE]" {
		if !c.started {
			c.err = io.ErrUnexpectedEOF
			return
		}
		c.finish()
		c.err = io.EOF
		return
	}
	chunk := gjson.ParseBytes(data)
	if e := chunk.Get("error"); e.Exists() {
		ue := openAIUpstreamError(statusFromChunk(e), []byte(chunk.Raw), "")
		c.out.Write(sseError(provider.ErrorType(ue.Status), ue.Message, ""))
		c.err = io.EOF
		return
	}
	if !c.started {
		c.started = true
		c.emit("message_start", []byte(`{"type":"message_start","message":{"id":`+string(jsonString(chunk.Get("id").Str))+
			`,"type":"message","role":"assistant","model":`+string(jsonString(chunk.Get("model").Str))+
			`,"content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":0,"output_tokens":0}}}`))
	}
	if u := chunk.Get("usage"); u.IsObject() {
		c.usage = u
	}
	choice := chunk.Get("choices.0")
	delta := choice.Get("delta")
	if t := delta.Get("content"); t.Str != "" {
		c.open("text", `{"type":"text","text":""}`)
		c.emit("content_block_delta", []byte(`{"type":"content_block_delta","index":`+strconv.Itoa(c.block)+`,"delta":{"type":"text_delta","text":`+t.Raw+`}}`))
	}
	for _, tc := range delta.Get("tool_calls").Array() {
		i := tc.Get("index").Int()
		if id := tc.Get("id"); id.Str != "" {
			if c.tools == nil {
				c.tools = map[int64]int{}
			}
			c.open("tool_use", `{"type":"tool_use","id":`+string(jsonString(id.Str))+`,"name":`+string(jsonString(tc.Get("function.name").Str))+`,"input":{}}`)
			c.tools[i] = c.block
		}
		n, ok := c.tools[i]
		if args := tc.Get("function.arguments"); ok && args.Str != "" && n == c.block {
			c.emit("content_block_delta", []byte(`{"type":"content_block_delta","index":`+strconv.Itoa(n)+`,"delta":{"type":"input_json_delta","partial_json":`+args.Raw+`}}`))
		}
	}
	if f := choice.Get("finish_reason"); f.Str != "" {
		c.closeBlock()
		c.stop = stopReason(f.Str)
	}
}

// open starts a block of kind unless one is open (a text block goes on;
// each tool call starts its own).
func (c *chatStreamSSE) open(kind, start string) {
	if c.block >= 0 && kind == "text" && c.kind == "text" {
		return
	}
	c.closeBlock()
	c.block, c.kind = c.next, kind
	c.next++
	c.emit("content_block_start", []byte(`{"type":"content_block_start","index":`+strconv.Itoa(c.block)+`,"content_block":`+start+`}`))
}

func (c *chatStreamSSE) closeBlock() {
	if c.block < 0 {
		return
	}
	c.emit("content_block_stop", []byte(`{"type":"content_block_stop","index":`+strconv.Itoa(c.block)+`}`))
	c.block = -1
}

// finish emits the end of the message.
func (c *chatStreamSSE) finish() {
	c.closeBlock()
	c.emit("message_delta", []byte(`{"type":"message_delta","delta":{"stop_reason":"`+cmp.Or(c.stop, "end_turn")+`","stop_sequence":null},"usage":`+string(antUsage(c.usage))+`}`))
	c.emit("message_stop", []byte(`{"type":"message_stop"}`))
}

// statusFromChunk guesses the status of an error chunk from its type.
func statusFromChunk(e gjson.Result) int {
	switch cmp.Or(e.Get("code").String(), e.Get("type").String()) {
	case "rate_limit_exceeded", "rate_limit_error", "requests", "tokens":
		return http.StatusTooManyRequests
	case "insufficient_quota":
		return http.StatusTooManyRequests
	case "invalid_request_error":
		return http.StatusBadRequest
	case "server_overloaded", "overloaded":
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

// Interface guards
var (
	_ provider.Provider     = (*OpenAIProvider)(nil)
	_ caddy.Provisioner     = (*OpenAIProvider)(nil)
	_ caddyfile.Unmarshaler = (*OpenAIProvider)(nil)
)
