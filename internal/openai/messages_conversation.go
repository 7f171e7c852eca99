package openai

import (
	"bytes"
	"cmp"
	"fmt"
	"strings"

	"github.com/caddy-relay/relay/internal/rope"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// blockReader reads the blocks of a JSON array one at a time, in place.
type blockReader struct {
	src bytes.Buffer
	dec jsontext.Decoder
	b   msgBlock
}

// each decodes the blocks of v, a JSON array, into one msgBlock after the
// other and calls f with each until f refuses one (refused); the others
// are only decoded, since a block that does not decode (err) is the first
// problem.
func (r *blockReader) each(v []byte, f func(*msgBlock) error) (err, refused error) {
	r.src = *bytes.NewBuffer(v) // read in place, never copied
	r.dec.Reset(&r.src)
	if _, err := r.dec.ReadToken(); err != nil {
		return err, nil
	}
	for r.dec.PeekKind() != ']' {
		r.b = msgBlock{}
		if err := json.UnmarshalDecode(&r.dec, &r.b); err != nil {
			return err, nil
		}
		if refused == nil {
			refused = f(&r.b)
		}
	}
	return nil, refused
}

// msgConversation is a Messages request's messages. Each is translated
// into chat messages as soon as it is decoded, so no conversation is ever
// held as Go values: a user turn's tool results become tool messages
// ahead of the rest of it, an assistant turn's tool_use blocks its tool
// calls. Thinking blocks are dropped: an OpenAI-format upstream takes no
// signed reasoning back. The first message refused is kept (err) and the
// ones after it only decoded.
type msgConversation struct {
	n       int
	err     error
	out     rope.Rope    // the chat messages, comma-separated
	m       msgMessage   // the message being decoded
	content bytes.Buffer // its content, as JSON
	blocks  blockReader  // reads its blocks
	results blockReader  // and a tool result's
	parts   rope.Rope    // a user turn's parts, comma-separated
	text    rope.Rope    // an assistant turn's text, as in a JSON string
	calls   rope.Rope    // and its tool calls, comma-separated
	part    chatPart
	url     chatImageURL
	call    chatToolCall
	raw     []byte
	buf     []byte
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (c *msgConversation) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	fresh := func() msgMessage {
		c.content.Reset()
		return msgMessage{Content: msgContent{raw: &c.content}}
	}
	var err error
	c.n, err = eachElement(dec, &c.m, fresh, func(i int) {
		if c.err == nil {
			if err := c.translate(); err != nil {
				c.err = fmt.Errorf("messages.%d: %v", i, err)
			}
		}
	})
	return err
}

// translate writes the chat messages of the message just decoded.
func (c *msgConversation) translate() error {
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
		var wrong []msgBlock // null is no blocks; anything else the error it always was
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
func (c *msgConversation) add(b *msgBlock) error {
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
		c.part = chatPart{Type: "text", Text: b.Text}
		return c.addPart()
	case "image":
		if c.m.Role != "user" || b.Source == nil {
			return fmt.Errorf("an image goes in a user turn, with a source")
		}
		switch b.Source.Type {
		case "base64":
			c.url = chatImageURL{URL: "data:" + b.Source.MediaType + ";base64," + b.Source.Data}
		case "url":
			c.url = chatImageURL{URL: b.Source.URL}
		default:
			return fmt.Errorf("image sources of type %s cannot be carried", b.Source.Type)
		}
		c.part = chatPart{Type: "image_url", ImageURL: &c.url}
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

// addPart adds c.part to the user turn's parts.
func (c *msgConversation) addPart() error {
	sep(&c.parts)
	return json.MarshalWrite(&c.parts, &c.part)
}

// begin starts a chat message of role, {"role","content","tool_calls",
// "tool_call_id"}, the last three written by the caller, in this order,
// and the closing brace.
func (c *msgConversation) begin(role string) {
	sep(&c.out)
	c.out.WriteString(`{"role":`)
	c.quote(&c.out, role)
}

// quote writes s as a JSON string.
func (c *msgConversation) quote(r *rope.Rope, s string) {
	c.buf, _ = jsontext.AppendQuote(c.buf[:0], s) // valid UTF-8: it was decoded
	_, _ = r.Write(c.buf)
}

// close ends the messages: the system prompt's message, then the others.
func (c *msgConversation) close(system string) *rope.Rope {
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
func (c *msgConversation) toolResultText(b *msgBlock) (string, error) {
	var s string
	switch b.Content.Kind() {
	case 0, 'n':
	case '"':
		c.raw, _ = jsontext.AppendUnquote(c.raw[:0], b.Content) // valid: it was decoded
		s = string(c.raw)
	case '[':
		var sb strings.Builder
		derr, err := c.results.each(b.Content, func(t *msgBlock) error {
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
		var wrong []msgBlock // the error it always was
		return "", fmt.Errorf("tool_result content: %v", json.Unmarshal(b.Content, &wrong))
	}
	if b.IsError {
		s = "Error: " + s
	}
	return s, nil
}
