package sse

import (
	"bytes"
	"errors"
	"io"
	"testing"
)

// closeCounter counts its closes.
type closeCounter struct{ n int }

func (c *closeCounter) Close() error { c.n++; return nil }

// TestTranslatorGivesEveryStepThenItsError: Read gives what each step
// wrote, skips steps that wrote nothing, and returns the step's error only
// once what was written before it is read; Close closes the source.
func TestTranslatorGivesEveryStepThenItsError(t *testing.T) {
	steps := []string{"event: a\n\n", "", "event: b\n\n"}
	broken := errors.New("cut")
	src := &closeCounter{}
	tr := NewTranslator(src, func(out *bytes.Buffer) error {
		if len(steps) == 0 {
			return broken
		}
		out.WriteString(steps[0])
		steps = steps[1:]
		if len(steps) == 0 {
			out.WriteString("event: last\n\n")
			return broken
		}
		return nil
	})
	got, err := io.ReadAll(tr)
	if string(got) != "event: a\n\nevent: b\n\nevent: last\n\n" || err != broken {
		t.Errorf("read %q, %v", got, err)
	}
	if _, err := tr.Read(make([]byte, 1)); err != broken {
		t.Errorf("a read after the end: %v", err)
	}
	if tr.Close(); src.n != 1 {
		t.Errorf("closed the source %d times", src.n)
	}
}
