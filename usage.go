package relay

import (
	"math"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/tidwall/gjson"
)

// usage is the token usage of one reply, as the upstream reports it.
type usage struct {
	input        int64 // uncached input tokens
	output       int64
	cacheRead    int64
	cacheWrite   int64 // all cache writes, 1h ones included
	cacheWrite1h int64 // of which written with the 1-hour TTL
	// content weighs the content of the deltas read (settle.go), for an
	// estimate of the output when the final count never comes
	content int64
	final   bool // a message_delta gave the final counts
	// stopped says that a message_delta gave the message's stop_reason: the
	// answer is whole, even if its stream then ends without message_stop
	stopped bool
	// webSearches is usage.server_tool_use.web_search_requests: the web
	// searches the answer made, each priced beside the tokens (an int32
	// beside the flags: a usage is copied with every request)
	webSearches int32
}

// prompt is every input token of the request, cached or not: what
// Anthropic's long-prompt price tiers are measured on.
func (u usage) prompt() int64 { return u.input + u.cacheRead + u.cacheWrite }

// total is every token of the request and its answer.
func (u usage) total() int64 { return u.prompt() + u.output }

// read takes the counts present in an Anthropic usage object.
// Fields the object lacks keep their value: a message_delta carries the
// final, cumulative output count and may or may not repeat the input side.
func (u *usage) read(obj gjson.Result) {
	if !obj.IsObject() {
		return
	}
	obj.ForEach(func(k, v gjson.Result) bool {
		switch k.Str {
		case "input_tokens":
			u.input = v.Int()
		case "output_tokens":
			u.output = v.Int()
		case "cache_read_input_tokens":
			u.cacheRead = v.Int()
		case "cache_creation_input_tokens":
			u.cacheWrite = v.Int()
		case "cache_creation":
			if h := v.Get("ephemeral_1h_input_tokens"); h.Exists() {
				u.cacheWrite1h = h.Int()
			}
		case "server_tool_use": // null or absent in an event that does not say
			if n := v.Get("web_search_requests"); n.Exists() {
				u.webSearches = int32(min(max(n.Int(), 0), math.MaxInt32))
			}
		}
		return true
	})
}

// fromMessage reads the usage of a complete, non-streaming reply.
func (u *usage) fromMessage(body []byte) {
	u.read(gjson.Get(jsonscan.String(body), "usage"))
}

// fromEvent reads the usage an SSE event carries: message_start has the
// input side and a first output count, and each message_delta the
// cumulative counts so far (the server tools' included), so the last one
// wins. Nothing is ever summed but the weight of the content deltas.
func (u *usage) fromEvent(name, data []byte) {
	// a string view of the event, valid for this call: only numbers are kept
	s := jsonscan.String(data)
	switch string(name) {
	case "message_start":
		u.read(gjson.Get(s, "message.usage"))
	case "content_block_delta":
		u.content += deltaContent(data)
	case "message_delta":
		if obj := gjson.Get(s, "usage"); obj.IsObject() {
			u.read(obj)
			u.final = true
		}
		if gjson.Get(s, "delta.stop_reason").Type == gjson.String {
			u.stopped = true
		}
	}
}
