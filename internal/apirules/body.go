package apirules

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/tidwall/gjson"
)

// notJSON is why body is not a JSON object, as Anthropic's API says it,
// or "" when it is one. The API parses every body before it validates it:
// a body the relay spliced wrong (a span cut, a value moved) is refused
// here, whatever its fields.
func notJSON(body []byte) string {
	if !gjson.ValidBytes(body) {
		return "The request body is not valid JSON: " + syntaxDetail(body)
	}
	if t := bytes.TrimLeft(body, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return "The request body is not a JSON object"
	}
	return ""
}

// syntaxDetail says where body stops being JSON, in the API's words: what
// is wrong, then the line, column and character (0-based) of it.
func syntaxDetail(body []byte) string {
	var raw json.RawMessage
	var se *json.SyntaxError
	if err := json.Unmarshal(body, &raw); !errors.As(err, &se) {
		// a flaw encoding/json takes (gjson is the stricter on some)
		return "unexpected character: line 1 column 1 (char 0)"
	}
	at, what := int(se.Offset)-1, "unexpected character"
	if int(se.Offset) >= len(body) && se.Error() == "unexpected end of JSON input" {
		at, what = len(body), "unexpected end of data"
	}
	at = max(at, 0)
	line, col := 1+bytes.Count(body[:at], []byte("\n")), at+1
	if nl := bytes.LastIndexByte(body[:at], '\n'); nl >= 0 {
		col = at - nl
	}
	return fmt.Sprintf("%s: line %d column %d (char %d)", what, line, col, utf8.RuneCount(body[:at]))
}

// maxBreakpoints is how many blocks may carry cache_control in one
// request.
const maxBreakpoints = 4

// breakpoints counts the blocks of a JSON body that carry cache_control:
// its tools, its system blocks and its messages' content blocks. A body
// without the word pays no parse.
func breakpoints(body []byte) int {
	if !bytes.Contains(body, []byte(`"cache_control"`)) {
		return 0
	}
	n := 0
	count := func(_, b gjson.Result) bool {
		if c := b.Get("cache_control"); c.Exists() && c.Type != gjson.Null {
			n++
		}
		return true
	}
	root := parse(body)
	root.Get("tools").ForEach(count)
	if s := root.Get("system"); s.IsArray() {
		s.ForEach(count)
	}
	root.Get("messages").ForEach(func(_, m gjson.Result) bool {
		if c := m.Get("content"); c.IsArray() {
			c.ForEach(count)
		}
		return true
	})
	return n
}

// tooManyBreakpoints is the API's refusal of a body with more than four
// cache_control blocks, or "".
func tooManyBreakpoints(body []byte) string {
	if n := breakpoints(body); n > maxBreakpoints {
		return fmt.Sprintf("A maximum of %d blocks with cache_control may be provided. Found %d.", maxBreakpoints, n)
	}
	return ""
}

// anthropicJSON refuses, as Anthropic's API (and Vertex's, which passes
// the body on to it) does, a body that is not a JSON object or that has
// too many cache breakpoints.
func (r *Rules) anthropicJSON(body []byte) *Refusal {
	if msg := notJSON(body); msg != "" {
		return r.invalid(msg)
	}
	if msg := tooManyBreakpoints(body); msg != "" {
		return r.invalid(msg)
	}
	return nil
}

// bedrockJSON is anthropicJSON on Bedrock: its ValidationException.
func (r *Rules) bedrockJSON(body []byte) *Refusal {
	if notJSON(body) != "" {
		return r.bedrockRefusal(400, "ValidationException", "Malformed input request, please reformat your input and try again.")
	}
	if msg := tooManyBreakpoints(body); msg != "" {
		return r.bedrockRefusal(400, "ValidationException", msg)
	}
	return nil
}
