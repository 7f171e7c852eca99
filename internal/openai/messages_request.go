package openai

import (
	"bytes"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/caddy-relay/relay/internal/rope"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// droppedFields are the top-level Messages fields an OpenAI upstream is not
// given, since Chat Completions has nothing for them: a cloud's body
// version, and top_k (no OpenAI sampler takes it). The feature fields
// (cache_control, service_tier, context_management...) never get here:
// the channel does not support them (Supports), so a request carrying one
// goes to another channel, unless the channel's config strips it.
var droppedFields = map[string]bool{"anthropic_version": true, "top_k": true}

// MessagesToChat translates a Messages body into a Chat Completions body
// for model, for provider openai. Its errors say what the request holds
// that the format cannot carry. A body with several problems is refused for the first of them in
// this order: a value of the wrong type (in the order of the body), a
// field the format cannot carry, the system prompt, the messages in
// order, the tools in order.
func MessagesToChat(body []byte, model string) ([]byte, error) {
	var in msgRequest
	if err := json.Unmarshal(body, &in); err != nil {
		// where it went wrong, in the body's terms: not the decoder's Go types
		return nil, fmt.Errorf("the request cannot be translated: %s", jsonError(err).Msg)
	}
	if len(in.Rest) > 0 {
		var rest map[string]jsontext.Value
		_ = json.Unmarshal(in.Rest, &rest)
		for _, name := range slices.Sorted(maps.Keys(rest)) { // the same answer every time
			if !droppedFields[name] {
				return nil, fmt.Errorf("%s cannot be carried to an OpenAI-format upstream", name)
			}
		}
	}
	out := chatFrame{Model: model, MaxTokens: in.MaxTokens, Temperature: in.Temperature, TopP: in.TopP}
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
			named := chatToolChoice{Type: "function"}
			named.Function.Name = tc.Name
			out.ToolChoice, _ = json.Marshal(&named)
		}
		if tc.DisableParallelToolUse {
			f := false
			out.ParallelToolCalls = &f
		}
	}
	out.ReasoningEffort = reasoningEffort(in.Thinking, in.OutputConfig)
	if oc := in.OutputConfig; oc != nil && oc.Format != nil {
		strict := true
		out.ResponseFormat = &chatFormat{Type: "json_schema", JSONSchema: &chatJSONSchema{Name: "output", Strict: &strict, Schema: oc.Format.Schema}}
	}
	var buf bytes.Buffer
	if err := writeSpliced(&buf, &out, out.spliced); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
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
		var wrong []msgBlock // the error it always was
		return "", fmt.Errorf("system: %v", json.Unmarshal(v, &wrong))
	}
	var r blockReader
	var sb strings.Builder
	derr, err := r.each(v, func(b *msgBlock) error {
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

// msgTools is a request's tools, each checked and encoded as a chat tool
// as it is decoded; the first one refused is kept (err).
type msgTools struct {
	n    int
	err  error
	out  rope.Rope // the tools, comma-separated
	tool msgTool   // the one being decoded
	chat chatTool
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (t *msgTools) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	var err error
	t.n, err = eachElement(dec, &t.tool, nil, func(i int) {
		if t.err == nil {
			t.err = t.add(i)
		}
	})
	return err
}

// add encodes tool i. A tool must have a name, as Messages wants: a
// nameless one would become a function of no name, the size of several
// of it.
func (t *msgTools) add(i int) error {
	in := &t.tool
	if in.Type != "" && in.Type != "custom" {
		return fmt.Errorf("tool %q of type %s is a server tool an OpenAI-format upstream does not run", in.Name, in.Type)
	}
	if in.Name == "" {
		return fmt.Errorf("tools.%d.name: Field required", i)
	}
	t.chat = chatTool{Type: "function"}
	f := &t.chat.Function
	f.Name, f.Description, f.Parameters, f.Strict = in.Name, in.Description, in.InputSchema, in.Strict
	sep(&t.out)
	return json.MarshalWrite(&t.out, &t.chat)
}
