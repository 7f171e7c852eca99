package jsonscan

import (
	"errors"
	"io"
	"strconv"
	"unicode/utf8"
)

// What an Error is about (its Err); a document that ends too soon is
// io.ErrUnexpectedEOF.
var (
	// ErrSyntax is a byte that the grammar does not allow where it is: a
	// bad character, escape sequence, literal or number.
	ErrSyntax = errors.New("invalid JSON")
	// ErrInvalidUTF8 is a string with bytes that are not UTF-8.
	ErrInvalidUTF8 = errors.New("invalid UTF-8 within string")
	// ErrDuplicateName is an object member name the object has already.
	ErrDuplicateName = errors.New("duplicate object member name")
	// ErrMaxDepth is a document nested deeper than MaxDepth.
	ErrMaxDepth = errors.New("exceeded max depth")
	// ErrMisuse is a call out of turn, such as NextName outside an object.
	ErrMisuse = errors.New("scanner used out of turn")
)

// Error is why a document was refused, and where.
type Error struct {
	// Offset is where in the document the problem is.
	Offset int
	// Err is what it is: ErrSyntax, ErrInvalidUTF8, ErrDuplicateName,
	// ErrMaxDepth, ErrMisuse or io.ErrUnexpectedEOF.
	Err error
	// Name is the duplicate name (unescaped), for ErrDuplicateName.
	Name string
	// Pointer is where the duplicate member is, as a JSON Pointer (RFC
	// 6901), for ErrDuplicateName: "/metadata/user_id".
	Pointer string
	// detail says more, as jsontext words it: "invalid character 'x'
	// after object value (expecting ',' or '}')".
	detail string
}

// Error says what and where, as jsontext words it:
// "jsonscan: invalid character 'x' at start of value at offset 12".
func (e *Error) Error() string {
	what := e.detail
	switch {
	case what != "":
	case e.Err == ErrDuplicateName:
		what = e.Err.Error() + " " + strconv.Quote(e.Name)
	default:
		what = e.Err.Error()
	}
	return "jsonscan: " + what + " at offset " + strconv.Itoa(e.Offset)
}

// Unwrap is what the error is about (Err).
func (e *Error) Unwrap() error { return e.Err }

// The constructors below run only on failure: kept out of line, they leave
// the scanning loops small.

// errEOF is the error of a document that ends too soon.
func (s *Scanner) errEOF() error {
	return &Error{Offset: len(s.buf), Err: io.ErrUnexpectedEOF}
}

//go:noinline
func (s *Scanner) errChar(i int, where string) error {
	return &Error{Offset: i, Err: ErrSyntax, detail: "invalid character " + quoteRune(s.buf[i:]) + " " + where}
}

//go:noinline
func (s *Scanner) errAfterTop(i int) error {
	if i >= len(s.buf) {
		return s.errEOF()
	}
	return s.errChar(i, "after top-level value")
}

//go:noinline
func (s *Scanner) errEscape(i, end int) error {
	if end > len(s.buf) {
		return s.errEOF()
	}
	what := "escape sequence"
	if end-i > 6 {
		what = "surrogate pair"
	}
	return &Error{Offset: i, Err: ErrSyntax, detail: "invalid " + what + " " + strconv.Quote(string(s.buf[i:end])) + " in string"}
}

// errUTF8 is the error of the run b[i:j], which is not valid UTF-8: at
// its first bad byte.
//
//go:noinline
func (s *Scanner) errUTF8(i, j int) error {
	for i < j {
		r, n := utf8.DecodeRune(s.buf[i:j])
		if r == utf8.RuneError && n == 1 {
			break
		}
		i += n
	}
	if i == j || !utf8.FullRune(s.buf[i:]) {
		return s.errEOF() // a rune the document cuts short
	}
	return &Error{Offset: i, Err: ErrInvalidUTF8}
}

//go:noinline
func (s *Scanner) errDepth(i int) error {
	return &Error{Offset: i, Err: ErrMaxDepth}
}

//go:noinline
func (s *Scanner) errMisuse(what string) error {
	return &Error{Offset: s.pos, Err: ErrMisuse, detail: what}
}

// errDuplicate is the error of the name v given twice, its second raw
// string starting at buf[i].
//
//go:noinline
func (s *Scanner) errDuplicate(i int, v []byte) error {
	return &Error{Offset: i, Err: ErrDuplicateName, Name: string(v), Pointer: pointerTo(s.buf, i, v)}
}

// quoteRune quotes the character b starts with, or its first byte when it
// is not UTF-8: 'x', '\x00', '\xff'.
func quoteRune(b []byte) string {
	r, n := utf8.DecodeRune(b)
	if r == utf8.RuneError && n == 1 {
		return `'\x` + strconv.FormatUint(uint64(b[0])|0x100, 16)[1:] + `'`
	}
	return strconv.QuoteRune(r)
}

// quoteByte quotes an ASCII byte: '{'.
func quoteByte(c byte) string { return strconv.QuoteRune(rune(c)) }

// pointerTo is the JSON Pointer of the member named name whose raw name
// starts at b[at], in a document that is valid up to there: it walks the
// document again, noting the name or index of each open container.
func pointerTo(b []byte, at int, name []byte) string {
	type level struct {
		obj      bool
		wantName bool   // in an object, the next string is a name
		name     []byte // in an object, the current member's
		index    int    // in an array, the current element's
	}
	var open []level
	for i := 0; i < at && i < len(b); {
		c := b[i]
		i++
		var top *level
		if len(open) > 0 {
			top = &open[len(open)-1]
		}
		switch c {
		case '{':
			open = append(open, level{obj: true, wantName: true})
		case '[':
			open = append(open, level{})
		case '}', ']':
			if top != nil {
				open = open[:len(open)-1]
			}
		case ',':
			switch {
			case top == nil:
			case top.obj:
				top.wantName = true
			default:
				top.index++
			}
		case ':':
			if top != nil {
				top.wantName = false
			}
		case '"':
			start := i - 1
			for i < len(b) && b[i] != '"' {
				if b[i] == '\\' {
					i++
				}
				i++
			}
			i = min(i+1, len(b))
			if top != nil && top.obj && top.wantName {
				top.name = AppendUnquote(top.name[:0], b[start:i])
			}
		}
	}
	var p []byte
	for k := range open {
		l := &open[k]
		p = append(p, '/')
		switch {
		case k == len(open)-1:
			p = appendPointerToken(p, name)
		case l.obj:
			p = appendPointerToken(p, l.name)
		default:
			p = strconv.AppendInt(p, int64(l.index), 10)
		}
	}
	return string(p)
}

// appendPointerToken appends a name as a JSON Pointer reference token,
// '~' and '/' escaped as "~0" and "~1".
func appendPointerToken(p, name []byte) []byte {
	for _, c := range name {
		switch c {
		case '~':
			p = append(p, "~0"...)
		case '/':
			p = append(p, "~1"...)
		default:
			p = append(p, c)
		}
	}
	return p
}
