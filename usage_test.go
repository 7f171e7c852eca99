package relay

import (
	"io"
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
