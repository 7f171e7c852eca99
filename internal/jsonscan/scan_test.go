package jsonscan

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math/bits"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"
)

func TestValid(t *testing.T) {
	tests := []struct {
		doc    string
		err    error // nil: accepted
		offset int
	}{
		{`{"a":[1,-0,1e5,2.5E-3,true,false,null,"x"]}`, nil, 0},
		{" \t\r\n{}\n", nil, 0},
		{`"\ud83d\ude00"`, nil, 0},
		{"\"\xe6\x97\xa5\xe6\x9c\xac\"", nil, 0},
		{``, io.ErrUnexpectedEOF, 0},
		{`{"a":1`, io.ErrUnexpectedEOF, 6},
		{`{"a":"b`, io.ErrUnexpectedEOF, 7},
		{"\"\xe6\x97", io.ErrUnexpectedEOF, 3},
		{`{"a":1,}`, ErrSyntax, 7},
		{`[1,]`, ErrSyntax, 3},
		{`{"a":1} x`, ErrSyntax, 8},
		{`{} {}`, ErrSyntax, 3},
		{`01`, ErrSyntax, 1},
		{`1.`, io.ErrUnexpectedEOF, 2},
		{`.5`, ErrSyntax, 0},
		{`tru`, io.ErrUnexpectedEOF, 3},
		{`trUe`, ErrSyntax, 2},
		{"\"a\x01\"", ErrSyntax, 2},
		{`"\x"`, ErrSyntax, 1},
		{`"\ud800"`, ErrSyntax, 1},
		{`"\udc00\ud800"`, ErrSyntax, 1},
		{`"\ud800\ud800"`, ErrSyntax, 1},
		{"\"ab\xffcd\"", ErrInvalidUTF8, 3},
		{"\"\xed\xa0\x80\"", ErrInvalidUTF8, 1}, // an encoded surrogate
		{"\xef\xbb\xbf{}", ErrSyntax, 0},        // a BOM
		{`{"a":1,"a":2}`, ErrDuplicateName, 7},
		{`{"a":1,"\u0061":2}`, ErrDuplicateName, 7},
		{strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth), nil, 0},
		{strings.Repeat("[", MaxDepth+1) + strings.Repeat("]", MaxDepth+1), ErrMaxDepth, MaxDepth},
		{strings.Repeat(`{"":`, MaxDepth) + "0" + strings.Repeat("}", MaxDepth), nil, 0},
		{strings.Repeat(`{"":`, MaxDepth+1) + "0" + strings.Repeat("}", MaxDepth+1), ErrMaxDepth, 4 * MaxDepth},
	}
	var s Scanner
	for _, tt := range tests {
		name := tt.doc
		if len(name) > 40 {
			name = name[:40] + "..."
		}
		err := s.Valid([]byte(tt.doc))
		if tt.err == nil {
			if err != nil {
				t.Errorf("%q: %v", name, err)
			}
			continue
		}
		var se *Error
		if !errors.As(err, &se) || !errors.Is(err, tt.err) || se.Offset != tt.offset {
			t.Errorf("%q: error %v, want %v at offset %d", name, err, tt.err, tt.offset)
		}
	}
}

func TestErrorText(t *testing.T) {
	var s Scanner
	for doc, want := range map[string]string{
		`{"a":1 x}`:          `jsonscan: invalid character 'x' after object value (expecting ',' or '}') at offset 7`,
		`{"model":1,"model"`: `jsonscan: duplicate object member name "model" at offset 11`,
		"\"\xff\"":           `jsonscan: invalid UTF-8 within string at offset 1`,
		`[1`:                 `jsonscan: unexpected EOF at offset 2`,
		`"\q"`:               `jsonscan: invalid escape sequence "\\q" in string at offset 1`,
	} {
		if err := s.Valid([]byte(doc)); err == nil || err.Error() != want {
			t.Errorf("%q: %v, want %s", doc, err, want)
		}
	}
}

func TestDuplicateNameAndPointer(t *testing.T) {
	for doc, want := range map[string][2]string{
		`{"model":"a","model":"b"}`:                              {"model", "/model"},
		`{"model":"a","mod\u0065l":"b"}`:                         {"model", "/model"},
		`{"model":"m","metadata":{"user_id":"a","user_id":"b"}}`: {"user_id", "/metadata/user_id"},
		`{"a":[{"b":1},{"x":"}","x":2}]}`:                        {"x", "/a/1/x"},
		`{"a\/b~":{"c\"":[0,[{"d":1,"d":2}]]}}`:                  {"d", "/a~1b~0/c\"/1/0/d"},
		`[0,{"":1,"":2}]`:                                        {"", "/1/"},
	} {
		var s Scanner
		err := s.Valid([]byte(doc))
		var se *Error
		if !errors.As(err, &se) || se.Err != ErrDuplicateName || se.Name != want[0] || se.Pointer != want[1] {
			t.Errorf("%s: %#v, want name %q at %q", doc, err, want[0], want[1])
		}
	}
}

// TestManyMembers: a hostile object of 100,000 members is checked in time
// linear in its size, whether all its names differ or its last repeats
// one, escaped or not, and objects nested in it have names of their own.
func TestManyMembers(t *testing.T) {
	const n = 100_000
	var b strings.Builder
	b.WriteString(`{`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(`"` + strconv.Itoa(i) + `":`)
		if i%1000 == 0 {
			b.WriteString(largeObject(40, "")) // indexed too, inside the other
		} else {
			b.WriteString("0")
		}
	}
	distinct := b.String() + "}"
	var s Scanner
	start := time.Now()
	for _, tt := range []struct {
		doc string
		dup bool
	}{
		{distinct, false},
		{b.String() + `,"99999":1}`, true},
		{b.String() + `,"\u0035":1}`, true},
		{b.String() + `,"k1":1}`, false}, // a name of the nested objects only
	} {
		err := s.Valid([]byte(tt.doc))
		if tt.dup != errors.Is(err, ErrDuplicateName) || !tt.dup && err != nil {
			t.Errorf("%s: %v", tt.doc[len(tt.doc)-20:], err)
		}
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("4 objects of %d members took %v", n, d)
	}
}

// TestNamesAgreeWithJSONText runs random documents of objects large and
// small, nested, whose names often repeat (some escaped), through the
// scanner and jsontext: the index's insertions and removals must never
// lose a name.
func TestNamesAgreeWithJSONText(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var gen func(b *strings.Builder, depth int)
	gen = func(b *strings.Builder, depth int) {
		if depth > 3 || rng.IntN(3) == 0 {
			b.WriteString(strconv.Itoa(rng.IntN(10)))
			return
		}
		if rng.IntN(4) == 0 {
			b.WriteString("[")
			for i := range rng.IntN(4) {
				if i > 0 {
					b.WriteString(",")
				}
				gen(b, depth+1)
			}
			b.WriteString("]")
			return
		}
		b.WriteString("{")
		members := rng.IntN(3 * linearMax)
		if depth > 1 && rng.IntN(4) != 0 {
			members = rng.IntN(6) // most deep objects small: documents stay short
		}
		space := members + rng.IntN(3) // few names to draw from: duplicates
		for i := range members {
			if i > 0 {
				b.WriteString(",")
			}
			k := rng.IntN(space)
			if rng.IntN(8) == 0 {
				b.WriteString(`"\u006e` + strconv.Itoa(k) + `":`) // "n" escaped
			} else {
				b.WriteString(`"n` + strconv.Itoa(k) + `":`)
			}
			gen(b, depth+1)
		}
		b.WriteString("}")
	}
	var s Scanner
	accepted := 0
	for range 3000 {
		var b strings.Builder
		gen(&b, 0)
		doc := []byte(b.String())
		want := jsontextVerdict(doc)
		got := s.Valid(doc)
		if (got == nil) != (want == nil) {
			t.Fatalf("%s: scanner says %v, jsontext says %v", doc, got, want)
		}
		if got == nil {
			accepted++
		}
	}
	t.Logf("%d of 3000 accepted", accepted)
	if accepted < 300 || accepted > 2700 {
		t.Errorf("%d of 3000 accepted: the documents test too little", accepted)
	}
}

func TestWalk(t *testing.T) {
	doc := []byte(` {"model" : "m", "tools":[{"type":"web_search"}, 7, {"t\u0079pe":"x","a":{}}], "n":null} `)
	var s Scanner
	s.Reset(doc)
	if s.PeekKind() != '{' || s.ReadObjectStart() != nil {
		t.Fatal("no object")
	}
	var got []string
	for {
		name, err := s.NextName()
		if err != nil {
			t.Fatal(err)
		}
		if name == nil {
			break
		}
		got = append(got, string(name))
		if string(name) != `"tools"` {
			v, err := s.ReadValue()
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, string(v)+"@"+strconv.Itoa(s.InputOffset()))
			continue
		}
		if s.PeekKind() != '[' || s.ReadArrayStart() != nil {
			t.Fatal("no array")
		}
		for {
			more, err := s.NextElement()
			if err != nil {
				t.Fatal(err)
			}
			if !more {
				break
			}
			if s.PeekKind() != '{' {
				v, _ := s.ReadValue()
				got = append(got, "elem "+string(v))
				continue
			}
			if err := s.ReadObjectStart(); err != nil {
				t.Fatal(err)
			}
			for {
				name, err := s.NextName()
				if err != nil {
					t.Fatal(err)
				}
				if name == nil {
					break
				}
				v, err := s.ReadValue()
				if err != nil {
					t.Fatal(err)
				}
				got = append(got, string(AppendUnquote(nil, name))+"="+string(v))
			}
		}
	}
	if err := s.End(); err != nil {
		t.Fatal(err)
	}
	want := []string{`"model"`, `"m"@15`, `"tools"`, `type="web_search"`, `elem 7`, `type="x"`, `a={}`, `"n"`, `null@87`}
	if strings.Join(got, " | ") != strings.Join(want, " | ") {
		t.Errorf("got  %q\nwant %q", got, want)
	}
}

func TestOutOfTurn(t *testing.T) {
	var s Scanner
	s.Reset([]byte(`{"a":[1]} `))
	if _, err := s.NextName(); !errors.Is(err, ErrMisuse) {
		t.Errorf("NextName before the object: %v", err)
	}
	if err := s.ReadArrayStart(); !errors.Is(err, ErrSyntax) {
		t.Errorf("ReadArrayStart of an object: %v", err)
	}
	if err := s.End(); err == nil {
		t.Error("End before the value")
	}
	_ = s.ReadObjectStart()
	if _, err := s.NextElement(); !errors.Is(err, ErrMisuse) {
		t.Errorf("NextElement in an object: %v", err)
	}
	if _, err := s.NextName(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.NextName(); !errors.Is(err, ErrSyntax) {
		t.Errorf("a second name before the value: %v", err)
	}
	s.Reset([]byte(`{"a":[1]} `))
	if _, err := s.ReadValue(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ReadValue(); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a second value: %v", err)
	}
	if err := s.End(); err != nil {
		t.Error(err)
	}
}

func TestAppendUnquote(t *testing.T) {
	for raw, want := range map[string]string{
		`""`:                   "",
		`"abc"`:                "abc",
		`"a\"b\\c\/d"`:         `a"b\c/d`,
		`"\b\f\n\r\t"`:         "\b\f\n\r\t",
		`"\u0041\u00e9\u20AC"`: "Aé€",
		`"\ud83d\ude00!"`:      "😀!",
		`"x\u0000y"`:           "x\x00y",
	} {
		if got := string(AppendUnquote([]byte(">"), []byte(raw))); got != ">"+want {
			t.Errorf("%s: %q, want %q", raw, got, want)
		}
	}
	for _, bad := range []string{``, `"`, `"\`, `"\u12`, `"\ud800`, `"\ud800\u12"`} {
		AppendUnquote(nil, []byte(bad)) // must not panic
	}
}

// TestNoAllocations: once a Scanner's buffers have grown, documents cost no
// allocation, with escaped names and large objects too.
func TestNoAllocations(t *testing.T) {
	var s Scanner
	for name, doc := range benchDocs() {
		b := []byte(doc)
		if err := s.Valid(b); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if n := testing.AllocsPerRun(20, func() { _ = s.Valid(b) }); n != 0 {
			t.Errorf("%s: %v allocations", name, n)
		}
	}
}

// TestSpecials checks the word-wide test on every byte at every place of a
// word, among bytes of every kind: it finds the first byte sought.
func TestSpecials(t *testing.T) {
	for c := range 256 {
		sought := c == '"' || c == '\\' || c < 0x20
		for at := range 8 {
			for _, fill := range []byte{'a', ' ', '!', '#', '[', ']', 0x21, 0x5b, 0x5d, 0x7f, 0x80, 0xa1, 0xdc, 0xe3, 0xff} {
				var w [8]byte
				for k := range w {
					w[k] = fill
				}
				w[at] = byte(c)
				m := specials(binary.LittleEndian.Uint64(w[:]))
				if sought != (m != 0) || sought && bits.TrailingZeros64(m)>>3 != at {
					t.Fatalf("byte %#x at %d among %#x: mask %#x", c, at, fill, m)
				}
			}
		}
	}
}

// TestRun checks the string scan against a byte-by-byte one, on strings
// whose bytes sought and bytes from 0x80 up fall at every place of the
// 32-byte and 8-byte steps.
func TestRun(t *testing.T) {
	for n := range 80 {
		for at := range n + 1 {
			for _, c := range []byte{'"', '\\', 0x00, 0x1f, 0xe3, 0x80, 'a'} {
				b := []byte(strings.Repeat("x", n))
				if at < n {
					b[at] = c
				}
				for _, high := range []int{-1, 0, at / 2, n - 1} {
					d := bytes.Clone(b)
					if high >= 0 && high < n && high != at {
						d[high] = 0xc3
					}
					want, wantHigh := len(d), false
					for k, c := range d {
						if c == '"' || c == '\\' || c < 0x20 {
							want = k
							break
						}
						wantHigh = wantHigh || c >= 0x80
					}
					if j, h := run(d, 0); j != want || h != wantHigh {
						t.Fatalf("%q: run = %d, %v; want %d, %v", d, j, h, want, wantHigh)
					}
				}
			}
		}
	}
}

func TestStringSharesTheBytes(t *testing.T) {
	b := []byte(`{"model":"m"}`)
	s := String(b)
	if s != `{"model":"m"}` || unsafe.StringData(s) != &b[0] {
		t.Errorf("String(%q) = %q, not the same memory", b, s)
	}
	if String(nil) != "" || String(b[:0]) != "" {
		t.Error("an empty slice is not the empty string")
	}
	if n := testing.AllocsPerRun(100, func() { s = String(b) }); n != 0 {
		t.Errorf("String allocates %v times", n)
	}
}
