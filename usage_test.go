package relay

import (
	"io"
	"math"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/sse"
)

// A stream whose usage moves: message_start has the input side, two
// message_deltas carry cumulative output counts (and the second repeats the
// input side with final cache numbers).
var usageStream = strings.Join([]string{
	fakeupstream.Event("message_start", `{"type":"message_start","message":{"id":"m","type":"message","role":"assistant","content":[],"model":"x","usage":{"input_tokens":12,"cache_creation_input_tokens":300,"cache_read_input_tokens":4000,"cache_creation":{"ephemeral_5m_input_tokens":200,"ephemeral_1h_input_tokens":100},"output_tokens":1}}}`),
	fakeupstream.Event("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`),
	fakeupstream.Event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}`),
	fakeupstream.Event("message_delta", `{"type":"message_delta","delta":{"stop_reason":null},"usage":{"output_tokens":40}}`),
	fakeupstream.Event("content_block_stop", `{"type":"content_block_stop","index":0}`),
	fakeupstream.Event("message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"input_tokens":12,"cache_creation_input_tokens":300,"cache_read_input_tokens":4000,"output_tokens":97}}`),
	fakeupstream.Event("message_stop", `{"type":"message_stop"}`),
}, "")

// (content weighs the one word of content, for an estimate that a final
// count makes needless; stopped comes from the last message_delta's
// stop_reason, not from the first one's null)
var usageStreamFinal = usage{input: 12, output: 97, cacheRead: 4000, cacheWrite: 300, cacheWrite1h: 100, content: unitsWord, final: true, stopped: true}

func TestUsageFromStream(t *testing.T) {
	for name, rd := range map[string]io.Reader{
		"whole":          strings.NewReader(usageStream),
		"one byte reads": iotest.OneByteReader(strings.NewReader(usageStream)),
		"half reads":     iotest.HalfReader(strings.NewReader(usageStream)),
	} {
		t.Run(name, func(t *testing.T) {
			var u usage
			r := sse.NewReader(rd, maxEvent)
			for {
				ev, err := r.Next()
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				u.fromEvent(ev.Name, ev.Data)
			}
			if u != usageStreamFinal {
				t.Errorf("usage = %+v, want %+v (the last message_delta's cumulative counts, never a sum)", u, usageStreamFinal)
			}
		})
	}
}

func TestUsageFromMessage(t *testing.T) {
	var u usage
	u.fromMessage([]byte(`{"id":"m","usage":{"input_tokens":5,"cache_creation_input_tokens":7,"cache_read_input_tokens":11,"output_tokens":13,"cache_creation":{"ephemeral_1h_input_tokens":2}}}`))
	if want := (usage{input: 5, output: 13, cacheRead: 11, cacheWrite: 7, cacheWrite1h: 2}); u != want {
		t.Errorf("usage = %+v, want %+v", u, want)
	}
	var none usage
	none.fromMessage([]byte(`{"id":"m"}`))
	if none != (usage{}) {
		t.Errorf("a reply without usage gives %+v", none)
	}
}

func TestPriceLookup(t *testing.T) {
	pb := newPricebook(map[string]Price{"my-model": {Input: 1, Output: 2}, "claude-haiku-4-5": {Input: 7, Output: 8}})
	tests := []struct {
		model string
		input float64 // per million
	}{
		{"claude-sonnet-4-5", 3},
		{"claude-sonnet-4-5-20250929", 3},
		{"claude-sonnet-4-5@20250929", 3},
		{"claude-sonnet-4-5[1m]", 3},
		{"claude-opus-4-1-20250805", 15},
		{"claude-opus-4-20250514", 15},
		{"claude-opus-4-6", 5},
		{"claude-haiku-4-5", 7}, // configured over the default
		{"my-model", 1},
		{"claude-opus-4-9", 0}, // a newer version never takes an older price
		{"claude-sonnet-4-55", 0},
		{"gpt-4", 0},
	}
	for _, tt := range tests {
		r := pb.lookup(tt.model)
		got := 0.0
		if r != nil {
			got = math.Round(r.input*1e6*1000) / 1000
		}
		if got != tt.input {
			t.Errorf("%s: input price %v, want %v", tt.model, got, tt.input)
		}
	}
}

func TestCost(t *testing.T) {
	pb := newPricebook(nil)
	approx := func(a, b float64) bool { return math.Abs(a-b) < 1e-12 }

	u := usage{input: 1000, output: 500, cacheRead: 2000, cacheWrite: 100, cacheWrite1h: 40}
	want := (1000*3 + 500*15 + 2000*0.3 + 60*3.75 + 40*6) / 1e6
	if got := pb.lookup("claude-sonnet-4-5").cost(u); !approx(got, want) {
		t.Errorf("sonnet-4-5 cost = %v, want %v", got, want)
	}
	// past 200k prompt tokens, sonnet-4-5 bills every token at the long rates
	long := usage{input: 150_000, cacheRead: 60_000, output: 1000}
	want = (150_000*6 + 60_000*0.6 + 1000*22.5) / 1e6
	if got := pb.lookup("claude-sonnet-4-5").cost(long); !approx(got, want) {
		t.Errorf("long sonnet-4-5 cost = %v, want %v", got, want)
	}
	// haiku-5-5's tier starts past 100k, with its own cache read price
	h := usage{input: 90_000, cacheRead: 20_000, output: 100}
	want = (90_000*0.5 + 20_000*0.05 + 100*2.5) / 1e6
	if got := pb.lookup("claude-haiku-5-5").cost(h); !approx(got, want) {
		t.Errorf("long haiku-5-5 cost = %v, want %v", got, want)
	}
	h = usage{input: 90_000, cacheRead: 10_000, output: 100}
	want = (90_000*0.1 + 10_000*0.01 + 100*0.5) / 1e6
	if got := pb.lookup("claude-haiku-5-5").cost(h); !approx(got, want) {
		t.Errorf("haiku-5-5 at exactly 100k cost = %v, want %v", got, want)
	}
}

func TestCaddyfilePricing(t *testing.T) {
	r, err := parseRelay(t, `relay {
	key k g
	channel a {
		provider mock
	}
	group g {
		channels a
	}
	pricing {
		my-model input 2 output 8
		other-model input 1 output 4 cache_read 0.05 cache_write 1.5 cache_write_1h 2.5 above 100000 input 2 output 8 cache_read 0.1
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	p := r.Pricing["other-model"]
	if r.Pricing["my-model"].Input != 2 || r.Pricing["my-model"].Output != 8 || p.Input != 1 || *p.CacheRead != 0.05 ||
		*p.CacheWrite != 1.5 || *p.CacheWrite1h != 2.5 || p.LongPrompt == nil || p.LongPrompt.Above != 100000 ||
		p.LongPrompt.Input != 2 || *p.LongPrompt.CacheRead != 0.1 {
		t.Errorf("pricing = %+v", r.Pricing)
	}
	for _, bad := range []string{"m input", "m input x", "m tip 3", "m above x input 1", "m input -1 output 1"} {
		_, err := parseRelay(t, "relay {\n\tkey k g\n\tchannel a {\n\t\tprovider mock\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n\tpricing {\n\t\t"+bad+"\n\t}\n}")
		if err == nil || !strings.Contains(err.Error(), "pricing") {
			t.Errorf("%q: want a pricing error, got %v", bad, err)
		}
	}
}
