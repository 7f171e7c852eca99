package bedrock

// Provider bedrock against a fake Bedrock on 127.0.0.1 that checks every
// request's SigV4 signature with the same credentials, as AWS would.

import (
	"bytes"
	"encoding/base64"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddy-relay/relay/internal/sse"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
)

// clientKey is the relay key a client sends, which no upstream may see.
const clientKey = "sk-client-secret-0123456789"

// sonnet is the inference profile the channels map claude-sonnet-4-5 to.
const sonnet = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"

// channel provisions a bedrock channel of url whose credentials are the
// fake's, through placeholders as a config names them.
func channel(t *testing.T, name, url string) *Provider {
	t.Setenv("RELAY_TEST_AWS_KEY_ID", providertest.AWSKeyID)
	t.Setenv("RELAY_TEST_AWS_SECRET", providertest.AWSSecret)
	t.Setenv("RELAY_TEST_AWS_SESSION", providertest.AWSSession)
	p := &Provider{Region: providertest.AWSRegion, URL: url, AccessKeyID: "{env.RELAY_TEST_AWS_KEY_ID}",
		SecretAccessKey: "{env.RELAY_TEST_AWS_SECRET}", SessionToken: "{env.RELAY_TEST_AWS_SESSION}"}
	providertest.Provision(t, p, name)
	return p
}

func TestBedrockInvokeIsSignedAndTranslated(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5-20250929", "from bedrock", fakeupstream.Usage{InputTokens: 7, OutputTokens: 2})))
	p := channel(t, "br-invoke", fb.URL)
	// the request as the relay hands it over, the beta its channel strips
	// gone from the header
	body := `{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u-1"}}`
	header := http.Header{"Anthropic-Version": {"2023-06-01"}, "Anthropic-Beta": {"interleaved-thinking-2025-05-14"}, "X-Api-Key": {clientKey}}
	a := providertest.Send(t, p, providertest.Request{Header: header, Model: sonnet, Body: body}.Call())
	if a.Status != 200 || !bytes.Contains(a.Body, []byte("from bedrock")) {
		t.Fatalf("%d %s (refused signatures: %v)", a.Status, a.Body, fb.Refused())
	}
	got := fb.Last(t)
	if got.Path != "/model/"+sonnet+"/invoke" {
		t.Errorf("path = %s", got.Path)
	}
	want := `{"max_tokens":64,"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u-1"},"anthropic_version":"bedrock-2023-05-31","anthropic_beta":["interleaved-thinking-2025-05-14"]}`
	if string(got.Body) != want {
		t.Errorf("Bedrock received\n %s\nwant\n %s\n(no model or stream; betas in the body; every other byte unchanged)", got.Body, want)
	}
	if got.Header.Get("X-Amz-Security-Token") != providertest.AWSSession || got.Header.Get("X-Api-Key") != "" || got.Header.Get("Anthropic-Beta") != "" {
		t.Errorf("headers: %v", got.Header)
	}
	for _, h := range got.Header {
		for _, v := range h {
			if strings.Contains(v, clientKey) {
				t.Errorf("the client's key reached Bedrock")
			}
		}
	}
}

func TestBedrockStreamIsAnthropicSSE(t *testing.T) {
	u := fakeupstream.Usage{InputTokens: 10, OutputTokens: 3, CacheReadInputTokens: 40, CacheCreationInputTokens: 5}
	events := fakeupstream.StreamEvents("claude-sonnet-4-5-20250929", u, "Hello", " from", " Bedrock")
	fb := providertest.NewFakeBedrock(t, providertest.EventStream(events))
	p := channel(t, "br-stream", fb.URL)

	a := providertest.Send(t, p, providertest.Request{Model: sonnet, Body: providertest.StreamBody}.Call())
	if a.Status != 200 || a.Header.Get("Content-Type") != "text/event-stream; charset=utf-8" {
		t.Fatalf("%d %v %s", a.Status, a.Header, a.Body)
	}
	if want := strings.Join(events, ""); string(a.Body) != want {
		t.Errorf("the answer is\n%s\nwant exactly what Anthropic sends for these events\n%s", a.Body, want)
	}
	got := fb.Last(t)
	if got.Path != "/model/"+sonnet+"/invoke-with-response-stream" ||
		gjson.GetBytes(got.Body, "stream").Exists() || gjson.GetBytes(got.Body, "model").Exists() {
		t.Errorf("stream request: %s %s", got.Path, got.Body)
	}
}

// An exception after content ends the stream with an Anthropic error
// event that names it. (One before any content is a failure the relay
// fails over from, invisibly: its end-to-end tests show it.)
func TestBedrockExceptionAfterContentIsAnErrorEvent(t *testing.T) {
	events := fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 1, OutputTokens: 1}, "partial")
	fb := providertest.NewFakeBedrock(t, providertest.EventStream(events[:4], providertest.ExceptionFrame("modelStreamErrorException", "broken")))
	p := channel(t, "br-exc-late", fb.URL)
	a, err := providertest.Do(t, p, providertest.Request{Model: sonnet, Body: providertest.StreamBody}.Call())
	if err != nil {
		t.Fatal(err)
	}
	tail := strings.TrimPrefix(string(a.Body), strings.Join(events[:4], ""))
	if tail == string(a.Body) || !strings.HasPrefix(tail, "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\"") ||
		!strings.Contains(tail, "modelStreamErrorException") {
		t.Errorf("the answer is\n%s", a.Body)
	}
}

func TestBedrockErrorsMapOntoAnthropicErrors(t *testing.T) {
	p := &Provider{}
	for _, c := range providertest.BedrockErrors {
		t.Run(c.Name, func(t *testing.T) {
			out, err := p.Response(c.Response(), &provider.Call{Path: provider.PathMessages})
			if err != nil {
				t.Fatal(err)
			}
			c.Check(t, out)
		})
	}
}

func TestBedrockCountTokensAndAPIKey(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, fakeupstream.Raw(200, []byte(`{"inputTokens":42}`)))
	t.Setenv("RELAY_TEST_BEDROCK_KEY", providertest.BedrockAPIKey)
	p := &Provider{Region: providertest.AWSRegion, URL: fb.URL, APIKey: "{env.RELAY_TEST_BEDROCK_KEY}"}
	providertest.Provision(t, p, "br-count")
	a := providertest.Send(t, p, providertest.Request{Path: provider.PathCountTokens, Model: sonnet,
		Body: `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`}.Call())
	if a.Status != 200 || string(a.Body) != `{"input_tokens":42}` {
		t.Fatalf("count_tokens: %d %s", a.Status, a.Body)
	}
	got := fb.Last(t)
	if got.Path != "/model/anthropic.claude-sonnet-4-5-20250929-v1:0/count-tokens" {
		t.Errorf("count tokens goes to the foundation model: %s", got.Path)
	}
	inner, err := base64.StdEncoding.DecodeString(gjson.GetBytes(got.Body, "input.invokeModel.body").String())
	if err != nil || string(inner) != `{"messages":[{"role":"user","content":"Hi"}],"anthropic_version":"bedrock-2023-05-31","max_tokens":1}` {
		t.Errorf("inner body: %s (%v)", inner, err)
	}
	if got.Header.Get("Authorization") != "Bearer "+providertest.BedrockAPIKey || got.Header.Get("X-Amz-Date") != "" {
		t.Errorf("an API key is a bearer token, not SigV4: %v", got.Header)
	}
}

// FuzzBedrockEventStream checks the event-stream conversion on any bytes:
// it never panics, ends, and emits only SSE events whose data is JSON (an
// exception becomes an Anthropic error event, a frame cut short or that
// does not decode a read error: never garbage for the client's SDK).
// Long run: go test -run '^$' -fuzz FuzzBedrockEventStream -fuzztime 10m ./providers/bedrock
func FuzzBedrockEventStream(f *testing.F) {
	events := fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 1, OutputTokens: 1}, "hi")
	for _, h := range []http.HandlerFunc{
		providertest.EventStream(events),
		providertest.EventStream(events[:2], providertest.ExceptionFrame("throttlingException", "Too many requests")),
		providertest.EventStream(nil, providertest.ExceptionFrame("modelStreamErrorException", `quote\" and \\n`)),
	} {
		w := httptest.NewRecorder()
		h(w, httptest.NewRequest(http.MethodPost, "/", nil))
		f.Add(w.Body.Bytes())
	}
	f.Add([]byte{0, 0, 0, 16, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef})
	f.Fuzz(func(t *testing.T, frames []byte) {
		resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"application/vnd.amazon.eventstream"}},
			Body: io.NopCloser(bytes.NewReader(frames))}
		conv, err := (&Provider{}).Response(resp, &provider.Call{Path: provider.PathMessages, Stream: true})
		if err != nil {
			t.Fatal(err)
		}
		rd := sse.NewReader(conv.Body, maxTestEvent)
		for {
			ev, err := rd.Next()
			if err != nil {
				// a frame cut short or that does not decode ends the
				// stream with an error the relay treats as a broken
				// upstream
				return
			}
			if !gjson.ValidBytes(ev.Data) {
				t.Fatalf("event %q carries data that is not JSON: %q", ev.Name, ev.Data)
			}
		}
	})
}

// maxTestEvent bounds an event the fuzz test reads, as the relay bounds a
// stream's events.
const maxTestEvent = 16 << 20
