package jsonscan

import (
	"bytes"
	"errors"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/go-json-experiment/json/jsontext"
)

// jsontextVerdict is the oracle: whether jsontext, with its default
// options (no duplicate names, valid UTF-8), reads b as exactly one value
// with nothing but whitespace after it, and the error it gives when not.
func jsontextVerdict(b []byte) error {
	dec := jsontext.NewDecoder(bytes.NewReader(b))
	if _, err := dec.ReadValue(); err != nil {
		return err
	}
	if _, err := dec.ReadToken(); err != io.EOF {
		if err == nil {
			err = errors.New("data after the value")
		}
		return err
	}
	return nil
}

// member is a top-level member: its raw name and raw value.
type member struct{ name, value string }

// jsontextMembers are the members of the top-level object b, which
// jsontext accepts, as it reads them.
func jsontextMembers(t *testing.T, b []byte) []member {
	dec := jsontext.NewDecoder(bytes.NewReader(b))
	if _, err := dec.ReadToken(); err != nil {
		t.Fatal(err)
	}
	var out []member
	for dec.PeekKind() == '"' {
		name, err := dec.ReadValue()
		if err != nil {
			t.Fatal(err)
		}
		name = bytes.Clone(name)
		v, err := dec.ReadValue()
		if err != nil {
			t.Fatal(err)
		}
		if end := int(dec.InputOffset()); string(b[end-len(v):end]) != string(v) {
			t.Fatalf("jsontext's offset %d does not end its value %q", end, v)
		}
		out = append(out, member{string(name), string(v)})
	}
	return out
}

// members reads the top-level object as the relay's inspection does: its
// members' raw names and values, each value checked to end at InputOffset.
func members(s *Scanner, b []byte) ([]member, error) {
	s.Reset(b)
	if err := s.ReadObjectStart(); err != nil {
		return nil, err
	}
	var out []member
	for {
		name, err := s.NextName()
		if err != nil {
			return nil, err
		}
		if name == nil {
			break
		}
		v, err := s.ReadValue()
		if err != nil {
			return nil, err
		}
		if end := s.InputOffset(); string(b[end-len(v):end]) != string(v) {
			return nil, errors.New("InputOffset does not end the value")
		}
		out = append(out, member{string(name), string(v)})
	}
	return out, s.End()
}

// walk reads the next value with the calls that walk into containers,
// never ReadValue for one: the other way through the scanner.
func walk(s *Scanner) error {
	switch s.PeekKind() {
	case '{':
		if err := s.ReadObjectStart(); err != nil {
			return err
		}
		for {
			name, err := s.NextName()
			if err != nil || name == nil {
				return err
			}
			if err := walk(s); err != nil {
				return err
			}
		}
	case '[':
		if err := s.ReadArrayStart(); err != nil {
			return err
		}
		for {
			more, err := s.NextElement()
			if err != nil || !more {
				return err
			}
			if err := walk(s); err != nil {
				return err
			}
		}
	}
	_, err := s.ReadValue()
	return err
}

// fuzzSeeds are the tricky cases the fuzzer starts from.
var fuzzSeeds = []string{
	// escapes and surrogates
	`"\" \\ \/ \b \f \n \r \t \u0000 \u001f \u00e9 \uFFFF \uD83D\uDE00"`,
	`"\ud800"`, `"\udc00"`, `"\ud800\ud800"`, `"\udc00\ud800"`, `"\ud800\u0041"`, `"\ud800x"`, `"\ud800\"`,
	`"\ud83d\ude00\ud83d"`, `"\u12"`, `"\u12g4"`, `"\x"`, `"\'"`, `"\U0041"`, `"\`,
	// UTF-8
	"\"\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e\"", "\"\xff\"", "\"\xc3\"", "\"\xc3\xa9\"", "\"\xed\xa0\x80\"",
	"\"\xf4\x90\x80\x80\"", "\"\xef\xbf\xbe\"", "\"\xc0\xaf\"", "\"abcdefgh\xe2\x82\xac ijklmnop\"", "\"\xe2\x82",
	// control characters, NUL, DEL, BOM
	"\"a\x00b\"", "\"\x1f\"", "\"\x7f\"", "\"tab\there\"", "\xef\xbb\xbf{}", "{}\x00", "\x00",
	// numbers
	`-0`, `0`, `1e5`, `1E+5`, `1e-5`, `01`, `-01`, `1.`, `.5`, `-`, `+1`, `1.5e`, `1e+`, `-0.0e-0`,
	`1e99999999999999999999`, `123456789012345678901234567890`, `0x10`, `1_000`, `NaN`, `Infinity`,
	// literals
	`true`, `false`, `null`, `tru`, `nul`, `True`, `nullx`, `[true,false,null]`,
	// whitespace
	" \t\r\n{ \"a\" : [ 1 , 2 ] } \n", "\v{}", "\f{}", "{}\u00a0", "\u2028{}",
	// structure
	`{}`, `[]`, `{"a":1}`, `[1,]`, `{"a":1,}`, `{,}`, `[,1]`, `{"a"}`, `{"a":}`, `{"a" 1}`, `{1:2}`, `{"a":1 "b":2}`,
	`[1 2]`, `{"a":1}}`, `[]]`, `{} {}`, `{}x`, `"a" "b"`, `{"a":[}]`, `[{]}`,
	// duplicates, spelled differently
	`{"a":1,"a":2}`, `{"a":1,"\u0061":2}`, `{"\/":1,"/":2}`, `{"a":{"b":1,"b":2}}`, `{"a":[{"b":1},{"b":2}]}`,
	`{"a":{"x":1},"b":{"x":1}}`, `{"é":1,"\u00e9":2}`, `{"\ud83d\ude00":1,"😀":2}`, `{"":1,"":2}`, `{"a~b/c":{"d":1,"d":2}}`,
	`{"model":"claude-sonnet-4-5","max_tokens":16,"metadata":{"user_id":"u"},"messages":[{"role":"user","content":"hi"}]}`,
	`{"model":"a","mod\u0065l":"b"}`,
	// truncated
	``, ` `, `{`, `[`, `{"a"`, `{"a":`, `{"a":1`, `{"a":1,`, `"abc`, `[1,2`, `{"a":"b\`,
	// nesting (MaxDepth itself is TestValid's: seeds that large slow the
	// fuzzer down more than they teach it)
	strings.Repeat("[", 100) + strings.Repeat("]", 100),
	strings.Repeat(`{"a":`, 50) + "1" + strings.Repeat("}", 50),
	strings.Repeat(`[{"a":`, 30) + "1" + strings.Repeat("}]", 30),
	strings.Repeat("[", 200),
	// a large object: the index
	largeObject(40, ""), largeObject(40, `,"k7":0`), largeObject(40, `,"k\u0037":0`), `{"o":` + largeObject(20, "") + `,` + strings.TrimPrefix(largeObject(20, `,"k3":1`), "{"),
}

// largeObject is an object of n members k0...kn-1, with extra before its
// closing brace.
func largeObject(n int, extra string) string {
	var b strings.Builder
	b.WriteString("{")
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(`"k`)
		b.WriteString(strconv.Itoa(i))
		b.WriteString(`":{"a":1,"b":[1,{"c":2}]}`)
	}
	b.WriteString(extra)
	b.WriteString("}")
	return b.String()
}

// FuzzScanAgreesWithJSONText holds the scanner to jsontext, the oracle:
// on any bytes it accepts exactly what jsontext accepts, read whole or
// walked into, and of an object the same members, raw names and values,
// whose strings both unquote alike; a duplicate name is reported at the
// same JSON Pointer.
// Long run: go test -run '^$' -fuzz FuzzScanAgreesWithJSONText -fuzztime 5m ./internal/jsonscan
func FuzzScanAgreesWithJSONText(f *testing.F) {
	for _, seed := range fuzzSeeds {
		f.Add([]byte(seed))
	}
	var s Scanner
	f.Fuzz(func(t *testing.T, b []byte) {
		want := jsontextVerdict(b)
		got := s.Valid(b)
		if (got == nil) != (want == nil) {
			t.Fatalf("%q: scanner says %v, jsontext says %v", b, got, want)
		}
		var se *Error
		if got != nil && !errors.As(got, &se) {
			t.Fatalf("%q: error %T is not an *Error", b, got)
		}
		if se != nil && (se.Offset < 0 || se.Offset > len(b)) {
			t.Fatalf("%q: error offset %d out of the document", b, se.Offset)
		}
		if errors.Is(got, ErrDuplicateName) && errors.Is(want, jsontext.ErrDuplicateName) {
			var jse *jsontext.SyntacticError
			if errors.As(want, &jse) && string(jse.JSONPointer) != se.Pointer {
				t.Fatalf("%q: duplicate at %q, jsontext says %q", b, se.Pointer, jse.JSONPointer)
			}
		}

		s.Reset(b)
		err := walk(&s)
		if err == nil {
			err = s.End()
		}
		if (err == nil) != (want == nil) {
			t.Fatalf("%q: walked, scanner says %v, jsontext says %v", b, err, want)
		}

		if KindOf(bytes.TrimLeft(b, " \t\r\n")) != '{' {
			return
		}
		ours, err := members(&s, b)
		if (err == nil) != (want == nil) {
			t.Fatalf("%q: member by member, scanner says %v, jsontext says %v", b, err, want)
		}
		if want != nil {
			return
		}
		theirs := jsontextMembers(t, b)
		if len(ours) != len(theirs) {
			t.Fatalf("%q: %d members, jsontext reads %d", b, len(ours), len(theirs))
		}
		for i := range ours {
			if ours[i] != theirs[i] {
				t.Fatalf("%q: member %d is %q, jsontext reads %q", b, i, ours[i], theirs[i])
			}
			for _, raw := range []string{ours[i].name, ours[i].value} {
				if raw[0] != '"' {
					continue
				}
				mine := AppendUnquote(nil, []byte(raw))
				their, err := jsontext.AppendUnquote(nil, []byte(raw))
				if err != nil || string(mine) != string(their) {
					t.Fatalf("%q unquotes to %q, jsontext says %q (%v)", raw, mine, their, err)
				}
			}
		}
	})
}
