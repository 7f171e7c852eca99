package sse_test

import (
	"bytes"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/caddy-relay/relay/internal/sse"
)

// event is a copy of an sse.Event, whose slices are only valid until the
// next call to Next.
type event struct {
	raw, name, data string
}

// readAll reads every event of r and the error that ended the stream.
func readAll(r io.Reader, max int) ([]event, error) {
	rd := sse.NewReader(r, max)
	var out []event
	for {
		ev, err := rd.Next()
		if err != nil {
			return out, err
		}
		out = append(out, event{raw: string(ev.Raw), name: string(ev.Name), data: string(ev.Data)})
	}
}

// chunkReader returns its input in chunks whose sizes cycle through sizes,
// so events and lines are split at odd places (inside "data:", between '\r'
// and '\n', inside multi-byte JSON).
type chunkReader struct {
	s     string
	sizes []int
	i     int
}

func (c *chunkReader) Read(p []byte) (int, error) {
	if c.s == "" {
		return 0, io.EOF
	}
	n := min(c.sizes[c.i%len(c.sizes)], len(c.s), len(p))
	c.i++
	copy(p, c.s[:n])
	c.s = c.s[n:]
	return n, nil
}

// anthropicStream is a realistic streaming reply of the Messages API.
var anthropicStream = `event: message_start
data: {"type":"message_start","message":{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5-20250929","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":25,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":1}}}

event: ping
data: {"type": "ping"}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

` + strings.Repeat(`event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello, wörld! "}}

`, 15) + `event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":15}}

event: message_stop
data: {"type":"message_stop"}

`

func TestReaderParsesEvents(t *testing.T) {
	long := strings.Repeat("x", 20<<10) // longer than the 8 KiB bufio buffer
	tests := []struct {
		name string
		in   string
		want []event // name and data; raw is checked by TestReaderRawIsByteExact
	}{
		{
			name: "single event",
			in:   "event: ping\ndata: {\"type\":\"ping\"}\n\n",
			want: []event{{name: "ping", data: `{"type":"ping"}`}},
		},
		{
			name: "several events in order",
			in:   "event: a\ndata: 1\n\nevent: b\ndata: 2\n\nevent: c\ndata: 3\n\n",
			want: []event{{name: "a", data: "1"}, {name: "b", data: "2"}, {name: "c", data: "3"}},
		},
		{
			name: "event name without a space after the colon",
			in:   "event:message_stop\ndata:{}\n\n",
			want: []event{{name: "message_stop", data: "{}"}},
		},
		{
			name: "only the first space after the colon is dropped",
			in:   "event:  two\ndata:  x \n\n",
			want: []event{{name: " two", data: " x "}},
		},
		{
			name: "several data lines are joined with newlines",
			in:   "event: multi\ndata: {\"a\":\ndata: 1}\ndata:\ndata: end\n\n",
			want: []event{{name: "multi", data: "{\"a\":\n1}\n\nend"}},
		},
		{
			name: "event without a name",
			in:   "data: {}\n\n",
			want: []event{{name: "", data: "{}"}},
		},
		{
			name: "the last event line wins",
			in:   "event: first\nevent: second\ndata: x\n\n",
			want: []event{{name: "second", data: "x"}},
		},
		{
			name: "CRLF line endings",
			in:   "event: ping\r\ndata: {}\r\n\r\nevent: message_stop\r\ndata: {\"type\":\"message_stop\"}\r\n\r\n",
			want: []event{{name: "ping", data: "{}"}, {name: "message_stop", data: `{"type":"message_stop"}`}},
		},
		{
			name: "comment lines inside an event are skipped",
			in:   ": keep-alive\nevent: ping\n: another\ndata: {}\n\n",
			want: []event{{name: "ping", data: "{}"}},
		},
		{
			name: "a comment-only block is an event with no name and no data",
			in:   ": keep-alive\n\nevent: ping\ndata: {}\n\n",
			want: []event{{name: "", data: ""}, {name: "ping", data: "{}"}},
		},
		{
			name: "blank lines between events are not events",
			in:   "\n\nevent: a\ndata: 1\n\n\n\n\r\nevent: b\ndata: 2\n\n",
			want: []event{{name: "a", data: "1"}, {name: "b", data: "2"}},
		},
		{
			name: "unknown fields and id/retry are ignored",
			in:   "id: 7\nretry: 1000\nfoo: bar\nevent: a\ndata: 1\n\n",
			want: []event{{name: "a", data: "1"}},
		},
		{
			name: "a field without a colon is a field with an empty value",
			in:   "event: a\ndata\ndata: x\n\n",
			want: []event{{name: "a", data: "\nx"}},
		},
		{
			name: "a data line longer than the read buffer",
			in:   "event: big\ndata: " + long + "\n\nevent: after\ndata: 1\n\n",
			want: []event{{name: "big", data: long}, {name: "after", data: "1"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := readAll(strings.NewReader(tt.in), 1<<20)
			if err != io.EOF {
				t.Fatalf("stream ended with %v, want io.EOF", err)
			}
			if len(got) != len(tt.want) {
				t.Fatalf("got %d events, want %d: %q", len(got), len(tt.want), got)
			}
			for i := range got {
				if got[i].name != tt.want[i].name || got[i].data != tt.want[i].data {
					t.Errorf("event %d: got name %q data %q, want name %q data %q",
						i, got[i].name, trunc(got[i].data), tt.want[i].name, trunc(tt.want[i].data))
				}
			}
		})
	}
}

func trunc(s string) string {
	if len(s) > 80 {
		return s[:40] + "..." + s[len(s)-40:]
	}
	return s
}

// The relay forwards ev.Raw, so the events must reproduce the stream byte
// for byte, whatever the line endings, comments and chunking.
func TestReaderRawIsByteExact(t *testing.T) {
	inputs := map[string]string{
		"anthropic stream":       anthropicStream,
		"CRLF":                   strings.ReplaceAll(anthropicStream, "\n", "\r\n"),
		"mixed line endings":     "event: a\r\ndata: 1\n\r\nevent: b\ndata: 2\r\n\n",
		"comments and blanks":    "\n: hello\n\nevent: a\n: inside\ndata: 1\n\n\n\nevent: b\ndata: 2\n\n",
		"long line":              "event: big\ndata: " + strings.Repeat("y", 50<<10) + "\n\n",
		"no space after colon":   "event:a\ndata:1\n\n",
		"unicode in data":        "event: d\ndata: {\"text\":\"日本語 ✓\"}\n\n",
		"event spans many lines": "event: m\ndata: 1\ndata: 2\ndata: 3\nid: 9\n\n",
	}
	readers := map[string]func(string) io.Reader{
		"whole":          func(s string) io.Reader { return strings.NewReader(s) },
		"one byte":       func(s string) io.Reader { return iotest.OneByteReader(strings.NewReader(s)) },
		"odd chunks":     func(s string) io.Reader { return &chunkReader{s: s, sizes: []int{1, 2, 3, 5, 7, 11, 13, 17, 4099}} },
		"half reads":     func(s string) io.Reader { return iotest.HalfReader(strings.NewReader(s)) },
		"data with EOF":  func(s string) io.Reader { return iotest.DataErrReader(strings.NewReader(s)) },
		"tiny then huge": func(s string) io.Reader { return &chunkReader{s: s, sizes: []int{2, 9000}} },
	}
	for in, s := range inputs {
		for rd, newReader := range readers {
			t.Run(in+"/"+rd, func(t *testing.T) {
				got, err := readAll(newReader(s), 1<<20)
				if err != io.EOF {
					t.Fatalf("stream ended with %v, want io.EOF", err)
				}
				var b strings.Builder
				for _, ev := range got {
					b.WriteString(ev.raw)
				}
				if b.String() != s {
					t.Errorf("concatenated Raw differs from the input:\n got %q\nwant %q", trunc(b.String()), trunc(s))
				}
			})
		}
	}
}

func TestReaderSplitAcrossReadsGivesSameEvents(t *testing.T) {
	want, err := readAll(strings.NewReader(anthropicStream), 1<<20)
	if err != io.EOF {
		t.Fatalf("whole stream: %v", err)
	}
	if len(want) != 21 {
		t.Fatalf("the sample stream has %d events, want 21", len(want))
	}
	for name, r := range map[string]io.Reader{
		"one byte":   iotest.OneByteReader(strings.NewReader(anthropicStream)),
		"odd chunks": &chunkReader{s: anthropicStream, sizes: []int{3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5}},
	} {
		t.Run(name, func(t *testing.T) {
			got, err := readAll(r, 1<<20)
			if err != io.EOF {
				t.Fatalf("stream ended with %v, want io.EOF", err)
			}
			if len(got) != len(want) {
				t.Fatalf("got %d events, want %d", len(got), len(want))
			}
			for i := range got {
				if got[i] != want[i] {
					t.Errorf("event %d: got %+v, want %+v", i, got[i], want[i])
				}
			}
			if got[0].name != "message_start" || got[len(got)-1].name != "message_stop" {
				t.Errorf("first/last events are %q/%q", got[0].name, got[len(got)-1].name)
			}
		})
	}
}

func TestReaderEndOfStream(t *testing.T) {
	tests := []struct {
		name       string
		in         string
		wantEvents int
		wantErr    error
	}{
		{"empty stream ends cleanly", "", 0, io.EOF},
		{"stream ending after a complete event ends cleanly", "event: a\ndata: 1\n\n", 1, io.EOF},
		{"trailing blank lines end cleanly", "event: a\ndata: 1\n\n\n\r\n", 1, io.EOF},
		{"stream ending mid-event is unexpected", "event: a\ndata: 1\n\nevent: b\ndata: 2\n", 1, io.ErrUnexpectedEOF},
		{"stream ending mid-line is unexpected", "event: a\ndata: 1\n\nevent: b\ndata: {\"ty", 1, io.ErrUnexpectedEOF},
		{"stream ending after the event's last line without the blank line is unexpected", "event: a\ndata: 1", 0, io.ErrUnexpectedEOF},
		{"stream ending in a half CRLF blank line is unexpected", "event: a\r\ndata: 1\r\n\r", 0, io.ErrUnexpectedEOF},
		{"stream ending after a lone comment is unexpected", "event: a\ndata: 1\n\n: bye\n", 1, io.ErrUnexpectedEOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for rd, r := range map[string]io.Reader{
				"whole":    strings.NewReader(tt.in),
				"one byte": iotest.OneByteReader(strings.NewReader(tt.in)),
			} {
				got, err := readAll(r, 1<<20)
				if err != tt.wantErr {
					t.Errorf("%s: stream ended with %v, want %v", rd, err, tt.wantErr)
				}
				if len(got) != tt.wantEvents {
					t.Errorf("%s: got %d complete events, want %d", rd, len(got), tt.wantEvents)
				}
			}
		})
	}
}

func TestReaderErrorIsStickyAtEOF(t *testing.T) {
	rd := sse.NewReader(strings.NewReader("event: a\ndata: 1\n\n"), 1<<20)
	if _, err := rd.Next(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := rd.Next(); err != io.EOF {
			t.Fatalf("call %d after the end: %v, want io.EOF", i+1, err)
		}
	}
}

func TestReaderPassesReadErrorsThrough(t *testing.T) {
	boom := errors.New("connection reset")
	r := io.MultiReader(strings.NewReader("event: a\ndata: 1\n\nevent: b\nda"), iotest.ErrReader(boom))
	got, err := readAll(r, 1<<20)
	if !errors.Is(err, boom) {
		t.Fatalf("got %v, want the reader's error", err)
	}
	if len(got) != 1 || got[0].name != "a" {
		t.Fatalf("got events %+v, want only a", got)
	}
}

func TestReaderEventSizeLimit(t *testing.T) {
	ev := "event: a\ndata: " + strings.Repeat("z", 100) + "\n\n" // 118 bytes
	tests := []struct {
		name    string
		in      string
		max     int
		wantErr error
	}{
		{"event exactly at the limit", ev, len(ev), io.EOF},
		{"event one byte over the limit", ev, len(ev) - 1, sse.ErrEventTooLarge},
		{"one line over the limit", ev, 20, sse.ErrEventTooLarge},
		{"line over the limit and the read buffer", "data: " + strings.Repeat("z", 40<<10) + "\n\n", 32 << 10, sse.ErrEventTooLarge},
		{"many small lines add up past the limit", "event: a\n" + strings.Repeat("data: 1\n", 100) + "\n", 500, sse.ErrEventTooLarge},
		{"leading blank lines count towards the event", strings.Repeat("\n", 10) + ev, len(ev) + 9, sse.ErrEventTooLarge},
		{"each event is measured on its own", ev + ev + ev, len(ev), io.EOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := readAll(strings.NewReader(tt.in), tt.max)
			if err != tt.wantErr {
				t.Fatalf("got %v, want %v", err, tt.wantErr)
			}
		})
	}
}

func TestReaderSlicesPointIntoRaw(t *testing.T) {
	in := "event: content_block_delta\ndata: {\"x\":1}\n\n"
	rd := sse.NewReader(strings.NewReader(in), 1<<20)
	ev, err := rd.Next()
	if err != nil {
		t.Fatal(err)
	}
	// Name is a sub-slice of Raw: the relay can use it without copying.
	i := bytes.Index(ev.Raw, []byte("content_block_delta"))
	if i < 0 || len(ev.Name) == 0 || &ev.Raw[i] != &ev.Name[0] {
		t.Errorf("Name does not point into Raw")
	}
}

// burstReader returns one burst of the stream per read, as much of it as
// the read takes, and records the size of every read it is asked for.
type burstReader struct {
	bursts []string
	asked  []int
}

func (b *burstReader) Read(p []byte) (int, error) {
	b.asked = append(b.asked, len(p))
	if len(b.bursts) == 0 {
		return 0, io.EOF
	}
	n := copy(p, b.bursts[0])
	if b.bursts[0] = b.bursts[0][n:]; b.bursts[0] == "" {
		b.bursts = b.bursts[1:]
	}
	return n, nil
}

// TestReaderWaitsWithoutItsBuffer checks that a reader with nothing left to
// give waits for the next event with a one-byte read (holding no read
// buffer meanwhile), then reads the rest of what the stream has at once, so
// a burst of events is still one buffer's worth and Buffered tells where it
// ends.
func TestReaderWaitsWithoutItsBuffer(t *testing.T) {
	a, b, c := "event: a\ndata: 1\n\n", "event: b\ndata: 2\n\n", "event: c\ndata: 3\n\n"
	src := &burstReader{bursts: []string{a + b, c}}
	rd := sse.NewReader(src, 1<<20)
	var buffered []bool
	for {
		_, err := rd.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		buffered = append(buffered, rd.Buffered())
	}
	// a wait of one byte, then the rest of the burst (a and b) into the
	// other 4095 bytes of the buffer; a wait for c, and c; a wait for the end
	if want := []int{1, 4<<10 - 1, 1, 4<<10 - 1, 1}; !slices.Equal(src.asked, want) {
		t.Errorf("reads of %v bytes, want %v", src.asked, want)
	}
	if want := []bool{true, false, false}; !slices.Equal(buffered, want) {
		t.Errorf("buffered after each event: %v, want %v", buffered, want)
	}
}

func BenchmarkReaderNext(b *testing.B) {
	stream := []byte(anthropicStream)
	src := bytes.NewReader(stream)
	b.ReportAllocs()
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		src.Reset(stream)
		rd := sse.NewReader(src, 16<<20)
		n := 0
		for {
			_, err := rd.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			n++
		}
		if n != 21 {
			b.Fatalf("read %d events, want 21", n)
		}
	}
}

// FuzzReader checks the reader on any stream cut at any places: it never
// panics, every event it returns is whole and byte-exact (the events' raw
// bytes are, in order, the start of the stream), and no event is larger
// than the limit.
// Long run: go test -run '^$' -fuzz FuzzReader -fuzztime 10m ./internal/sse
func FuzzReader(f *testing.F) {
	f.Add([]byte(anthropicStream), uint8(7))
	f.Add([]byte("event: a\r\ndata: 1\r\n\r\n: comment\n\ndata: x\ndata: y\n\n"), uint8(1))
	f.Add([]byte("data: {\"a\":1}\rdata: 2\r\r"), uint8(3))
	f.Add([]byte("event: error\ndata: {\"type\":\"error\"}"), uint8(2))
	f.Fuzz(func(t *testing.T, stream []byte, chunk uint8) {
		const limit = 1 << 10
		rd := sse.NewReader(&chunkReader{s: string(stream), sizes: []int{int(chunk%16) + 1, 1, 4096}}, limit)
		var seen []byte
		for {
			ev, err := rd.Next()
			if err != nil {
				break
			}
			if len(ev.Raw) > limit {
				t.Fatalf("an event of %d bytes passed a %d-byte limit", len(ev.Raw), limit)
			}
			seen = append(seen, ev.Raw...)
			if !bytes.HasPrefix(stream, seen) {
				t.Fatalf("the events' bytes are not the stream's: %q", seen)
			}
		}
	})
}
