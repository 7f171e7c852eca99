// Package sse reads a Server-Sent Events stream one event at a time and keeps
// the exact bytes of each event, so a relay can inspect an event and still
// forward it byte for byte.
package sse

import (
	"bufio"
	"bytes"
	"errors"
	"io"
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
type Reader struct {
	br      *bufio.Reader
	max     int
	raw     []byte
	data    []byte
	nameOff int
	nameLen int
}

// NewReader returns a Reader for r that refuses events larger than max bytes.
func NewReader(r io.Reader, max int) *Reader {
	return &Reader{br: bufio.NewReaderSize(r, 4<<10), max: max}
}

// Reset makes r read from rd, keeping its buffers, so readers can be
// pooled.
func (r *Reader) Reset(rd io.Reader) {
	r.br.Reset(rd)
	r.raw, r.data = r.raw[:0], r.data[:0]
}

// Buffered reports whether data already read from the stream waits in the
// reader: when it does not, the next event has yet to arrive.
func (r *Reader) Buffered() bool { return r.br.Buffered() > 0 }

// Size is the memory the reader's buffers hold, to keep oversized readers
// out of a pool.
func (r *Reader) Size() int { return r.br.Size() + cap(r.raw) + cap(r.data) }

// Next returns the next complete event. At the end of the stream it returns
// io.EOF when the stream ended between events, and io.ErrUnexpectedEOF when
// it ended inside one: a truncated event is never returned.
func (r *Reader) Next() (Event, error) {
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
