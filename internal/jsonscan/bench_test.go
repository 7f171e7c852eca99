package jsonscan

import (
	"bytes"
	"io"
	"strconv"
	"strings"
	"testing"

	"github.com/go-json-experiment/json/jsontext"
)

// benchDocs are Messages request bodies: the relay's usual 10 KB one (one
// long English prompt), a conversation of 200 short messages with tool
// calls, a prompt in Japanese, and an object of many members whose names
// have escapes.
func benchDocs() map[string]string {
	text10K := `{"model":"claude-sonnet-4-5","max_tokens":64,"metadata":{"user_id":"u-1"},"messages":[{"role":"user","content":"` +
		strings.Repeat("The quick brown fox jumps over the lazy dog. ", 225) + `"}]}`

	var conv strings.Builder
	conv.WriteString(`{"model":"claude-sonnet-4-5","max_tokens":1024,"tools":[{"name":"get_weather","description":"Get the weather","input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}],"messages":[`)
	for i := range 100 {
		if i > 0 {
			conv.WriteString(",")
		}
		id := strconv.Itoa(i)
		conv.WriteString(`{"role":"assistant","content":[{"type":"text","text":"Let me check the weather."},{"type":"tool_use","id":"toolu_` + id + `","name":"get_weather","input":{"city":"Paris"}}]},`)
		conv.WriteString(`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_` + id + `","content":"18°C, cloudy"},{"type":"text","text":"And tomorrow?"}]}`)
	}
	conv.WriteString(`]}`)

	japanese := `{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"` +
		strings.Repeat("吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。", 100) + `"}]}`

	var many strings.Builder
	many.WriteString(`{"model":"m","metadata":{`)
	for i := range 500 {
		if i > 0 {
			many.WriteString(",")
		}
		many.WriteString(`"k\u0065y` + strconv.Itoa(i) + `":` + strconv.Itoa(i))
	}
	many.WriteString(`}}`)

	return map[string]string{"text10K": text10K, "messages200": conv.String(), "japanese": japanese, "manyNames": many.String()}
}

// BenchmarkScan checks each document with the Scanner and, for
// comparison, with jsontext (as the relay's body scan did before).
func BenchmarkScan(b *testing.B) {
	docs := benchDocs()
	for _, name := range []string{"text10K", "messages200", "japanese", "manyNames"} {
		doc := []byte(docs[name])
		b.Run(name+"/jsonscan", func(b *testing.B) {
			var s Scanner
			b.ReportAllocs()
			b.SetBytes(int64(len(doc)))
			for b.Loop() {
				if err := s.Valid(doc); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/jsontext", func(b *testing.B) {
			var src bytes.Reader
			var dec jsontext.Decoder
			b.ReportAllocs()
			b.SetBytes(int64(len(doc)))
			for b.Loop() {
				src.Reset(doc)
				dec.Reset(&src)
				if _, err := dec.ReadValue(); err != nil {
					b.Fatal(err)
				}
				if _, err := dec.ReadToken(); err != io.EOF {
					b.Fatal(err)
				}
			}
		})
	}
}
