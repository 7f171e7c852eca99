package openai

import (
	"bytes"
	"cmp"
	"io"
	"strconv"

	"github.com/caddy-relay/relay/internal/sse"
	"github.com/tidwall/gjson"
)

// NewMessageStream turns an upstream's chat.completion.chunk stream (src,
// of events up to maxEvent bytes) into the exact SSE events of a Messages
// stream: message_start, each content block (text, tool_use with
// input_json_delta) started, delta'd and stopped, then message_delta with
// the stop reason and the usage, and message_stop. An error chunk becomes
// the event errorEvent renders (Anthropic's `event: error`, for an
// UpstreamError's status and message) and ends it; a stream cut before
// its end is left cut, for the relay to fail over or end with an error.
func NewMessageStream(src io.ReadCloser, maxEvent int, errorEvent func(status int, message string) []byte) io.ReadCloser {
	c := &chatStream{rd: sse.NewReader(src, maxEvent), errorEvent: errorEvent, block: -1}
	return sse.NewTranslator(src, c.step)
}

// chatStream is the state of a chunk stream's translation.
type chatStream struct {
	rd         *sse.Reader
	errorEvent func(status int, message string) []byte
	out        *bytes.Buffer // the step's
	started    bool
	block      int    // index of the open block; -1: none
	kind       string // its type
	next       int    // index of the next block
	tools      map[int64]int
	stop       string
	usage      gjson.Result
}

// emit writes an event.
func (c *chatStream) emit(name string, data []byte) {
	c.out.WriteString("event: ")
	c.out.WriteString(name)
	c.out.WriteString("\ndata: ")
	c.out.Write(data)
	c.out.WriteString("\n\n")
}

// step reads one chunk and writes its events to out, or ends the stream.
func (c *chatStream) step(out *bytes.Buffer) error {
	c.out = out
	ev, err := c.rd.Next()
	if err != nil {
		if err == io.EOF && c.stop != "" { // finished, without [DONE]
			c.finish()
		}
		return err
	}
	data := bytes.TrimSpace(ev.Data)
	if len(data) == 0 {
		return nil
	}
	if string(data) == "[DONE]" {
		if !c.started {
			return io.ErrUnexpectedEOF
		}
		c.finish()
		return io.EOF
	}
	chunk := gjson.ParseBytes(data)
	if e := chunk.Get("error"); e.Exists() {
		ue := ErrorOf(statusFromChunk(e), []byte(chunk.Raw))
		c.out.Write(c.errorEvent(ue.Status, ue.Message))
		return io.EOF
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
	return nil
}

// open starts a block of kind unless one is open (a text block goes on;
// each tool call starts its own).
func (c *chatStream) open(kind, start string) {
	if c.block >= 0 && kind == "text" && c.kind == "text" {
		return
	}
	c.closeBlock()
	c.block, c.kind = c.next, kind
	c.next++
	c.emit("content_block_start", []byte(`{"type":"content_block_start","index":`+strconv.Itoa(c.block)+`,"content_block":`+start+`}`))
}

// closeBlock stops the open block, if one is.
func (c *chatStream) closeBlock() {
	if c.block < 0 {
		return
	}
	c.emit("content_block_stop", []byte(`{"type":"content_block_stop","index":`+strconv.Itoa(c.block)+`}`))
	c.block = -1
}

// finish emits the end of the message.
func (c *chatStream) finish() {
	c.closeBlock()
	c.emit("message_delta", []byte(`{"type":"message_delta","delta":{"stop_reason":"`+cmp.Or(c.stop, "end_turn")+`","stop_sequence":null},"usage":`+string(msgUsage(c.usage))+`}`))
	c.emit("message_stop", []byte(`{"type":"message_stop"}`))
}
