package openai

import (
	"bytes"
	"errors"
	"slices"

	"github.com/caddy-relay/relay/internal/rope"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// openArray reads the '[' that opens an array of T, and reports whether it
// did: null is read as no array, and any other value fails with the error
// unmarshaling it into []T gives.
func openArray[T any](dec *jsontext.Decoder) (bool, error) {
	switch dec.PeekKind() {
	case '[':
		_, err := dec.ReadToken()
		return err == nil, err
	case 'n':
		_, err := dec.ReadToken()
		return false, err
	}
	var wrong []T
	return false, json.UnmarshalDecode(dec, &wrong)
}

// eachElement decodes the array (or null) dec holds next one element at
// a time into elem, made anew before each by fresh (nil: zeroed), and
// calls f with its index: the array is never held whole. It returns how
// many elements there were.
func eachElement[T any](dec *jsontext.Decoder, elem *T, fresh func() T, f func(i int)) (int, error) {
	if ok, err := openArray[T](dec); !ok {
		return 0, err
	}
	n := 0
	for ; dec.PeekKind() != ']'; n++ {
		var next T
		if fresh != nil {
			next = fresh()
		}
		*elem = next
		if err := json.UnmarshalDecode(dec, elem); err != nil {
			return n, err
		}
		f(n)
	}
	_, err := dec.ReadToken()
	return n, err
}

// sep writes what goes before one more element of the comma-separated
// list r holds.
func sep(r *rope.Rope) {
	if r.Len() > 0 {
		_ = r.WriteByte(',')
	}
}

// placeholder marks the place of an array in a request whose arrays are
// held in ropes, for writeSpliced.
var placeholder = jsontext.Value("[]")

// spliced lists the array members of a request that hold placeholders:
// their names, and their elements (comma-separated) in ropes.
type spliced []splicedArray

// splicedArray is one array member of spliced.
type splicedArray struct {
	name  string
	elems *rope.Rope
}

// add lists the array name, of elems, and returns its placeholder.
func (s *spliced) add(name string, elems *rope.Rope) jsontext.Value {
	*s = append(*s, splicedArray{name, elems})
	return placeholder
}

// writeSpliced writes req as JSON to dst, with the elements of each array
// of arrays in place of its placeholder. An array member's name occurs
// first, unescaped, where the member is: what comes before it are
// scalars, strings and placeholders. dst grows once, to the size it ends
// up with.
func writeSpliced(dst *bytes.Buffer, req any, arrays spliced) error {
	frame, err := json.Marshal(req)
	if err != nil {
		return err
	}
	type cut struct {
		at    int // just after the placeholder's '['
		elems *rope.Rope
	}
	cuts := make([]cut, 0, len(arrays))
	n := len(frame)
	for _, a := range arrays {
		i := bytes.Index(frame, []byte(`"`+a.name+`":[]`))
		if i < 0 {
			return errors.New("no placeholder for " + a.name)
		}
		cuts = append(cuts, cut{i + len(a.name) + len(`"":[`), a.elems})
		n += a.elems.Len()
	}
	slices.SortFunc(cuts, func(a, b cut) int { return a.at - b.at })
	dst.Grow(n)
	prev := 0
	for _, c := range cuts {
		dst.Write(frame[prev:c.at])
		_, _ = c.elems.WriteTo(dst)
		prev = c.at
	}
	dst.Write(frame[prev:])
	return nil
}

// jsonStrings is an array of strings (stop sequences), encoded again one
// at a time as it is decoded.
type jsonStrings struct {
	out   rope.Rope // the strings, comma-separated
	s     string    // the one being decoded
	buf   []byte
	array bool // an array was decoded, if an empty one
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom: an array of strings,
// or null for none.
func (js *jsonStrings) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	if ok, err := openArray[string](dec); !ok {
		return err
	}
	js.array = true
	for dec.PeekKind() != ']' {
		if err := js.decode(dec); err != nil {
			return err
		}
	}
	_, err := dec.ReadToken()
	return err
}

// decode adds the string dec holds next (null is "").
func (js *jsonStrings) decode(dec *jsontext.Decoder) error {
	js.s = ""
	if err := json.UnmarshalDecode(dec, &js.s); err != nil {
		return err
	}
	js.add()
	return nil
}

// add encodes js.s, the string just decoded.
func (js *jsonStrings) add() {
	js.array = true
	sep(&js.out)
	js.buf, _ = jsontext.AppendQuote(js.buf[:0], js.s) // valid UTF-8: it was decoded
	_, _ = js.out.Write(js.buf)
}

// jsonString is s as a JSON string.
func jsonString(s string) jsontext.Value {
	b, _ := jsontext.AppendQuote(nil, s)
	return b
}

// kindName names a JSON kind as a refusal says it.
func kindName(k jsontext.Kind) string {
	switch k {
	case '"':
		return "string"
	case '0':
		return "number"
	case 't', 'f':
		return "boolean"
	case 'n':
		return "null"
	case '{':
		return "object"
	case '[':
		return "array"
	}
	return "value"
}

// unknownParam names the first member of an object's unknown members.
func unknownParam(v jsontext.Value) string {
	dec := jsontext.NewDecoder(bytes.NewReader(v))
	if _, err := dec.ReadToken(); err != nil {
		return ""
	}
	tok, err := dec.ReadToken()
	if err != nil || tok.Kind() != '"' {
		return ""
	}
	name := tok.String()
	return name[:min(len(name), 64)]
}
