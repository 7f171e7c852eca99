package relay

import (
	"encoding/json"
	"math"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

func TestDeltaContent(t *testing.T) {
	for _, c := range []struct {
		name, data string
		want       int64
	}{
		{"a text delta: two words and a mark", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello, world"}}`, 2*unitsWord + unitsPunct},
		{"escapes are what they stand for", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a\n\tb \"c\""}}`, 3*unitsWord + unitsNewline + unitsTab + 2*unitsPunct},
		{"a tool's input JSON", `{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"city\": \"Paris\"}"}}`, 2*unitsWord + 7*unitsPunct},
		{"thinking", `{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Let me see"}}`, 3 * unitsWord},
		{"characters outside ASCII, raw or escaped (a pair is one)", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"中文\u00e9\ud83d\ude00"}}`, 4 * unitsOther},
		{"an escaped ASCII letter is a letter", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\u0041B"}}`, unitsWord},
		{"the key's order does not matter", `{"delta":{"text":"one two","type":"text_delta"},"index":0,"type":"content_block_delta"}`, 2 * unitsWord},
		{"a signature is not output", `{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxDYs"}}`, 0},
		{"nor a citation", `{"type":"content_block_delta","index":0,"delta":{"type":"citations_delta","citation":{"type":"char_location","cited_text":"text, \"quoted\"","document_index":0}}}`, 0},
		{"a delta that is not an object", `{"type":"content_block_delta","index":0,"delta":"text"}`, 0},
		{"no delta", `{"type":"content_block_delta","index":0}`, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := deltaContent([]byte(c.data)); got != c.want {
				t.Errorf("deltaContent = %d, want %d", got, c.want)
			}
		})
	}
}

// The estimate of a realistic answer, streamed a few words a delta, is
// within 10% of its count by the Claude tokenizer (1% as measured).
func TestOutputEstimateOfARealisticStream(t *testing.T) {
	for _, words := range []int{1, 3, 7} {
		var u usage
		for _, d := range fakeupstream.Deltas(fakeupstream.Answer, words) {
			text, _ := json.Marshal(d)
			data := `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":` + string(text) + `}}`
			u.fromEvent([]byte("content_block_delta"), []byte(data))
		}
		got, want := u.estimatedOutput(), int64(fakeupstream.AnswerTokens)
		if off := math.Abs(float64(got-want)) / float64(want); off > 0.10 {
			t.Errorf("%d words a delta: estimated %d tokens, the tokenizer counts %d (%.1f%% off)", words, got, want, 100*off)
		}
	}
}

func BenchmarkDeltaContent(b *testing.B) {
	ev := []byte(`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" a goroutine tries to send on an\n\tunbuffered channel"}}`)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if deltaContent(ev) == 0 {
			b.Fatal("no content")
		}
	}
}
