// Package jsonscan is a strict scanner of one JSON document held in memory.
//
// It accepts what jsontext (github.com/go-json-experiment/json/jsontext)
// accepts with its default options, read as exactly one value with nothing
// but whitespace after it: RFC 8259 grammar, valid UTF-8 within strings,
// no surrogate escape that is not part of a pair, no object member name
// twice in any object (compared by their unescaped value), at most
// MaxDepth nested arrays and objects. A differential fuzz test holds it to
// that.
//
// It exists for speed: jsontext checks the contents of a string one byte at
// a time, this scanner eight bytes at a time, and a request body is mostly
// strings. It allocates nothing on the common path: a Scanner keeps the
// buffers it needs (the names of the open objects, the unescaped names that
// had escapes, the index of a large object's names) from one document to
// the next, so keep Scanners in a pool.
//
// The caller walks the containers it cares about (ReadObjectStart and
// NextName, ReadArrayStart and NextElement) and reads every other value
// whole with ReadValue, which validates it without decoding it.
package jsonscan

// MaxDepth is how deeply arrays and objects may nest, as in jsontext.
const MaxDepth = 10000

// Kind is the kind of a JSON value, named by its first byte as in
// jsontext: 'n', 't', 'f', '"', '0' (a number), '{' and '['; 0 for no
// value.
type Kind byte

// kinds is the Kind each byte starts, 0 where it starts no value.
var kinds = func() (k [256]Kind) {
	for _, c := range `nft"{[` {
		k[c] = Kind(c)
	}
	for _, c := range "-0123456789" {
		k[c] = '0'
	}
	return k
}()

// KindOf is the kind of the raw value v; 0 when v starts no value.
func KindOf(v []byte) Kind {
	if len(v) == 0 {
		return 0
	}
	return kinds[v[0]]
}

// A Scanner reads one JSON document from a byte slice. The zero value is
// ready for Reset. A Scanner is not safe for concurrent use.
type Scanner struct {
	buf   []byte
	pos   int  // where the next read starts
	depth int  // open arrays and objects
	comma bool // the innermost container the caller walks has an element: the next one follows a comma
	done  bool // the top-level value has been read
	// nameEnd is where the name member read last ends
	nameEnd int
	// objs has bit d set when the container at depth d+1 is an object
	objs [(MaxDepth + 63) / 64]uint64
	nameSet
}

// Reset makes s read b from its start, forgetting any earlier document.
// Reset(nil) lets go of the last one (do so before pooling s).
func (s *Scanner) Reset(b []byte) {
	s.buf, s.pos, s.depth, s.comma, s.done = b, 0, 0, false, false
	s.nameSet.reset()
}

// InputOffset is the offset in the document just after what was read last.
func (s *Scanner) InputOffset() int { return s.pos }

// ValueOffset is the offset where the next value starts: InputOffset past
// any whitespace.
func (s *Scanner) ValueOffset() int { return skipSpace(s.buf, s.pos) }

// PeekKind is the kind of the next value, after any whitespace, without
// reading it; 0 when the next byte starts no value (the read reports why).
func (s *Scanner) PeekKind() Kind {
	i := skipSpace(s.buf, s.pos)
	if i >= len(s.buf) {
		return 0
	}
	return kinds[s.buf[i]]
}

// ReadValue reads the next value whole, validating it, and returns its raw
// bytes (without the whitespace around it). In an object it is the value of
// the member NextName returned; in an array, of the element NextElement
// announced.
func (s *Scanner) ReadValue() ([]byte, error) {
	i := skipSpace(s.buf, s.pos)
	if s.done {
		return nil, s.errAfterTop(i)
	}
	end, err := s.value(i)
	if err != nil {
		return nil, err
	}
	s.pos = end
	return s.buf[i:end], nil
}

// ReadObjectStart reads the '{' that opens the next value, which must be an
// object: its members are then read with NextName.
func (s *Scanner) ReadObjectStart() error {
	i, err := s.open('{')
	if err != nil {
		return err
	}
	s.pushObject()
	s.pos, s.comma = i+1, false
	return nil
}

// ReadArrayStart reads the '[' that opens the next value, which must be an
// array: its elements are then announced by NextElement.
func (s *Scanner) ReadArrayStart() error {
	i, err := s.open('[')
	if err != nil {
		return err
	}
	s.pushArray()
	s.pos, s.comma = i+1, false
	return nil
}

// open finds the start of the next value, which must be want, for
// ReadObjectStart and ReadArrayStart.
func (s *Scanner) open(want byte) (int, error) {
	i := skipSpace(s.buf, s.pos)
	switch {
	case s.done:
		return i, s.errAfterTop(i)
	case i >= len(s.buf):
		return i, s.errEOF()
	case s.buf[i] != want:
		if kinds[s.buf[i]] == 0 {
			return i, s.errChar(i, "at start of value")
		}
		return i, s.errChar(i, "at start of value (expecting "+quoteByte(want)+")")
	case s.depth == MaxDepth:
		return i, s.errDepth(i)
	}
	return i, nil
}

// NextName reads the name of the next member of the object the caller
// walks, and the colon after it, and returns the raw name (quotes and
// escapes as in the document); its value is to be read next. At the end of
// the object it reads the closing brace and returns a nil name. A name the
// object already has is an error wrapping ErrDuplicateName.
func (s *Scanner) NextName() ([]byte, error) {
	if s.depth == 0 || !s.inObject() {
		return nil, s.errMisuse("NextName outside an object")
	}
	b := s.buf
	i := skipSpace(b, s.pos)
	if i >= len(b) {
		return nil, s.errEOF()
	}
	switch c := b[i]; {
	case c == '}':
		s.pos = i + 1
		s.popObject()
		s.closed()
		return nil, nil
	case s.comma && c != ',':
		return nil, s.errChar(i, "after object value (expecting ',' or '}')")
	case s.comma:
		i = skipSpace(b, i+1)
	}
	start := i
	end, err := s.member(i)
	if err != nil {
		return nil, err
	}
	s.pos, s.comma = end, true
	return b[start:s.nameEnd], nil
}

// NextElement reports whether the array the caller walks has another
// element, which is to be read next. At the end of the array it reads the
// closing bracket and returns false.
func (s *Scanner) NextElement() (bool, error) {
	if s.depth == 0 || s.inObject() {
		return false, s.errMisuse("NextElement outside an array")
	}
	b := s.buf
	i := skipSpace(b, s.pos)
	if i >= len(b) {
		return false, s.errEOF()
	}
	switch c := b[i]; {
	case c == ']':
		s.pos = i + 1
		s.depth--
		s.closed()
		return false, nil
	case s.comma && c != ',':
		return false, s.errChar(i, "after array element (expecting ',' or ']')")
	case s.comma:
		i++
	}
	s.pos, s.comma = i, true
	return true, nil
}

// closed follows the end of a container the caller walked: the container
// around it, if any, now has an element.
func (s *Scanner) closed() {
	s.comma = true
	if s.depth == 0 {
		s.done = true
	}
}

// End checks that the document has nothing but whitespace after the value
// read, which must be complete.
func (s *Scanner) End() error {
	if s.depth != 0 || !s.done {
		if s.depth == 0 && skipSpace(s.buf, s.pos) < len(s.buf) {
			return s.errMisuse("End before the value was read")
		}
		return s.errEOF()
	}
	i := skipSpace(s.buf, s.pos)
	if i < len(s.buf) {
		return s.errAfterTop(i)
	}
	s.pos = i
	return nil
}

// Valid reports why b is not exactly one JSON value with nothing but
// whitespace around it; nil when it is.
func (s *Scanner) Valid(b []byte) error {
	s.Reset(b)
	defer s.Reset(nil)
	if _, err := s.ReadValue(); err != nil {
		return err
	}
	return s.End()
}

// inObject reports whether the innermost open container is an object.
func (s *Scanner) inObject() bool {
	d := s.depth - 1
	return s.objs[d>>6]&(1<<(d&63)) != 0
}

// pushObject opens an object: its names start a new set.
func (s *Scanner) pushObject() {
	d := s.depth
	s.depth++
	s.objs[d>>6] |= 1 << (d & 63)
	s.enter()
}

// pushArray opens an array.
func (s *Scanner) pushArray() {
	d := s.depth
	s.depth++
	s.objs[d>>6] &^= 1 << (d & 63)
}

// popObject closes the innermost object, which must be one.
func (s *Scanner) popObject() {
	s.leave()
	s.depth--
}

// isSpace reports JSON whitespace, by byte.
var isSpace = [256]bool{' ': true, '\t': true, '\n': true, '\r': true}

// skipSpace is the index of the first byte at or after i that is not JSON
// whitespace.
func skipSpace(b []byte, i int) int {
	for i < len(b) && b[i] <= ' ' && isSpace[b[i]] {
		i++
	}
	return i
}

// value reads one whole value starting at b[i] (no whitespace before it),
// and any containers in it, without recursion: open containers are kept in
// s.objs and the name sets. It returns the index just after the value.
func (s *Scanner) value(i int) (int, error) {
	b := s.buf
	stop := s.depth // the depth the value started at, and ends at
	var err error
	inObj := false // the innermost open container is an object
next:
	for {
		// a value starts at b[i]
		if i >= len(b) {
			return i, s.errEOF()
		}
		switch c := b[i]; c {
		case '"':
			if i, _, err = s.str(i); err != nil {
				return i, err
			}
		case '{':
			if s.depth == MaxDepth {
				return i, s.errDepth(i)
			}
			s.pushObject()
			inObj = true
			i = skipSpace(b, i+1)
			if i < len(b) && b[i] == '}' {
				i++
				s.popObject()
				inObj = s.depth > 0 && s.inObject()
				break
			}
			if i, err = s.member(i); err != nil {
				return i, err
			}
			i = skipSpace(b, i)
			continue next
		case '[':
			if s.depth == MaxDepth {
				return i, s.errDepth(i)
			}
			s.pushArray()
			inObj = false
			i = skipSpace(b, i+1)
			if i < len(b) && b[i] == ']' {
				i++
				s.depth--
				inObj = s.depth > 0 && s.inObject()
				break
			}
			continue next
		case 't':
			if i, err = s.literal(i, "true"); err != nil {
				return i, err
			}
		case 'f':
			if i, err = s.literal(i, "false"); err != nil {
				return i, err
			}
		case 'n':
			if i, err = s.literal(i, "null"); err != nil {
				return i, err
			}
		default:
			if kinds[c] != '0' {
				return i, s.errChar(i, "at start of value")
			}
			if i, err = s.number(i); err != nil {
				return i, err
			}
		}
		// after a value: the end of the one asked for, or what follows it
		// in its container
		for {
			if s.depth == stop {
				if stop == 0 {
					s.done = true
				}
				return i, nil
			}
			i = skipSpace(b, i)
			if i >= len(b) {
				return i, s.errEOF()
			}
			c := b[i]
			if inObj {
				switch c {
				case ',':
					if i, err = s.member(skipSpace(b, i+1)); err != nil {
						return i, err
					}
					i = skipSpace(b, i)
					continue next
				case '}':
					i++
					s.popObject()
					inObj = s.depth > 0 && s.inObject()
					continue
				}
				return i, s.errChar(i, "after object value (expecting ',' or '}')")
			}
			switch c {
			case ',':
				i = skipSpace(b, i+1)
				continue next
			case ']':
				i++
				s.depth--
				inObj = s.depth > 0 && s.inObject()
				continue
			}
			return i, s.errChar(i, "after array element (expecting ',' or ']')")
		}
	}
}

// member reads an object member's name at b[i] and the colon after it,
// adding the name to the innermost object's set, and returns the index
// after the colon. s.nameEnd is where the name ended.
func (s *Scanner) member(i int) (int, error) {
	b := s.buf
	if i >= len(b) {
		return i, s.errEOF()
	}
	if b[i] != '"' {
		return i, s.errChar(i, "at start of object name (expecting '\"')")
	}
	end, esc, err := s.str(i)
	if err != nil {
		return end, err
	}
	if err := s.add(i, end, esc); err != nil {
		return i, err
	}
	s.nameEnd = end
	j := skipSpace(b, end)
	if j >= len(b) {
		return j, s.errEOF()
	}
	if b[j] != ':' {
		return j, s.errChar(j, "after object name (expecting ':')")
	}
	return j + 1, nil
}

// literal reads the literal lit at b[i].
func (s *Scanner) literal(i int, lit string) (int, error) {
	b := s.buf
	if len(b)-i >= len(lit) && string(b[i:i+len(lit)]) == lit {
		return i + len(lit), nil
	}
	for k := 0; k < len(lit); k++ {
		if i+k >= len(b) {
			return i + k, s.errEOF()
		}
		if b[i+k] != lit[k] {
			return i + k, s.errChar(i+k, "in literal "+lit+" (expecting "+quoteByte(lit[k])+")")
		}
	}
	return i + len(lit), nil // not reached
}

// number reads the number at b[i], per RFC 8259, section 6: what follows it
// is the caller's to check.
func (s *Scanner) number(i int) (int, error) {
	b := s.buf
	if b[i] == '-' {
		i++
	}
	if i >= len(b) {
		return i, s.errEOF()
	}
	switch c := b[i]; {
	case c == '0':
		i++
	case '1' <= c && c <= '9':
		i = digits(b, i+1)
	default:
		return i, s.errChar(i, "in number (expecting digit)")
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) {
			return i, s.errEOF()
		}
		if !isDigit(b[i]) {
			return i, s.errChar(i, "in number (expecting digit)")
		}
		i = digits(b, i+1)
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) {
			return i, s.errEOF()
		}
		if !isDigit(b[i]) {
			return i, s.errChar(i, "in number (expecting digit)")
		}
		i = digits(b, i+1)
	}
	return i, nil
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// digits is the index of the first byte at or after i that is not a digit.
func digits(b []byte, i int) int {
	for i < len(b) && isDigit(b[i]) {
		i++
	}
	return i
}
