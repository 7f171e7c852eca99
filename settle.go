package relay

import (
	"unsafe"

	"github.com/tidwall/gjson"
)

// The estimate of a stream's output. What a client was sent is weighed as
// a tokenizer would count it: each word (a run of ASCII letters and
// digits), each punctuation mark, each other character (CJK scripts take
// about one token a character), newlines and tabs, in twentieths of a
// token. The weights were fitted to the published Claude tokenizer on
// English prose, technical docs, licenses, Go and Python code, JSON and
// Chinese, streamed in deltas of one to six tokens: the estimate is within
// 4% of the real count on each, where bytes/4 is off by up to 32% (code and
// JSON have far more tokens a byte than prose).
const (
	unitsPerToken = 20
	unitsWord     = 21
	unitsPunct    = 14
	unitsOther    = 18 // a character outside ASCII
	unitsNewline  = 25
	unitsTab      = 22
)

// estimatedOutput is the output of the content counted so far, rounded up.
func (u *usage) estimatedOutput() int64 {
	return (u.content + unitsPerToken - 1) / unitsPerToken
}

// deltaContent weighs the content of a content_block_delta event (text,
// a tool's input JSON, thinking), in units; 0 for any other delta.
func deltaContent(data []byte) int64 {
	delta := gjson.Get(unsafe.String(unsafe.SliceData(data), len(data)), "delta")
	if !delta.IsObject() {
		return 0
	}
	return objectContent(delta.Raw)
}

// objectContent weighs the text, partial_json and thinking strings of a
// delta object, which is valid JSON (the event was checked).
func objectContent(obj string) (units int64) {
	i := 1 // past '{'
	for {
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] != '"' {
			return units
		}
		keyEnd := stringEnd(obj, i)
		key := obj[i+1 : keyEnd-1]
		i = skipSpace(obj, keyEnd)
		i = skipSpace(obj, i+1) // past ':'
		if i >= len(obj) {
			return units
		}
		if obj[i] == '"' {
			end := stringEnd(obj, i)
			if key == "text" || key == "partial_json" || key == "thinking" {
				units += stringContent(obj[i+1 : end-1])
			}
			i = end
		} else {
			i = valueEnd(obj, i)
		}
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] != ',' {
			return units
		}
		i++
	}
}

// stringContent weighs the body of a JSON string as the text it encodes.
func stringContent(s string) (units int64) {
	word := false
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == '\\' && i+1 < len(s) {
			i++
			switch s[i] {
			case 'n':
				c = '\n'
			case 't':
				c = '\t'
			case 'r', 'b', 'f':
				c = ' '
			case 'u':
				c = ' '
				if i+4 < len(s) {
					r := hex4(s[i+1 : i+5])
					i += 4
					switch {
					case r >= 0xdc00 && r <= 0xdfff: // the second half of a pair, counted with the first
						continue
					case r >= 0x80:
						units += unitsOther
						word = false
						continue
					}
					c = byte(r)
				}
			default:
				c = s[i] // \" \\ \/
			}
		}
		switch {
		case c >= 0x80:
			if c >= 0xc0 { // the first byte of a character
				units += unitsOther
			}
			word = false
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
			if !word {
				units += unitsWord
			}
			word = true
		default:
			word = false
			switch c {
			case ' ', '\r':
			case '\n':
				units += unitsNewline
			case '\t':
				units += unitsTab
			default:
				units += unitsPunct
			}
		}
	}
	return units
}

// hex4 reads four hex digits; a bad digit reads as 0.
func hex4(s string) (r int) {
	for i := 0; i < 4; i++ {
		c := s[i]
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			c = 0
		}
		r = r<<4 | int(c)
	}
	return r
}

func skipSpace(s string, i int) int {
	for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
		i++
	}
	return i
}

// stringEnd returns the index just past the JSON string that starts at i.
func stringEnd(s string, i int) int {
	for i++; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(s)
}

// valueEnd returns the index just past the JSON value (not a string) that
// starts at i.
func valueEnd(s string, i int) int {
	depth := 0
	for ; i < len(s); i++ {
		switch s[i] {
		case '"':
			i = stringEnd(s, i) - 1
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i
			}
			depth--
			if depth == 0 {
				return i + 1
			}
		case ',':
			if depth == 0 {
				return i
			}
		}
	}
	return i
}
