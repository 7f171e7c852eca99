package relay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/sse"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddy-relay/relay/providers/bedrock"
	"github.com/tidwall/gjson"
)

// The fake Bedrock's credentials; the relay gets them through {env.*}.
const (
	awsKeyID   = "AKIDTESTRELAY000"
	awsSecret  = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYTESTKEY"
	awsSession = "session-token-for-tests"
	awsRegion  = "us-east-1"
)

// fakeBedrock is a Bedrock runtime endpoint on 127.0.0.1. It recomputes
// every request's SigV4 signature with the same credentials and refuses a
// request whose signature differs, as AWS would.
type fakeBedrock struct {
	*fakeupstream.Upstream
	mu     sync.Mutex
	answer http.HandlerFunc
	bad    []string // why signatures were refused
}

func newFakeBedrock(t *testing.T, answer http.HandlerFunc) *fakeBedrock {
	f := &fakeBedrock{answer: answer}
	f.Upstream = fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+bedrockTestAPIKey {
			if why := verifySigV4(r); why != "" {
				f.mu.Lock()
				f.bad = append(f.bad, why)
				f.mu.Unlock()
				w.Header().Set("X-Amzn-ErrorType", "InvalidSignatureException:http://internal.amazon.com/coral/com.amazon.coral.service/")
				fakeupstream.Raw(403, []byte(`{"message":"The request signature we calculated does not match the signature you provided."}`))(w, r)
				return
			}
		}
		f.mu.Lock()
		answer := f.answer
		f.mu.Unlock()
		answer(w, r)
	}), fakeupstream.AcceptKeys(bedrockTestAPIKey))
	return f
}

func (f *fakeBedrock) refused() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.bad...)
}

const bedrockTestAPIKey = "bedrock-api-key-test-123"

// verifySigV4 signs a copy of r made of what r carried (the path as sent,
// the headers its Authorization says were signed, the body) and compares.
func verifySigV4(r *http.Request) string {
	auth := r.Header.Get("Authorization")
	if !strings.HasPrefix(auth, "AWS4-HMAC-SHA256 ") {
		return "not signed: " + auth
	}
	_, signed, _ := strings.Cut(auth, "SignedHeaders=")
	signed, _, _ = strings.Cut(signed, ",")
	at, err := time.Parse("20060102T150405Z", r.Header.Get("X-Amz-Date"))
	if err != nil {
		return "no X-Amz-Date"
	}
	body, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(body))
	cp, _ := http.NewRequest(r.Method, "http://"+r.Host+r.URL.RequestURI(), bytes.NewReader(body))
	cp.URL = &url.URL{Scheme: "http", Host: r.Host, Path: r.URL.Path, RawPath: r.URL.RawPath}
	cp.Host = r.Host
	cp.Header = http.Header{}
	for _, name := range strings.Split(signed, ";") {
		if name != "host" && name != "content-length" {
			cp.Header[http.CanonicalHeaderKey(name)] = r.Header.Values(name)
		}
	}
	cp.Header.Del("Authorization")
	sum := sha256.Sum256(body)
	creds := aws.Credentials{AccessKeyID: awsKeyID, SecretAccessKey: awsSecret, SessionToken: awsSession}
	if err := v4.NewSigner().SignHTTP(context.Background(), creds, cp, hex.EncodeToString(sum[:]), "bedrock", awsRegion, at); err != nil {
		return err.Error()
	}
	if got := cp.Header.Get("Authorization"); got != auth {
		return "signature mismatch: want " + got + ", got " + auth
	}
	return ""
}

// eventStream answers with the events (Anthropic SSE, as fakeupstream
// renders them) framed as Bedrock does: each event's JSON base64-encoded in
// a chunk frame, made by aws-sdk-go-v2's own encoder; message_stop gains
// Bedrock's invocation metrics. Exception frames follow when given.
func eventStream(events []string, exceptions ...eventstream.Message) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/vnd.amazon.eventstream")
		w.Header().Set("X-Amzn-Bedrock-Content-Type", "application/json")
		w.WriteHeader(200)
		enc := eventstream.NewEncoder()
		for _, ev := range events {
			data := strings.TrimSuffix(ev[strings.Index(ev, "data: ")+6:], "\n\n")
			if strings.Contains(data, `"message_stop"`) {
				data = strings.TrimSuffix(data, "}") + `,"amazon-bedrock-invocationMetrics":{"inputTokenCount":10,"outputTokenCount":3,"invocationLatency":12,"firstByteLatency":5}}`
			}
			var msg eventstream.Message
			msg.Headers.Set(":message-type", eventstream.StringValue("event"))
			msg.Headers.Set(":event-type", eventstream.StringValue("chunk"))
			msg.Headers.Set(":content-type", eventstream.StringValue("application/json"))
			msg.Payload = []byte(`{"bytes":"` + base64.StdEncoding.EncodeToString([]byte(data)) + `","p":"abcdefghij"}`)
			if enc.Encode(w, msg) != nil {
				return
			}
			_ = http.NewResponseController(w).Flush()
		}
		for _, msg := range exceptions {
			_ = enc.Encode(w, msg)
		}
	}
}

func exceptionFrame(name, msg string) eventstream.Message {
	var m eventstream.Message
	m.Headers.Set(":message-type", eventstream.StringValue("exception"))
	m.Headers.Set(":exception-type", eventstream.StringValue(name))
	m.Headers.Set(":content-type", eventstream.StringValue("application/json"))
	m.Payload = []byte(`{"message":"` + msg + `"}`)
	return m
}

// bedrockError answers as Bedrock's REST API does.
func bedrockFailure(status int, name, msg string) http.HandlerFunc {
	return fakeupstream.Raw(status, []byte(`{"message":"`+msg+`"}`), "X-Amzn-ErrorType", name+":http://internal.amazon.com/coral/com.amazon.bedrock/")
}

// bedrockChannel renders a bedrock channel block whose credentials come
// from the environment.
func bedrockChannel(t *testing.T, name, url string, opts ...string) string {
	t.Setenv("RELAY_TEST_AWS_KEY_ID", awsKeyID)
	t.Setenv("RELAY_TEST_AWS_SECRET", awsSecret)
	t.Setenv("RELAY_TEST_AWS_SESSION", awsSession)
	return fmt.Sprintf("\t\tchannel %s {\n\t\t\tprovider bedrock\n\t\t\tregion %s\n\t\t\turl %s\n"+
		"\t\t\taccess_key_id {env.RELAY_TEST_AWS_KEY_ID}\n\t\t\tsecret_access_key {env.RELAY_TEST_AWS_SECRET}\n\t\t\tsession_token {env.RELAY_TEST_AWS_SESSION}\n"+
		"\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n\t\t\t%s\n\t\t}\n",
		name, awsRegion, url, strings.Join(opts, "\n\t\t\t"))
}

func TestBedrockInvokeIsSignedAndTranslated(t *testing.T) {
	fb := newFakeBedrock(t, fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5-20250929", "from bedrock", fakeupstream.Usage{InputTokens: 7, OutputTokens: 2})))
	// the channel says to strip what Bedrock lacks: nothing else goes
	startRelay(t, bedrockChannel(t, "br-invoke", fb.URL, "strip mcp_servers prompt-caching-2024-07-31")+keyAndGroup("br-invoke", "br-invoke"))

	body := `{"model":"claude-sonnet-4-5","max_tokens":64,"mcp_servers":[{"type":"url","url":"https://mcp.example","name":"x"}],"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u-1"}}`
	r := message(t, body, "Anthropic-Beta", "interleaved-thinking-2025-05-14, prompt-caching-2024-07-31")
	if r.status != 200 || !bytes.Contains(r.body, []byte("from bedrock")) {
		t.Fatalf("%d %s (refused signatures: %v)", r.status, r.body, fb.refused())
	}
	got := fb.Last(t)
	if got.Path != "/model/us.anthropic.claude-sonnet-4-5-20250929-v1:0/invoke" {
		t.Errorf("path = %s", got.Path)
	}
	want := `{"max_tokens":64,"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u-1"},"anthropic_version":"bedrock-2023-05-31","anthropic_beta":["interleaved-thinking-2025-05-14"]}`
	if string(got.Body) != want {
		t.Errorf("Bedrock received\n %s\nwant\n %s\n(no model or stream; mcp_servers and a beta stripped as the channel says; betas in the body; every other byte unchanged)", got.Body, want)
	}
	if got.Header.Get("X-Amz-Security-Token") != awsSession || got.Header.Get("X-Api-Key") != "" || got.Header.Get("Anthropic-Beta") != "" {
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
	fb := newFakeBedrock(t, eventStream(events))
	startRelay(t, bedrockChannel(t, "br-stream", fb.URL)+keyAndGroup("br-stream", "br-stream"))

	r := message(t, streamBody)
	if r.status != 200 || r.header.Get("Content-Type") != "text/event-stream; charset=utf-8" {
		t.Fatalf("%d %v %s", r.status, r.header, r.body)
	}
	if want := strings.Join(events, ""); string(r.body) != want {
		t.Errorf("client got\n%s\nwant exactly what Anthropic sends for these events\n%s", r.body, want)
	}
	got := fb.Last(t)
	if got.Path != "/model/us.anthropic.claude-sonnet-4-5-20250929-v1:0/invoke-with-response-stream" ||
		gjson.GetBytes(got.Body, "stream").Exists() || gjson.GetBytes(got.Body, "model").Exists() {
		t.Errorf("stream request: %s %s", got.Path, got.Body)
	}
	mf, _ := scrape(t)
	for kind, want := range map[string]float64{"input": 10, "output": 3, "cache_read": 40, "cache_write": 5} {
		if v := value(mf, "relay_tokens_total", "group=br-stream", "channel=br-stream", "kind="+kind); v != want {
			t.Errorf("relay_tokens_total{kind=%s} = %v, want %v", kind, v, want)
		}
	}
}

func TestBedrockExceptionsInTheStream(t *testing.T) {
	events := fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 1, OutputTokens: 1}, "partial")

	t.Run("before content it fails over invisibly", func(t *testing.T) {
		fb := newFakeBedrock(t, eventStream(events[:1], exceptionFrame("throttlingException", "Too many requests")))
		ok := fakeupstream.New(t, fakeupstream.Stream(events...))
		startRelay(t, bedrockChannel(t, "br-exc-a", fb.URL, "priority 1")+channelBlock("br-exc-b", ok.URL, "priority 2")+
			keyAndGroup("br-exc", "br-exc-a br-exc-b"))
		r := message(t, streamBody)
		if string(r.body) != strings.Join(events, "") || ok.Hits() != 1 {
			t.Fatalf("client got\n%s\n(second channel hits %d)", r.body, ok.Hits())
		}
		if st := channels(t)["br-exc-a"]; st.State != stateCooldown || st.LastError != "rate_limited" {
			t.Errorf("a throttled Bedrock channel should cool as a 429: %+v", st)
		}
	})
	t.Run("after content it ends the stream with an error event", func(t *testing.T) {
		fb := newFakeBedrock(t, eventStream(events[:4], exceptionFrame("modelStreamErrorException", "broken")))
		startRelay(t, bedrockChannel(t, "br-exc-late", fb.URL)+keyAndGroup("br-exc-late", "br-exc-late"))
		r := message(t, streamBody)
		tail := strings.TrimPrefix(string(r.body), strings.Join(events[:4], ""))
		if tail == string(r.body) || !strings.HasPrefix(tail, "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\"") ||
			!strings.Contains(tail, "modelStreamErrorException") {
			t.Errorf("client got\n%s", r.body)
		}
	})
}

func TestBedrockErrorsMapOntoAnthropicErrors(t *testing.T) {
	p := &bedrock.Provider{}
	tests := []struct {
		name, header string
		status       int
		body         string
		wantStatus   int
		wantType     string
		wantOutcome  outcome
	}{
		{"throttling", "ThrottlingException:http://x/", 429, `{"message":"slow"}`, 429, "rate_limit_error", outcomeRateLimited},
		{"service unavailable", "ServiceUnavailableException", 503, `{"message":"x"}`, 529, "overloaded_error", outcomeOverloaded},
		{"model not ready", "ModelNotReadyException", 429, `{"message":"x"}`, 529, "overloaded_error", outcomeOverloaded},
		{"model timeout", "ModelTimeoutException", 408, `{"message":"x"}`, 504, "timeout_error", outcomeTransient},
		{"model error", "ModelErrorException", 424, `{"message":"x"}`, 500, "api_error", outcomeTransient},
		{"internal", "InternalServerException", 500, `{"message":"x"}`, 500, "api_error", outcomeTransient},
		{"validation", "ValidationException", 400, `{"message":"Extra inputs are not permitted"}`, 400, "invalid_request_error", outcomeClientError},
		{"quota", "ServiceQuotaExceededException", 400, `{"message":"x"}`, 429, "rate_limit_error", outcomeRateLimited},
		{"access denied", "AccessDeniedException", 403, `{"message":"no"}`, 403, "permission_error", outcomeAuth},
		{"bad signature", "InvalidSignatureException", 403, `{"message":"no"}`, 403, "permission_error", outcomeAuth},
		{"expired token", "ExpiredTokenException", 403, `{"message":"no"}`, 403, "permission_error", outcomeAuth},
		{"unknown model", "ResourceNotFoundException", 404, `{"message":"no"}`, 404, "not_found_error", outcomeClientError},
		{"name in the body", "", 429, `{"__type":"com.amazon.bedrock#ThrottlingException","message":"x"}`, 429, "rate_limit_error", outcomeRateLimited},
		{"stream error with the model's status", "ModelStreamErrorException", 424, `{"message":"x","originalStatusCode":529}`, 529, "overloaded_error", outcomeOverloaded},
		{"unknown 5xx", "SomethingNewException", 502, `{"message":"x"}`, 502, "api_error", outcomeTransient},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := &http.Response{StatusCode: tt.status, Header: http.Header{}, Body: io.NopCloser(strings.NewReader(tt.body))}
			if tt.header != "" {
				resp.Header.Set("X-Amzn-ErrorType", tt.header)
			}
			resp.Header.Set("Retry-After", "7")
			out, err := p.Response(resp, &provider.Call{Path: provider.PathMessages})
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(out.Body)
			if out.StatusCode != tt.wantStatus || gjson.GetBytes(body, "error.type").String() != tt.wantType ||
				gjson.GetBytes(body, "type").String() != "error" || !strings.HasPrefix(gjson.GetBytes(body, "error.message").String(), "bedrock: ") {
				t.Errorf("got %d %s", out.StatusCode, body)
			}
			if v := classifyStatus(out.StatusCode, out.Header, body, time.Now()); v.outcome != tt.wantOutcome {
				t.Errorf("classified %s, want %s", v.outcome, tt.wantOutcome)
			}
			if out.Header.Get("Retry-After") != "7" {
				t.Errorf("the upstream's retry-after must survive the translation")
			}
			if refused := provider.RefusesModel(out); refused != (tt.name == "access denied") {
				t.Errorf("refuses the model = %v: only AccessDeniedException refuses the model, not the credential", refused)
			}
		})
	}
}

func TestBedrockErrorsFailOverAndPassThrough(t *testing.T) {
	fb := newFakeBedrock(t, bedrockFailure(429, "ThrottlingException", "Too many tokens"))
	ok := fakeupstream.New(t, fakeupstream.Message("anthropic"))
	startRelay(t, bedrockChannel(t, "br-err-a", fb.URL, "priority 1")+channelBlock("br-err-b", ok.URL, "priority 2")+
		keyAndGroup("br-err", "br-err-a br-err-b"))
	if r := message(t, simpleBody); r.status != 200 || ok.Hits() != 1 {
		t.Fatalf("throttled Bedrock should fail over: %d %s", r.status, r.body)
	}
	if st := channels(t)["br-err-a"]; st.State != stateCooldown || st.LastError != "rate_limited" {
		t.Errorf("throttled channel: %+v", st)
	}

	fb2 := newFakeBedrock(t, bedrockFailure(400, "ValidationException", "messages: field required"))
	startRelay(t, bedrockChannel(t, "br-err-v", fb2.URL)+keyAndGroup("br-err-v", "br-err-v"))
	r := message(t, simpleBody)
	if r.status != 400 || gjson.GetBytes(r.body, "error.type").String() != "invalid_request_error" ||
		!strings.Contains(string(r.body), "ValidationException: messages: field required") {
		t.Errorf("a validation error reaches the client in the Anthropic shape: %d %s", r.status, r.body)
	}
	if st := channels(t)["br-err-v"]; st.State != stateHealthy {
		t.Errorf("a client error must not cool the channel: %+v", st)
	}

	fb3 := newFakeBedrock(t, bedrockFailure(403, "AccessDeniedException", "not authorized for this model"))
	startRelay(t, bedrockChannel(t, "br-err-d", fb3.URL, "priority 1")+channelBlock("br-err-e", ok.URL, "priority 2")+
		keyAndGroup("br-err-d", "br-err-d br-err-e"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("access denied should fail over: %d %s", r.status, r.body)
	}
	// a client picks the model: the refusal sets that model aside on the
	// channel for capability_ttl, and never cools the channel
	st := channels(t)["br-err-d"]
	if until, ok := st.RefusedModels["claude-sonnet-4-5"]; st.State != stateHealthy || st.LastError != "model_refused" || !ok ||
		time.Until(until) < 59*time.Minute || st.CooldownUntil != nil {
		t.Errorf("access denied should set the model aside for capability_ttl, not cool the channel: %+v", st)
	}
}

func TestBedrockCountTokensAndAPIKey(t *testing.T) {
	fb := newFakeBedrock(t, fakeupstream.Raw(200, []byte(`{"inputTokens":42}`)))
	t.Setenv("RELAY_TEST_BEDROCK_KEY", bedrockTestAPIKey)
	startRelay(t, "\t\tchannel br-count {\n\t\t\tprovider bedrock\n\t\t\tregion "+awsRegion+"\n\t\t\turl "+fb.URL+
		"\n\t\t\tapi_key {env.RELAY_TEST_BEDROCK_KEY}\n\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n\t\t}\n"+
		keyAndGroup("br-count", "br-count"))
	r := send(t, http.MethodPost, "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 || string(r.body) != `{"input_tokens":42}` {
		t.Fatalf("count_tokens: %d %s", r.status, r.body)
	}
	got := fb.Last(t)
	if got.Path != "/model/anthropic.claude-sonnet-4-5-20250929-v1:0/count-tokens" {
		t.Errorf("count tokens goes to the foundation model: %s", got.Path)
	}
	inner, err := base64.StdEncoding.DecodeString(gjson.GetBytes(got.Body, "input.invokeModel.body").String())
	if err != nil || string(inner) != `{"messages":[{"role":"user","content":"Hi"}],"anthropic_version":"bedrock-2023-05-31","max_tokens":1}` {
		t.Errorf("inner body: %s (%v)", inner, err)
	}
	if got.Header.Get("Authorization") != "Bearer "+bedrockTestAPIKey || got.Header.Get("X-Amz-Date") != "" {
		t.Errorf("an API key is a bearer token, not SigV4: %v", got.Header)
	}
}

// TestAnthropicOverloadFailsOverToBedrockForTheSDK is the issue's
// acceptance test: a group whose Anthropic channel is overloaded fails
// over to Bedrock, and the official Go SDK sees a normal stream.
func TestAnthropicOverloadFailsOverToBedrockForTheSDK(t *testing.T) {
	overloaded := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	events := fakeupstream.StreamEvents("claude-sonnet-4-5-20250929", fakeupstream.Usage{InputTokens: 9, OutputTokens: 4}, "Hello", " from", " Bedrock", "!")
	fb := newFakeBedrock(t, eventStream(events))
	startRelay(t, channelBlock("sdk-anthropic", overloaded.URL, "priority 1")+bedrockChannel(t, "sdk-bedrock", fb.URL, "priority 2")+
		keyAndGroup("sdk-mixed", "sdk-anthropic sdk-bedrock", "expose_channel"))

	sdk := anthropic.NewClient(option.WithBaseURL(relayURL), option.WithAPIKey(clientKey), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stream := sdk.Messages.NewStreaming(ctx, anthropic.MessageNewParams{
		Model: anthropic.ModelClaudeSonnet4_5, MaxTokens: 64,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hi"))},
	})
	var msg anthropic.Message
	for stream.Next() {
		if err := msg.Accumulate(stream.Current()); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("the SDK saw an error: %v (refused signatures: %v)", err, fb.refused())
	}
	if len(msg.Content) != 1 || msg.Content[0].Text != "Hello from Bedrock!" || msg.Usage.OutputTokens != 4 || msg.StopReason != anthropic.StopReasonEndTurn {
		t.Errorf("the SDK assembled %+v", msg)
	}
	if overloaded.Hits() != 1 || fb.Hits() != 1 {
		t.Errorf("hits: anthropic %d, bedrock %d", overloaded.Hits(), fb.Hits())
	}
}

// FuzzBedrockEventStream checks the event-stream conversion on any bytes:
// it never panics, ends, and emits only SSE events whose data is JSON (an
// exception becomes an Anthropic error event, a frame cut short or that
// does not decode a read error: never garbage for the client's SDK).
// Long run: go test -run '^$' -fuzz FuzzBedrockEventStream -fuzztime 10m .
func FuzzBedrockEventStream(f *testing.F) {
	events := fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 1, OutputTokens: 1}, "hi")
	for _, h := range []http.HandlerFunc{
		eventStream(events),
		eventStream(events[:2], exceptionFrame("throttlingException", "Too many requests")),
		eventStream(nil, exceptionFrame("modelStreamErrorException", `quote\" and \\n`)),
	} {
		w := httptest.NewRecorder()
		h(w, httptest.NewRequest(http.MethodPost, "/", nil))
		f.Add(w.Body.Bytes())
	}
	f.Add([]byte{0, 0, 0, 16, 0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef})
	f.Fuzz(func(t *testing.T, frames []byte) {
		resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"application/vnd.amazon.eventstream"}},
			Body: io.NopCloser(bytes.NewReader(frames))}
		conv, err := (&bedrock.Provider{}).Response(resp, &provider.Call{Path: provider.PathMessages, Stream: true})
		if err != nil {
			t.Fatal(err)
		}
		rd := sse.NewReader(conv.Body, maxEvent)
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

// byModel answers 403 (as refuse does) for requests whose path names
// refused, and a message otherwise.
func byModel(refused string, refuse http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, refused) {
			refuse(w, r)
			return
		}
		fakeupstream.Message("from "+r.URL.Path)(w, r)
	}
}

func TestARefusedModelIsSetAsideAloneOnBedrock(t *testing.T) {
	fb := newFakeBedrock(t, byModel("claude-opus", bedrockFailure(403, "AccessDeniedException", "You don't have access to the model with the specified model ID.")))
	fallback := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	// the bedrock channel lists no models: the client picks the model id
	brChannel := strings.Replace(bedrockChannel(t, "hostile-br", fb.URL, "priority 1"),
		"\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n", "", 1)
	startRelay(t, brChannel+channelBlock("hostile-br-fallback", fallback.URL, "priority 2")+
		keyAndGroup("hostile-br", "hostile-br hostile-br-fallback", "expose_channel")+
		"\t\tkey sk-bedrock-only-0123456789 hostile-br-only\n\t\tgroup hostile-br-only {\n\t\t\tchannels hostile-br\n\t\t}\n")
	opus := `{"model":"claude-opus-4-1","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	sonnet := `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`

	r := message(t, opus)
	if r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br-fallback" || fb.Hits() != 1 {
		t.Fatalf("a refused model should fail over: %d %s via %q, bedrock hits %d", r.status, r.body, r.header.Get("X-Relay-Channel"), fb.Hits())
	}
	st := channels(t)["hostile-br"]
	if st.State != stateHealthy || st.CooldownUntil != nil || st.LastError != "model_refused" {
		t.Errorf("a model refusal must not cool the channel: %+v", st)
	}
	if until, ok := st.RefusedModels["claude-opus-4-1"]; !ok || time.Until(until) < 59*time.Minute || len(st.RefusedModels) != 1 {
		t.Errorf("only claude-opus-4-1 should be set aside, for capability_ttl: %v", st.RefusedModels)
	}
	// the refusal is remembered: the model goes elsewhere without asking
	if r := message(t, opus); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br-fallback" || fb.Hits() != 1 {
		t.Errorf("the refused model was asked again: %d via %q, bedrock hits %d", r.status, r.header.Get("X-Relay-Channel"), fb.Hits())
	}
	// and other models are served by the channel as before
	if r := message(t, sonnet); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br" {
		t.Errorf("another model should still be served by the channel: %d %s via %q", r.status, r.body, r.header.Get("X-Relay-Channel"))
	}
	// a group that has no other channel: the upstream's answer, then the
	// relay's own model_not_found without asking the upstream again
	hits := fb.Hits()
	if r := send(t, http.MethodPost, "/v1/messages", "sk-bedrock-only-0123456789", opus); r.status != 503 || fb.Hits() != hits {
		t.Errorf("a model every channel refused: %d %s, bedrock hits %d, want %d", r.status, r.body, fb.Hits(), hits)
	} else {
		wantRelayError(t, r, 503, "relay_error", "model_not_found")
	}
	// the admin reset forgets the refusal
	if code, body := adminPost(t, "hostile-br", "reset"); code != 200 || strings.Contains(string(body), "refused_models") {
		t.Fatalf("reset: %d %s", code, body)
	}
	if message(t, opus); fb.Hits() != hits+1 {
		t.Errorf("after a reset the channel should be asked again: bedrock hits %d, want %d", fb.Hits(), hits+1)
	}
}
