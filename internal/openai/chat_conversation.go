package openai

import (
	"bytes"
	"errors"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/rope"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

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
	n     int         // messages decoded
	err   *ParamError // the first one refused
	w     turnWriter
	m     chatMessage      // the message being decoded
	parts bytes.Buffer     // m's content, when it is parts, as JSON
	calls rope.Rope        // the tool_use blocks of m's calls
	dec   jsontext.Decoder // reads the parts of m
	part  chatPart
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (cv *chatConversation) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	fresh := func() chatMessage {
		cv.parts.Reset()
		cv.calls.Reset()
		return chatMessage{Content: chatContent{parts: &cv.parts}, ToolCalls: chatToolCalls{out: &cv.calls}}
	}
	var err error
	cv.n, err = eachElement(dec, &cv.m, fresh, func(i int) {
		if cv.err == nil {
			cv.err = cv.translate(i)
		}
	})
	return err
}

// msgAt names message i in a refusal, as OpenAI does.
func msgAt(i int) string { return "messages[" + strconv.Itoa(i) + "]" }

// translate adds message i, just decoded, to the conversation. A message
// that translates to no block (an empty text) adds nothing: Messages
// refuses an empty turn.
func (cv *chatConversation) translate(i int) *ParamError {
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
	var err *ParamError
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
			return &ParamError{Param: msgAt(i) + "." + e.Param, Msg: msgAt(i) + "." + e.Msg}
		}
		if m.ToolCalls.n > 0 {
			_, _ = cv.calls.WriteTo(w.next("assistant"))
		}
	}
	return nil
}

// partsError is the refusal of message i whose parts did not decode.
func partsError(i int, err error) *ParamError {
	if ce := jsonError(err); ce.Param != "" {
		return badParam(msgAt(i)+".content."+ce.Param, strings.TrimPrefix(ce.Msg, ce.Param+": "))
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
func (cv *chatConversation) addPart(i, j int) *ParamError {
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
	err   *ParamError
	call  chatToolCall // the one being decoded
	block msgBlock
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (t *chatToolCalls) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	var err error
	t.n, err = eachElement(dec, &t.call, nil, func(j int) {
		if t.err == nil {
			t.err = t.add(j)
		}
	})
	return err
}

// add encodes call j as a tool_use block.
func (t *chatToolCalls) add(j int) *ParamError {
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
