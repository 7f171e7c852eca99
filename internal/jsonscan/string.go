package jsonscan

import (
	"encoding/binary"
	"math/bits"
	"unicode/utf16"
	"unicode/utf8"
)

// Masks for the bit tricks on eight bytes at once (SWAR), the first byte
// of the document in the low bits (little-endian loads).
const (
	ones  = 0x0101010101010101 // 0x01 in every byte
	highs = 0x8080808080808080 // the high bit of every byte
)

// specials is nonzero when one of the eight bytes of x is '"', '\\' or a
// control character (below 0x20). Its lowest set bit is then the high bit
// of the first such byte; bits above it mean nothing (a borrow may carry
// into the next bytes). It is the "has a byte below n" trick,
// (v - n*0x01..) &^ v & 0x80.., twice: for '\\', on x xor '\\' with n = 1;
// for '"' and the control characters at once, on x xor 0x02, which maps
// '"' to 0x20 and 0x00-0x1f onto themselves, with n = 0x21. Both xors keep
// each byte's high bit, so one &^ x serves both: it drops the bytes from
// 0x80 up, the only ones that set their high bit in a difference without
// being sought (before the first byte sought, nothing borrows).
func specials(x uint64) uint64 {
	v := x ^ (ones * 0x02)
	e := x ^ (ones * '\\')
	return ((v - ones*0x21) | (e - ones)) &^ x & highs
}

// sought is specials without its last step, &^ x: on a word of ASCII
// bytes, which never set a high bit in the differences unless sought, it
// says as much at two operations less.
func sought(x uint64) uint64 {
	return (x ^ (ones * 0x02) - ones*0x21) | (x ^ (ones * '\\') - ones)
}

// run is the index of the first '"', '\\' or control byte in b at or after
// i (len(b) when there is none), and whether a byte from 0x80 up comes
// before it: then the run b[i:j] must be checked as UTF-8. It looks at 32
// bytes a step while they are ASCII and none is sought, then (in
// runExact) with the test that needs no ASCII.
func run(b []byte, i int) (j int, high bool) {
	rest := b[i:]
	for len(rest) >= 32 {
		x := binary.LittleEndian.Uint64(rest)
		y := binary.LittleEndian.Uint64(rest[8:])
		z := binary.LittleEndian.Uint64(rest[16:])
		w := binary.LittleEndian.Uint64(rest[24:])
		if (sought(x)|sought(y)|sought(z)|sought(w)|x|y|z|w)&highs != 0 {
			break
		}
		rest = rest[32:]
	}
	return runExact(b, len(b)-len(rest))
}

// runExact is run for text that is not all ASCII: 32 bytes a step, then
// (in tail) 8, then one.
func runExact(b []byte, i int) (j int, high bool) {
	var h uint64
	rest := b[i:]
	for len(rest) >= 32 {
		x := binary.LittleEndian.Uint64(rest)
		y := binary.LittleEndian.Uint64(rest[8:])
		z := binary.LittleEndian.Uint64(rest[16:])
		w := binary.LittleEndian.Uint64(rest[24:])
		if specials(x)|specials(y)|specials(z)|specials(w) != 0 {
			break
		}
		h |= x | y | z | w
		rest = rest[32:]
	}
	j, high = tail(b, len(b)-len(rest))
	return j, high || h&highs != 0
}

// tail is runExact from i, 8 bytes a step: apart from its loop, which
// has then the registers to itself.
func tail(b []byte, i int) (int, bool) {
	var h uint64
	rest := b[i:]
	for len(rest) >= 8 {
		x := binary.LittleEndian.Uint64(rest)
		if m := specials(x); m != 0 {
			k := bits.TrailingZeros64(m) &^ 7 // the first special byte's low bit
			h |= x & (1<<k - 1)
			return len(b) - len(rest) + k>>3, h&highs != 0
		}
		h |= x
		rest = rest[8:]
	}
	for len(rest) > 0 {
		c := rest[0]
		if c == '"' || c == '\\' || c < 0x20 {
			break
		}
		h |= uint64(c)
		rest = rest[1:]
	}
	return len(b) - len(rest), h&highs != 0
}

// str reads the string whose opening quote is at b[i], checking its
// escapes and its UTF-8, and returns the index after its closing quote and
// whether it has escapes.
func (s *Scanner) str(i int) (int, bool, error) {
	b := s.buf
	i++
	// most names and many values are short, plain ASCII: done in a few
	// steps, without run's set-up
	var h uint64
	for j := i; j+8 <= len(b) && j < i+32; j += 8 {
		x := binary.LittleEndian.Uint64(b[j:])
		if m := specials(x); m != 0 {
			k := bits.TrailingZeros64(m) &^ 7
			if byte(x>>k) == '"' && (h|x&(1<<k-1))&highs == 0 {
				return j + k>>3 + 1, false, nil
			}
			break
		}
		h |= x
	}
	esc := false
	for {
		j, high := run(b, i)
		if high && !utf8.Valid(b[i:j]) {
			return j, esc, s.errUTF8(i, j)
		}
		if j >= len(b) {
			return j, esc, s.errEOF()
		}
		switch b[j] {
		case '"':
			return j + 1, esc, nil
		case '\\':
			n, err := s.escape(j)
			if err != nil {
				return j, esc, err
			}
			i, esc = j+n, true
		default:
			return j, esc, s.errChar(j, "in string (expecting non-control character)")
		}
	}
}

// escape is the length of the escape sequence at b[i] (a backslash), as
// jsontext accepts it by default: \" \\ \/ \b \f \n \r \t, \uXXXX of any
// code point but a surrogate, and \uXXXX\uXXXX of a surrogate pair.
func (s *Scanner) escape(i int) (int, error) {
	b := s.buf
	if i+1 >= len(b) {
		return 0, s.errEOF()
	}
	switch b[i+1] {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		return 2, nil
	case 'u':
	default:
		return 0, s.errEscape(i, i+2)
	}
	r, ok := hex4(b, i+2)
	if !ok {
		return 0, s.errEscape(i, i+6)
	}
	if !utf16.IsSurrogate(r) {
		return 6, nil
	}
	// a surrogate: only the first half of a pair, and the second half next
	if r >= 0xdc00 {
		return 0, s.errEscape(i, i+12)
	}
	if i+6 < len(b) && b[i+6] != '\\' {
		return 0, s.errEscape(i, i+7)
	}
	if i+7 < len(b) && b[i+7] != 'u' {
		return 0, s.errEscape(i, i+8)
	}
	r2, ok := hex4(b, i+8)
	if !ok || r2 < 0xdc00 || r2 > 0xdfff {
		return 0, s.errEscape(i, i+12)
	}
	return 12, nil
}

// unhex is the value of a hexadecimal digit, by byte; 0xff for others.
var unhex = func() (t [256]byte) {
	for i := range t {
		t[i] = 0xff
	}
	for c := '0'; c <= '9'; c++ {
		t[c] = byte(c - '0')
	}
	for c := 'a'; c <= 'f'; c++ {
		t[c] = byte(c - 'a' + 10)
		t[c-'a'+'A'] = byte(c - 'a' + 10)
	}
	return t
}()

// hex4 reads four hexadecimal digits at b[i]; false when they are not.
func hex4(b []byte, i int) (rune, bool) {
	if i+4 > len(b) {
		return 0, false
	}
	var r rune
	for _, c := range b[i : i+4] {
		v := unhex[c]
		if v == 0xff {
			return 0, false
		}
		r = r<<4 | rune(v)
	}
	return r, true
}

// AppendUnquote appends the value of the raw JSON string raw (its quotes
// included) to dst: its escapes decoded. raw must be a string the Scanner
// accepted; of anything else it appends some bytes, without failing.
func AppendUnquote(dst, raw []byte) []byte {
	if len(raw) < 2 {
		return dst
	}
	b := raw[1 : len(raw)-1]
	for len(b) > 0 {
		k := 0
		for k < len(b) && b[k] != '\\' {
			k++
		}
		dst = append(dst, b[:k]...)
		b = b[k:]
		if len(b) < 2 {
			return dst
		}
		n := 2
		switch c := b[1]; c {
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r, ok := hex4(b, 2)
			if !ok {
				return dst
			}
			n = 6
			if utf16.IsSurrogate(r) {
				r2, ok := hex4(b, 8)
				if ok && b[6] == '\\' && b[7] == 'u' {
					r, n = utf16.DecodeRune(r, r2), 12
				} else {
					r = utf8.RuneError
				}
			}
			dst = utf8.AppendRune(dst, r)
		default:
			dst = append(dst, c)
		}
		b = b[n:]
	}
	return dst
}
