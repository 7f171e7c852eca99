package relay

// The traces of the handler alone, under a span made by a test's tracer
// provider as Caddy's tracing makes one.

import (
	"net/http"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
)

// tracedRelay is a relay of one channel at url, with forward_traceparent.
func tracedRelay(name, url string) *Relay {
	r := benchServeRelay(name, url, nil)
	r.Channels[0].ForwardTraceparent = true
	return r
}

// TestTraceIDInTheLogLine: a traced request's log line names its trace,
// whose relay span is a child of the server span; an untraced one's has
// no trace_id.
func TestTraceIDInTheLogLine(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	r := tracedRelay("trace-log", up.URL)
	logs := provisionHandler(t, r)
	rec := tracetest.NewSpanRecorder()
	tracer := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)).Tracer("caddy")

	req := benchServeRequest("trace-log", simpleBody)
	ctx, server := tracer.Start(req.Context(), "caddy", trace.WithSpanKind(trace.SpanKindServer))
	if w, _ := serveHandler(t, r, req.WithContext(ctx)); w.Code != http.StatusOK {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	server.End()
	if w, _ := serveHandler(t, r, benchServeRequest("trace-log", simpleBody)); w.Code != http.StatusOK {
		t.Fatalf("untraced: status %d", w.Code)
	}
	lines := logs.FilterMessage("relayed request").All()
	if len(lines) != 2 {
		t.Fatalf("%d log lines, want 2", len(lines))
	}
	traceID := server.SpanContext().TraceID().String()
	if got := lines[0].ContextMap()["trace_id"]; got != traceID {
		t.Errorf("the traced request's trace_id = %v, want %s", got, traceID)
	}
	if got, ok := lines[1].ContextMap()["trace_id"]; ok {
		t.Errorf("the untraced request's log line has trace_id %v", got)
	}
	var relay sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == "relay" {
			relay = s
		}
	}
	if relay == nil || relay.Parent().SpanID() != server.SpanContext().SpanID() {
		t.Fatalf("no relay span under the server span: %v", rec.Ended())
	}
	reqs := up.Requests()
	if got := reqs[0].Header.Get("Traceparent"); len(got) != 55 || got[3:35] != traceID {
		t.Errorf("the upstream got traceparent %q, want one of trace %s", got, traceID)
	}
	if got := reqs[1].Header.Get("Traceparent"); got != "" {
		t.Errorf("the untraced request's upstream got traceparent %q", got)
	}
}

// TestTraceNotSampled: a request whose trace the sampler dropped (Caddy's
// server span does not record) gets no span of the relay's, and a channel
// with forward_traceparent sends the trace's id unsampled, so the upstream
// does not sample it either, under a span id of the relay's own rather
// than Caddy's server span's.
func TestTraceNotSampled(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	r := tracedRelay("trace-unsampled", up.URL)
	provisionHandler(t, r)
	rec := tracetest.NewSpanRecorder()
	tracer := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithSampler(sdktrace.NeverSample())).Tracer("caddy")

	req := benchServeRequest("trace-unsampled", simpleBody)
	ctx, server := tracer.Start(req.Context(), "caddy", trace.WithSpanKind(trace.SpanKindServer))
	if w, _ := serveHandler(t, r, req.WithContext(ctx)); w.Code != http.StatusOK {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	server.End()
	if n := len(rec.Ended()); n != 0 {
		t.Errorf("%d spans recorded of a request not sampled", n)
	}
	sc := server.SpanContext()
	got := up.Last(t).Header.Get("Traceparent")
	if len(got) != 55 || got[3:35] != sc.TraceID().String() || got[53:] != "00" {
		t.Errorf("the upstream got traceparent %q, want one of trace %s, unsampled", got, sc.TraceID())
	} else if got[36:52] == sc.SpanID().String() {
		t.Errorf("the upstream got Caddy's server span %s as its parent, not the relay's", sc.SpanID())
	}
}

// TestGenAIProviderNames: each built-in provider names its upstream as
// OpenTelemetry's GenAI conventions do; one that does not (mock) is named
// by its module.
func TestGenAIProviderNames(t *testing.T) {
	for name, want := range map[string]attribute.KeyValue{
		"anthropic": semconv.GenAIProviderNameAnthropic,
		"bedrock":   semconv.GenAIProviderNameAWSBedrock,
		"vertex":    semconv.GenAIProviderNameGCPVertexAI,
		"openai":    semconv.GenAIProviderNameOpenAI,
		"mock":      semconv.GenAIProviderNameKey.String("mock"),
	} {
		mod, err := caddy.GetModule(provider.Namespace + "." + name)
		if err != nil {
			t.Fatal(err)
		}
		p := mod.New().(provider.Provider)
		if _, names := p.(provider.GenAINamer); names == (name == "mock") {
			t.Errorf("provider %s implements GenAINamer: %v", name, names)
		}
		if got := semconv.GenAIProviderNameKey.String(genAIName(p)); got != want {
			t.Errorf("provider %s: gen_ai.provider.name %q, want %q", name, got.Value.Emit(), want.Value.Emit())
		}
	}
}

// TestTheSpansNameTheProvider: the attempt's span and the request's carry
// the channel's gen_ai.provider.name, here the default of a provider that
// gives none: its module's name.
func TestTheSpansNameTheProvider(t *testing.T) {
	r := benchServeRelay("trace-mock", "", nil)
	r.Channels[0].UpstreamRaw = upstream("mock")
	provisionHandler(t, r)
	rec := tracetest.NewSpanRecorder()
	tracer := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)).Tracer("caddy")
	req := benchServeRequest("trace-mock", simpleBody)
	ctx, server := tracer.Start(req.Context(), "caddy", trace.WithSpanKind(trace.SpanKindServer))
	if w, _ := serveHandler(t, r, req.WithContext(ctx)); w.Code != http.StatusOK {
		t.Fatalf("status %d: %s", w.Code, w.Body)
	}
	server.End()
	seen := 0
	for _, s := range rec.Ended() {
		if s.Name() != "relay" && s.Name() != "relay.attempt" {
			continue
		}
		seen++
		var got string
		for _, kv := range s.Attributes() {
			if kv.Key == semconv.GenAIProviderNameKey {
				got = kv.Value.Emit()
			}
		}
		if got != "mock" {
			t.Errorf("span %s: gen_ai.provider.name %q, want mock", s.Name(), got)
		}
	}
	if seen != 2 {
		t.Errorf("%d spans of the relay's, want the request's and its attempt's", seen)
	}
}
