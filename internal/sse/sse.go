// Package sse reads a Server-Sent Events stream one event at a time and keeps
// the exact bytes of each event, so a relay can inspect an event and still
// forward it byte for byte.
package sse

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"sync"
)

// ErrEventTooLarge is returned when one event grows past the reader's limit.
var ErrEventTooLarge = errors.New("sse: event too large")

// Event is one event of the stream. Its slices point into the Reader's
// buffers and are valid only until the next call to Next.
type Event struct {
	// Raw is every byte the event occupied on the wire, up to and including
	// the blank line that ended it (comments and blank lines before it too).
	Raw []byte
	// Name is the value of the event's `event:` field, or empty.
	Name []byte
	// Data is the value of its `data:` fields, joined by '\n' when there are
	// several.
	Data []byte
}

// Reader splits a stream into events. It allocates only while its buffers
// grow to the size of the largest event seen.
//
// Its read buffer is held only while it has bytes to give: a reader that
// has returned every byte read so far gives the buffer back to a pool and
// waits for the next event with a one-byte read, taking a buffer again
// when the byte arrives. A stream idle between events (a long generation
// between two pings) thus holds no read buffer, while a busy one reads
// exactly the same bytes per read as with a buffer held throughout (the
// byte, then what else the stream has, up to the buffer's size), so
// Buffered, and what a caller flushes on it, are unchanged.
type Reader struct {
	br      *bufio.Reader // nil while no byte waits in the reader
	src     source
	max     int
	raw     []byte
	data    []byte
	nameOff int
	nameLen int
}

// bufSize is the size of a reader's read buffer.
const bufSize = 4 << 10

// buffers pools the read buffers of the readers that hold bytes.
var buffers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, bufSize) }}

// source is the stream as a reader's buffer reads it: first the byte read
// while the reader held no buffer, then the rest. An error of the stream is
// kept and returned again to every read that follows, after that byte.
type source struct {
	r   io.Reader
	one [1]byte
	has bool // one holds a byte not yet given to the buffer
	err error
}

func (s *source) Read(p []byte) (int, error) {
	if s.has {
		if len(p) == 0 {
			return 0, nil
		}
		p[0], s.has = s.one[0], false
		return 1, nil
	}
	if s.err != nil {
		return 0, s.err
	}
	n, err := s.r.Read(p)
	if err != nil {
		s.err = err
	}
	return n, err
}

// maxEmptyReads bounds the reads in a row that return no byte and no error
// before a reader gives up on the stream, as bufio does.
const maxEmptyReads = 100

// NewReader returns a Reader for r that refuses events larger than max bytes.
func NewReader(r io.Reader, max int) *Reader {
	return &Reader{src: source{r: r}, max: max}
}

// Reset makes r read from rd, keeping its event buffers, so readers can be
// pooled; its read buffer, if it held one, goes back to its pool.
func (r *Reader) Reset(rd io.Reader) {
	r.release()
	r.src = source{r: rd}
	r.raw, r.data = r.raw[:0], r.data[:0]
}

// Buffered reports whether data already read from the stream waits in the
// reader: when it does not, the next event has yet to arrive.
func (r *Reader) Buffered() bool { return r.br != nil && r.br.Buffered() > 0 }

// Size is the memory the reader's own buffers hold, to keep oversized
// readers out of a pool (the read buffer goes back to its pool apart).
func (r *Reader) Size() int { return cap(r.raw) + cap(r.data) }

// release gives the read buffer back to its pool.
func (r *Reader) release() {
	if r.br != nil {
		r.br.Reset(nil)
		buffers.Put(r.br)
		r.br = nil
	}
}

// wait gives the read buffer back and blocks until the stream has a byte
// for the next event (or an error), then takes a buffer again to read it
// and the rest.
func (r *Reader) wait() error {
	r.release()
	if r.src.err != nil {
		return r.src.err
	}
	for i := 0; ; i++ {
		n, err := r.src.r.Read(r.src.one[:])
		if err != nil {
			r.src.err = err
		}
		if n > 0 {
			r.src.has = true
			break
		}
		if err != nil {
			return err
		}
		if i == maxEmptyReads {
			return io.ErrNoProgress
		}
	}
	r.br = buffers.Get().(*bufio.Reader)
	r.br.Reset(&r.src)
	return nil
}

// Next returns the next complete event. At the end of the stream it returns
// io.EOF when the stream ended between events, and io.ErrUnexpectedEOF when
// it ended inside one: a truncated event is never returned. Once the stream
// has returned an error, every later read gets it again without asking the
// stream.
func (r *Reader) Next() (Event, error) {
	if !r.Buffered() {
		if err := r.wait(); err != nil {
			return Event{}, err
		}
	}
	r.raw, r.data = r.raw[:0], r.data[:0]
	r.nameOff, r.nameLen = 0, 0
	fields, dataLines := 0, 0
	for {
		start := len(r.raw)
		complete, err := r.readLine()
		if err != nil {
			if err == io.EOF && (fields > 0 || !complete) {
				return Event{}, io.ErrUnexpectedEOF
			}
			return Event{}, err
		}
		line := trimEOL(r.raw[start:])
		if len(line) == 0 {
			if fields == 0 {
				continue // blank lines between events travel with the next one
			}
			ev := Event{Raw: r.raw, Data: r.data}
			if r.nameLen > 0 {
				ev.Name = r.raw[r.nameOff : r.nameOff+r.nameLen]
			}
			return ev, nil
		}
		fields++
		if line[0] == ':' {
			continue // comment
		}
		name, value := line, line[len(line):]
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			name, value = line[:i], line[i+1:]
			if len(value) > 0 && value[0] == ' ' {
				value = value[1:]
			}
		}
		switch string(name) {
		case "event":
			r.nameOff = start + len(line) - len(value)
			r.nameLen = len(value)
		case "data":
			if dataLines > 0 {
				r.data = append(r.data, '\n')
			}
			dataLines++
			r.data = append(r.data, value...)
		}
	}
}

// readLine appends one line, with its line ending, to r.raw. complete is
// false when the stream ended in the middle of the line.
func (r *Reader) readLine() (complete bool, err error) {
	start := len(r.raw)
	for {
		chunk, err := r.br.ReadSlice('\n')
		if len(r.raw)+len(chunk) > r.max {
			return false, ErrEventTooLarge
		}
		r.raw = append(r.raw, chunk...)
		switch err {
		case nil:
			return true, nil
		case bufio.ErrBufferFull:
			continue
		case io.EOF:
			return len(r.raw) == start, io.EOF
		default:
			return false, err
		}
	}
}

func trimEOL(b []byte) []byte {
	if n := len(b); n > 0 && b[n-1] == '\n' {
		b = b[:n-1]
	}
	if n := len(b); n > 0 && b[n-1] == '\r' {
		b = b[:n-1]
	}
	return b
}
