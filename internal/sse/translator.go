package sse

import (
	"bytes"
	"io"
)

// Translator is a foreign stream turned into SSE one step at a time: an
// io.ReadCloser whose Read gives what its step wrote, and calls the step
// again whenever that is all read. A step reads a little of the stream
// (a frame, an event) and writes the events it makes of it; it ends the
// stream by returning an error (io.EOF for a clean end), which Read
// returns once the events written before it are read.
type Translator struct {
	src  io.Closer
	step func(out *bytes.Buffer) error
	out  bytes.Buffer
	err  error
}

// NewTranslator returns the translation of src by step. Closing it closes
// src.
func NewTranslator(src io.Closer, step func(out *bytes.Buffer) error) *Translator {
	return &Translator{src: src, step: step}
}

// Read implements io.Reader.
func (t *Translator) Read(p []byte) (int, error) {
	for t.out.Len() == 0 {
		if t.err != nil {
			return 0, t.err
		}
		t.err = t.step(&t.out)
	}
	return t.out.Read(p)
}

// Close implements io.Closer.
func (t *Translator) Close() error { return t.src.Close() }
