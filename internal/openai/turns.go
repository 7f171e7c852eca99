package openai

import (
	"github.com/caddy-relay/relay/internal/rope"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

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

// resultText adds a text block of s to the open tool_result.
func (w *turnWriter) resultText(s string) {
	w.list()
	if w.texts > 0 {
		_ = w.turns.WriteByte(',')
	}
	w.texts++
	w.buf = appendText(w.buf[:0], s)
	_, _ = w.turns.Write(w.buf)
}

// endResult closes the open tool_result, and puts back the content held
// aside for it.
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
