package relay

// The traces, end to end: Caddy's own `tracing` directive, its own OTLP
// exporter (configured by the OTEL_* variables, as an operator does), and
// an OTLP/HTTP receiver in the test that decodes what it gets.

import (
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// otlpReceiver is an OTLP/HTTP traces endpoint on 127.0.0.1 that keeps
// every span it receives, and signals each export.
type otlpReceiver struct {
	*httptest.Server
	mu    sync.Mutex
	spans []*tracepb.Span
	res   []*commonpb.KeyValue // the resource attributes of every export
	got   chan struct{}
}

func (o *otlpReceiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" || r.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "not an OTLP/HTTP protobuf export of traces", http.StatusBadRequest)
		return
	}
	var body io.Reader = r.Body
	if r.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = gz
	}
	raw, err := io.ReadAll(body)
	var req coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(raw, &req)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	o.mu.Lock()
	for _, rs := range req.ResourceSpans {
		o.res = append(o.res, rs.GetResource().GetAttributes()...)
		for _, ss := range rs.ScopeSpans {
			o.spans = append(o.spans, ss.Spans...)
		}
	}
	o.mu.Unlock()
	select {
	case o.got <- struct{}{}:
	default:
	}
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// otlp is the tests' receiver, started once: Caddy's tracing keeps one
// TracerProvider (and its exporter) while any config uses it, so every
// config of these tests exports to the same endpoint. Its address reaches
// Caddy's exporter as an operator gives it: OTEL_* variables.
var otlp = sync.OnceValue(func() *otlpReceiver {
	o := &otlpReceiver{got: make(chan struct{}, 1)}
	o.Server = httptest.NewServer(o)
	for k, v := range map[string]string{
		"OTEL_TRACES_EXPORTER":        "otlp",
		"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
		"OTEL_EXPORTER_OTLP_ENDPOINT": o.URL,
		"OTEL_BSP_SCHEDULE_DELAY":     "20", // ms: the batch goes out at once
		"OTEL_TRACES_SAMPLER":         "parentbased_always_on",
		"OTEL_PROPAGATORS":            "tracecontext",
	} {
		_ = os.Setenv(k, v)
	}
	return o
})

// trace waits (on the receiver's exports, up to bound) until the spans of
// traceID satisfy done, and returns them.
func (o *otlpReceiver) trace(t *testing.T, traceID string, bound time.Duration, done func([]*tracepb.Span) bool) []*tracepb.Span {
	t.Helper()
	timeout := time.After(bound)
	for {
		o.mu.Lock()
		var out []*tracepb.Span
		for _, s := range o.spans {
			if hex.EncodeToString(s.TraceId) == traceID {
				out = append(out, s)
			}
		}
		o.mu.Unlock()
		if done(out) {
			return out
		}
		select {
		case <-o.got:
		case <-timeout:
			t.Fatalf("trace %s: not whole within %v; received:\n%s", traceID, bound, renderTrace(out))
		}
	}
}

// named returns the spans called name.
func named(spans []*tracepb.Span, name string) []*tracepb.Span {
	var out []*tracepb.Span
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

// attr returns the value of a span's (or an event's) attribute, rendered;
// "" when it has none.
func attr(kvs []*commonpb.KeyValue, key string) string {
	for _, kv := range kvs {
		if kv.Key == key {
			return anyValue(kv.Value)
		}
	}
	return ""
}

func anyValue(v *commonpb.AnyValue) string {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_IntValue:
		return fmt.Sprint(x.IntValue)
	case *commonpb.AnyValue_DoubleValue:
		return fmt.Sprint(x.DoubleValue)
	case *commonpb.AnyValue_BoolValue:
		return fmt.Sprint(x.BoolValue)
	case *commonpb.AnyValue_ArrayValue:
		var parts []string
		for _, e := range x.ArrayValue.Values {
			parts = append(parts, anyValue(e))
		}
		return "[" + strings.Join(parts, " ") + "]"
	case *commonpb.AnyValue_BytesValue:
		return string(x.BytesValue)
	case *commonpb.AnyValue_KvlistValue:
		var parts []string
		for _, kv := range x.KvlistValue.Values {
			parts = append(parts, kv.Key+"="+anyValue(kv.Value))
		}
		return "{" + strings.Join(parts, " ") + "}"
	}
	return ""
}

// renderTrace draws spans as a text tree: each span under its parent, with
// its kind, status, attributes and events (docs/observability.md shows
// one).
func renderTrace(spans []*tracepb.Span) string {
	ids := map[string]bool{}
	children := map[string][]*tracepb.Span{}
	for _, s := range spans {
		ids[string(s.SpanId)] = true
	}
	var roots []*tracepb.Span
	for _, s := range spans {
		if ids[string(s.ParentSpanId)] {
			children[string(s.ParentSpanId)] = append(children[string(s.ParentSpanId)], s)
		} else {
			roots = append(roots, s)
		}
	}
	var b strings.Builder
	var draw func(s *tracepb.Span, indent string)
	draw = func(s *tracepb.Span, indent string) {
		kind := strings.ToLower(strings.TrimPrefix(s.Kind.String(), "SPAN_KIND_"))
		status := strings.ToLower(strings.TrimPrefix(s.GetStatus().GetCode().String(), "STATUS_CODE_"))
		fmt.Fprintf(&b, "%s%s (%s, %s, %v)\n", indent, s.Name, kind, status,
			time.Duration(s.EndTimeUnixNano-s.StartTimeUnixNano).Round(100*time.Microsecond))
		var lines []string
		for _, kv := range s.Attributes {
			if strings.HasPrefix(kv.Key, "gen_ai.") || strings.HasPrefix(kv.Key, "relay.") || kv.Key == "error.type" || kv.Key == "http.response.status_code" {
				lines = append(lines, kv.Key+" = "+anyValue(kv.Value))
			}
		}
		sort.Strings(lines)
		for _, l := range lines {
			fmt.Fprintf(&b, "%s    %s\n", indent, l)
		}
		for _, e := range s.Events {
			var kvs []string
			for _, kv := range e.Attributes {
				kvs = append(kvs, kv.Key+"="+anyValue(kv.Value))
			}
			fmt.Fprintf(&b, "%s    event %s {%s}\n", indent, e.Name, strings.Join(kvs, ", "))
		}
		kids := children[string(s.SpanId)]
		sort.Slice(kids, func(i, j int) bool { return kids[i].StartTimeUnixNano < kids[j].StartTimeUnixNano })
		for _, c := range kids {
			draw(c, indent+"  ")
		}
	}
	for _, r := range roots {
		draw(r, "")
	}
	return b.String()
}

// newTraceparent is a client's sampled W3C traceparent, and its trace id.
func newTraceparent() (header, traceID string) {
	var b [24]byte
	_, _ = rand.Read(b[:])
	traceID = hex.EncodeToString(b[:16])
	return "00-" + traceID + "-" + hex.EncodeToString(b[16:]) + "-01", traceID
}

// tracingSite is the site's tracing (Caddy's server span is "caddy") and
// an OpenMetrics endpoint, ahead of the relay.
const tracingSite = "\ttracing {\n\t\tspan caddy\n\t}\n\tmetrics /metrics\n"

// TestTracesFailover: a request whose first channel answers 529 is one
// `relay` span under Caddy's server span, with a `relay.attempt` child for
// each attempt (the first in error, with its outcome), attributes by the
// GenAI conventions and the relay's own; the second channel, with
// forward_traceparent, gets its attempt's traceparent and the first,
// without it, none (though the client sent one); the request's duration
// carries the trace id as its exemplar on /metrics in OpenMetrics.
func TestTracesFailover(t *testing.T) {
	rcv := otlp()
	over := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	ok := fakeupstream.New(t, fakeupstream.Message("the answer"))
	startRelayWith(t, tracingSite,
		channelBlock("trace-over", over.URL, "priority 1")+
			channelBlock("trace-ok", ok.URL, "priority 2", "forward_traceparent")+
			keyAndGroup("trace-g", "trace-over trace-ok"))

	tp, traceID := newTraceparent()
	r := message(t, simpleBody, "Traceparent", tp)
	if r.status != http.StatusOK || r.header.Get("X-Relay-Attempts") != "2" {
		t.Fatalf("status %d, attempts %q: %s", r.status, r.header.Get("X-Relay-Attempts"), r.body)
	}

	spans := rcv.trace(t, traceID, 10*time.Second, func(s []*tracepb.Span) bool {
		return len(named(s, "caddy")) == 1 && len(named(s, "relay")) == 1 && len(named(s, "relay.attempt")) == 2
	})
	t.Logf("the trace received:\n%s", renderTrace(spans))
	server, relay, attempts := named(spans, "caddy")[0], named(spans, "relay")[0], named(spans, "relay.attempt")
	if !bytes.Equal(relay.ParentSpanId, server.SpanId) {
		t.Errorf("relay span's parent %x, want Caddy's server span %x", relay.ParentSpanId, server.SpanId)
	}
	sort.Slice(attempts, func(i, j int) bool { return attempts[i].StartTimeUnixNano < attempts[j].StartTimeUnixNano })
	for i, a := range attempts {
		if !bytes.Equal(a.ParentSpanId, relay.SpanId) {
			t.Errorf("attempt %d's parent %x, want the relay span %x", i+1, a.ParentSpanId, relay.SpanId)
		}
		if a.Kind != tracepb.Span_SPAN_KIND_CLIENT {
			t.Errorf("attempt %d is of kind %v", i+1, a.Kind)
		}
	}
	want := func(s *tracepb.Span, kv ...string) {
		t.Helper()
		for i := 0; i+1 < len(kv); i += 2 {
			if got := attr(s.Attributes, kv[i]); got != kv[i+1] {
				t.Errorf("span %s: %s = %q, want %q", s.Name, kv[i], got, kv[i+1])
			}
		}
	}
	first, second := attempts[0], attempts[1]
	if first.GetStatus().GetCode() != tracepb.Status_STATUS_CODE_ERROR {
		t.Errorf("the 529 attempt's status is %v, want error", first.GetStatus())
	}
	want(first, "relay.channel", "trace-over", "relay.outcome", "overloaded", "error.type", "overloaded",
		"http.response.status_code", "529", "relay.attempt", "1",
		"gen_ai.provider.name", "anthropic", "gen_ai.operation.name", "chat", "gen_ai.request.model", "claude-sonnet-4-5")
	if second.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR {
		t.Errorf("the answering attempt's status is %v", second.GetStatus())
	}
	want(second, "relay.channel", "trace-ok", "relay.outcome", "success", "http.response.status_code", "200", "relay.attempt", "2", "error.type", "")
	sum := sha256.Sum256([]byte(clientKey))
	want(relay, "relay.key", defaultKeyName(hex.EncodeToString(sum[:])), "relay.group", "trace-g", "relay.channel", "trace-ok", "relay.outcome", "success",
		"relay.attempts", "2", "relay.cause", "ok",
		"gen_ai.provider.name", "anthropic", "gen_ai.operation.name", "chat",
		"gen_ai.request.model", "claude-sonnet-4-5", "gen_ai.response.model", "claude-sonnet-4-5",
		"gen_ai.request.max_tokens", "16", "gen_ai.usage.input_tokens", "10", "gen_ai.usage.output_tokens", "5",
		"gen_ai.response.finish_reasons", "[end_turn]", "gen_ai.response.id", "msg_fake", "gen_ai.request.stream", "false")
	if cost := attr(relay.Attributes, "relay.cost_usd"); cost == "" || cost == "0" {
		t.Errorf("relay.cost_usd = %q, want the request's cost", cost)
	}
	if i := slices.IndexFunc(relay.Events, func(e *tracepb.Span_Event) bool { return e.Name == "relay.failover" }); i < 0 {
		t.Errorf("no relay.failover event on the relay span: %v", relay.Events)
	} else if e := relay.Events[i]; attr(e.Attributes, "relay.channel") != "trace-over" || attr(e.Attributes, "relay.outcome") != "overloaded" {
		t.Errorf("the failover event says %v", e.Attributes)
	}

	// traceparent: none to the channel without forward_traceparent, though
	// the client sent one and Caddy's tracing set its own on the request;
	// the attempt's own to the channel with it
	if got := over.Last(t).Header.Values("Traceparent"); len(got) > 0 {
		t.Errorf("the channel without forward_traceparent got traceparent %q", got)
	}
	wantTP := "00-" + traceID + "-" + hex.EncodeToString(second.SpanId) + "-01"
	if got := ok.Last(t).Header.Get("Traceparent"); got != wantTP {
		t.Errorf("the channel with forward_traceparent got traceparent %q, want its attempt's %q", got, wantTP)
	}

	// the exemplar: in OpenMetrics, which the site's metrics handler
	// serves to a scraper that asks for it
	req, _ := http.NewRequest(http.MethodGet, relayURL+"/metrics", nil)
	req.Header.Set("Accept", "application/openmetrics-text; version=1.0.0")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/openmetrics-text") {
		t.Fatalf("/metrics answered %q", ct)
	}
	exemplar := `# {trace_id="` + traceID + `"}`
	for _, family := range []string{`relay_request_duration_seconds_bucket{group="trace-g"`, `relay_upstream_first_byte_seconds_bucket{channel="trace-ok"`} {
		found := false
		for line := range strings.SplitSeq(string(raw), "\n") {
			if strings.HasPrefix(line, family) && strings.Contains(line, exemplar) {
				found = true
			}
		}
		if !found {
			t.Errorf("no bucket of %s} carries the exemplar %s", family, exemplar)
		}
	}
}

// TestTracesCarryNoSecrets: no span of a request (streamed or not) holds
// the client's key, the channel's credential, the prompt or the
// completion, in any attribute, event or resource attribute; a stream's
// relay span still has its response's id, model and finish reason.
func TestTracesCarryNoSecrets(t *testing.T) {
	rcv := otlp()
	const prompt, completion = "PROMPT-TEXT-a1b2c3", "COMPLETION-TEXT-d4e5f6"
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(mustRead(r), `"stream":true`) {
			fakeupstream.Stream(fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 12, OutputTokens: 7}, completion)...)(w, r)
			return
		}
		fakeupstream.Message(completion)(w, r)
	}))
	startRelayWith(t, tracingSite, channelBlock("trace-secret", up.URL, "forward_traceparent")+keyAndGroup("trace-s", "trace-secret"))

	for _, stream := range []bool{false, true} {
		body := fmt.Sprintf(`{"model":"claude-sonnet-4-5","max_tokens":32,"stream":%v,"messages":[{"role":"user","content":%q}]}`, stream, prompt)
		tp, traceID := newTraceparent()
		r := message(t, body, "Traceparent", tp)
		if r.status != http.StatusOK || !strings.Contains(string(r.body), completion) {
			t.Fatalf("stream %v: status %d: %s", stream, r.status, r.body)
		}
		spans := rcv.trace(t, traceID, 10*time.Second, func(s []*tracepb.Span) bool {
			return len(named(s, "caddy")) == 1 && len(named(s, "relay")) == 1 && len(named(s, "relay.attempt")) == 1
		})
		relay := named(spans, "relay")[0]
		if got := attr(relay.Attributes, "gen_ai.response.finish_reasons"); got != "[end_turn]" {
			t.Errorf("stream %v: finish reasons %q", stream, got)
		}
		if got := attr(relay.Attributes, "gen_ai.response.id"); got != "msg_fake" {
			t.Errorf("stream %v: response id %q", stream, got)
		}
		if got := attr(relay.Attributes, "gen_ai.request.stream"); got != fmt.Sprint(stream) {
			t.Errorf("stream %v: gen_ai.request.stream %q", stream, got)
		}
		var values []string
		for _, s := range spans {
			for _, kv := range s.Attributes {
				values = append(values, kv.Key+"="+anyValue(kv.Value))
			}
			for _, e := range s.Events {
				values = append(values, e.Name)
				for _, kv := range e.Attributes {
					values = append(values, kv.Key+"="+anyValue(kv.Value))
				}
			}
			values = append(values, s.Name, s.GetStatus().GetMessage())
		}
		rcv.mu.Lock()
		for _, kv := range rcv.res {
			values = append(values, kv.Key+"="+anyValue(kv.Value))
		}
		rcv.mu.Unlock()
		for _, v := range values {
			for _, secret := range []string{clientKey, channelKey, prompt, completion} {
				if strings.Contains(v, secret) {
					t.Errorf("stream %v: a span holds %q: %s", stream, secret, v)
				}
			}
		}
	}
}

// TestTraceparentIsTheRelays: a channel with forward_traceparent sends the
// relay's own context upstream, never the client's: for a sampled trace,
// the client's trace id with the span id of the attempt that sent it; for
// a trace the sampler dropped, the client's trace id, unsampled, with a
// span id of the relay's own for each attempt (neither the client's nor
// shared by two attempts). The client's tracestate, which carries what
// its vendors put there, reaches no upstream.
func TestTraceparentIsTheRelays(t *testing.T) {
	rcv := otlp()
	const state = "vendor=client-secret-state"
	parse := func(who, tp string) (traceID, spanID, flags string) {
		t.Helper()
		p := strings.Split(tp, "-")
		if len(p) != 4 || p[0] != "00" || len(p[1]) != 32 || len(p[2]) != 16 || len(p[3]) != 2 {
			t.Fatalf("%s got traceparent %q", who, tp)
		}
		return p[1], p[2], p[3]
	}

	for _, sampled := range []bool{true, false} {
		t.Run(map[bool]string{true: "sampled", false: "dropped"}[sampled], func(t *testing.T) {
			// channels of their own: the first 529 cools its channel
			over := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
			ok := fakeupstream.New(t, fakeupstream.Message("the answer"))
			g := fmt.Sprintf("tp-%v", sampled)
			startRelayWith(t, tracingSite,
				channelBlock(g+"-over", over.URL, "priority 1", "forward_traceparent")+
					channelBlock(g+"-ok", ok.URL, "priority 2", "forward_traceparent")+
					keyAndGroup(g, g+"-over "+g+"-ok"))
			tp, traceID := newTraceparent()
			clientSpan := tp[36:52]
			if !sampled {
				tp = tp[:53] + "00"
			}
			r := message(t, simpleBody, "Traceparent", tp, "Tracestate", state)
			if r.status != http.StatusOK || r.header.Get("X-Relay-Attempts") != "2" {
				t.Fatalf("status %d, attempts %q: %s", r.status, r.header.Get("X-Relay-Attempts"), r.body)
			}
			var sent [2]string
			for i, up := range []*fakeupstream.Upstream{over, ok} {
				h := up.Last(t).Header
				if got := h.Values("Tracestate"); len(got) > 0 {
					t.Errorf("attempt %d sent the client's tracestate upstream: %q", i+1, got)
				}
				gotTrace, span, flags := parse(fmt.Sprintf("attempt %d", i+1), h.Get("Traceparent"))
				if gotTrace != traceID {
					t.Errorf("attempt %d sent trace %s, want the client's %s", i+1, gotTrace, traceID)
				}
				if wantFlags := map[bool]string{true: "01", false: "00"}[sampled]; flags != wantFlags {
					t.Errorf("attempt %d sent flags %s, want %s", i+1, flags, wantFlags)
				}
				if span == clientSpan {
					t.Errorf("attempt %d sent the client's own span id %s as its parent", i+1, span)
				}
				sent[i] = span
			}
			if sent[0] == sent[1] {
				t.Errorf("both attempts sent span id %s: not each its own", sent[0])
			}
			if !sampled {
				return
			}
			spans := rcv.trace(t, traceID, 10*time.Second, func(s []*tracepb.Span) bool {
				return len(named(s, "relay.attempt")) == 2
			})
			attempts := named(spans, "relay.attempt")
			sort.Slice(attempts, func(i, j int) bool { return attempts[i].StartTimeUnixNano < attempts[j].StartTimeUnixNano })
			for i, a := range attempts {
				if want := hex.EncodeToString(a.SpanId); sent[i] != want {
					t.Errorf("attempt %d sent span id %s, want its own span's %s", i+1, sent[i], want)
				}
			}
		})
	}
}

// TestTraceparentWithoutTracing: without Caddy's tracing there is no span
// to forward, and the client's own traceparent does not reach the
// upstream, forward_traceparent or not.
func TestTraceparentWithoutTracing(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, channelBlock("trace-off", up.URL, "forward_traceparent")+keyAndGroup("trace-off", "trace-off"))
	tp, _ := newTraceparent()
	if r := message(t, simpleBody, "Traceparent", tp, "Tracestate", "vendor=1"); r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	h := up.Last(t).Header
	if h.Get("Traceparent") != "" || h.Get("Tracestate") != "" {
		t.Errorf("without tracing the upstream got traceparent %q, tracestate %q", h.Get("Traceparent"), h.Get("Tracestate"))
	}
}

// TestTraceEvents: a feature an upstream's refusal shows its channel lacks
// is an event of the attempt that learned it; a retry answered from the
// attempt it repeats is a relay span without attempts, marked shared; a
// wait in the group's queue is an event of the relay span.
func TestTraceEvents(t *testing.T) {
	rcv := otlp()
	forgetDedups(t)
	event := func(s *tracepb.Span, name string) *tracepb.Span_Event {
		for _, e := range s.Events {
			if e.Name == name {
				return e
			}
		}
		t.Errorf("span %s has no event %s: %v", s.Name, name, s.Events)
		return &tracepb.Span_Event{}
	}

	// a learned lack
	first := fakeupstream.New(t, lacking("first", "context_management", ""))
	second := fakeupstream.New(t, fakeupstream.Message("second"))
	startRelayWith(t, tracingSite, channelBlock("tev-lack", first.URL, "priority 1")+channelBlock("tev-has", second.URL, "priority 2")+
		keyAndGroup("tev-l", "tev-lack tev-has"))
	tp, traceID := newTraceparent()
	withFeature := `{"model":"claude-sonnet-4-5","max_tokens":8,"context_management":{"edits":[{"type":"clear_tool_uses_20250919"}]},"messages":[{"role":"user","content":"Hi"}]}`
	if r := message(t, withFeature, "Traceparent", tp); r.status != http.StatusOK || second.Hits() != 1 {
		t.Fatalf("status %d, second channel's hits %d: %s", r.status, second.Hits(), r.body)
	}
	spans := rcv.trace(t, traceID, 10*time.Second, func(s []*tracepb.Span) bool {
		return len(named(s, "relay")) == 1 && len(named(s, "relay.attempt")) == 2
	})
	attempts := named(spans, "relay.attempt")
	sort.Slice(attempts, func(i, j int) bool { return attempts[i].StartTimeUnixNano < attempts[j].StartTimeUnixNano })
	if got := attr(attempts[0].Attributes, "relay.outcome"); got != "lacks_feature" || attempts[0].GetStatus().GetCode() != tracepb.Status_STATUS_CODE_ERROR {
		t.Errorf("the refused attempt: outcome %q, status %v", got, attempts[0].GetStatus())
	}
	if e := event(attempts[0], "relay.learned_lack"); attr(e.Attributes, "relay.channel") != "tev-lack" || attr(e.Attributes, "relay.features") != "[context_management]" {
		t.Errorf("the learned lack says %v", e.Attributes)
	}

	// a retry attached to its first attempt, and a wait in the queue
	up := newGatedUpstream(t)
	t.Cleanup(func() {
		select {
		case <-up.gate:
		default:
			close(up.gate)
		}
	})
	startRelayWith(t, tracingSite, channelBlock("tev-q", up.URL, "concurrency 1")+keyAndGroup("tev-q", "tev-q"))
	retryTP, retryID := newTraceparent()
	queuedTP, queuedID := newTraceparent()
	var wg sync.WaitGroup
	replies := make([]reply, 3)
	post := func(i int, body string, header ...string) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if replies[i], err = do(http.MethodPost, "/v1/messages", clientKey, body, header...); err != nil {
				t.Error(err)
			}
		}()
	}
	post(0, bodyWithID("lead"), "X-Stainless-Retry-Count", "0")
	<-up.arrived
	post(1, bodyWithID("lead"), "X-Stainless-Retry-Count", "1", "Traceparent", retryTP)
	waitFor(t, "the retry attaches", 5*time.Second, func() bool { return dedupFollowers() == 1 })
	post(2, bodyWithID("queued"), "Traceparent", queuedTP)
	waitFor(t, "a request queues", 5*time.Second, func() bool { return queueDepth(t, "tev-q", "normal") == 1 })
	close(up.gate)
	wg.Wait()
	for i, r := range replies {
		if r.status != http.StatusOK {
			t.Fatalf("request %d: status %d: %s", i, r.status, r.body)
		}
	}
	if n := up.Hits(); n != 2 {
		t.Errorf("upstream hits %d, want 2 (the retry shares its first attempt's)", n)
	}
	spans = rcv.trace(t, retryID, 10*time.Second, func(s []*tracepb.Span) bool { return len(named(s, "relay")) == 1 })
	relay := named(spans, "relay")[0]
	if got := attr(relay.Attributes, "relay.shared"); got != "dedup" || attr(relay.Attributes, "relay.outcome") != "shared" || len(named(spans, "relay.attempt")) != 0 {
		t.Errorf("the retry's relay span: shared %q, outcome %q, %d attempts", got, attr(relay.Attributes, "relay.outcome"), len(named(spans, "relay.attempt")))
	}
	event(relay, "relay.shared")
	spans = rcv.trace(t, queuedID, 10*time.Second, func(s []*tracepb.Span) bool {
		return len(named(s, "relay")) == 1 && len(named(s, "relay.attempt")) == 1
	})
	if e := event(named(spans, "relay")[0], "relay.queue_wait"); attr(e.Attributes, "relay.priority") != "normal" || attr(e.Attributes, "relay.wait_seconds") == "" {
		t.Errorf("the queue wait says %v", e.Attributes)
	}
}

// BenchmarkServeHTTPTraced is BenchmarkServeHTTP with each request under a
// recording server span, as Caddy's tracing makes it (a provider without
// an exporter): what the relay's spans, attributes and exemplars cost.
func BenchmarkServeHTTPTraced(b *testing.B) {
	up := fakeupstream.Start(fakeupstream.Fast(), false)
	defer up.Close()
	name := "bench-traced"
	tracer := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample())).Tracer("caddy")
	benchLoop(b, benchServeRelay(name, up.URL, nil), len(benchBody), func(int) *http.Request {
		req := benchServeRequest(name, benchBody)
		ctx, _ := tracer.Start(req.Context(), "caddy", trace.WithSpanKind(trace.SpanKindServer))
		return req.WithContext(ctx)
	})
}
