package relay

import (
	"context"
	"encoding/binary"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/caddy-relay/relay/provider"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/tidwall/gjson"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.41.0"
	"go.opentelemetry.io/otel/trace"
)

// Traces. With Caddy's `tracing` directive, the request's context holds
// Caddy's server span, made by Caddy's own TracerProvider; the relay adds
// a span `relay` under it for the request and a `relay.attempt` under that
// for each attempt, made by the same provider (no global state). Their
// attributes follow the OpenTelemetry GenAI semantic conventions, plus the
// relay's own (relay.*); none holds a secret, a prompt or a completion.
// Without tracing (no recording span in the context), nothing here runs:
// inbound.tr stays nil, and every method is a no-op on nil.

// tracerName is the instrumentation scope of the relay's spans.
const tracerName = "github.com/caddy-relay/relay"

// Span names and the relay's attributes and events.
const (
	spanRelay   = "relay"
	spanAttempt = "relay.attempt"

	attrKey      = attribute.Key("relay.key")
	attrGroup    = attribute.Key("relay.group")
	attrChannel  = attribute.Key("relay.channel")
	attrOutcome  = attribute.Key("relay.outcome")
	attrCost     = attribute.Key("relay.cost_usd")
	attrCause    = attribute.Key("relay.cause")
	attrAttempts = attribute.Key("relay.attempts")
	attrAttempt  = attribute.Key("relay.attempt")
	attrReason   = attribute.Key("relay.reason")
	attrShared   = attribute.Key("relay.shared")
	attrFeatures = attribute.Key("relay.features")
	attrWait     = attribute.Key("relay.wait_seconds")
	attrPriority = attribute.Key("relay.priority")
	attrError    = attribute.Key("relay.error")

	eventQueueWait   = "relay.queue_wait"
	eventFailover    = "relay.failover"
	eventLearnedLack = "relay.learned_lack"
	eventShared      = "relay.shared"

	// the GenAI usage of cached input, which the semconv package of this
	// module's otel release does not name yet
	attrCacheRead     = attribute.Key("gen_ai.usage.cache_read.input_tokens")
	attrCacheCreation = attribute.Key("gen_ai.usage.cache_creation.input_tokens")
)

// spans is a request's part of a trace: its `relay` span and its current
// attempt's. Made only when Caddy's tracing records the request.
type spans struct {
	tracer  trace.Tracer
	span    trace.Span // relay
	attempt trace.Span // the current relay.attempt; nil between attempts
	sampled bool       // its trace is sampled: metrics carry its id as an exemplar
	traceID string
	// what the answer that reached the client says of itself
	respID, respModel, finish string
}

// startSpans starts the request's `relay` span under the span in req's
// context, and returns req with it; without a recording span there (Caddy's
// tracing is off, or did not sample the request) it returns nil and req,
// and allocates nothing.
func startSpans(req *http.Request) (*spans, *http.Request) {
	parent := trace.SpanFromContext(req.Context())
	if !parent.IsRecording() {
		return nil, req
	}
	tracer := parent.TracerProvider().Tracer(tracerName)
	ctx, span := tracer.Start(req.Context(), spanRelay, trace.WithSpanKind(trace.SpanKindInternal))
	sc := span.SpanContext()
	return &spans{tracer: tracer, span: span, sampled: sc.IsSampled(), traceID: sc.TraceID().String()}, req.WithContext(ctx)
}

// genAIName is gen_ai.provider.name for a channel of provider p: the
// name p gives its upstream (provider.GenAINamer), else its module's name.
func genAIName(p provider.Provider) string {
	if n, ok := p.(provider.GenAINamer); ok {
		if name := n.GenAIProviderName(); name != "" {
			return name
		}
	}
	return moduleName(p)
}

// genAIProvider is the gen_ai.provider.name attribute of ch's spans.
func genAIProvider(ch *channel) attribute.KeyValue {
	return semconv.GenAIProviderNameKey.String(ch.genAIName)
}

// startAttempt starts the span of attempt n on ch.
func (s *spans) startAttempt(in *inbound, ch *channel, n int) {
	if s == nil {
		return
	}
	attrs := make([]attribute.KeyValue, 0, 5)
	attrs = append(attrs, genAIProvider(ch), attrChannel.String(ch.name), attrAttempt.Int(n))
	if in.route == routeMessages { // a message: a batch's or a file's call is no GenAI operation of its own
		attrs = append(attrs, semconv.GenAIOperationNameChat)
	}
	if in.grant.target != "" {
		attrs = append(attrs, semconv.GenAIRequestModel(ch.upstreamModel(in.grant.target)))
	}
	ctx := trace.ContextWithSpan(context.Background(), s.span)
	_, s.attempt = s.tracer.Start(ctx, spanAttempt, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
}

// endAttempt ends the current attempt's span with how it ended: an attempt
// that failed (it did not answer the client) gets the error status, with
// its outcome as error.type.
func (s *spans) endAttempt(in *inbound, res *attemptResult) {
	if s == nil || s.attempt == nil {
		return
	}
	sp := s.attempt
	s.attempt = nil
	v := &res.verdict
	status := res.status
	if res.done {
		status = in.end.status
	}
	sp.SetAttributes(attrOutcome.String(v.outcome.String()), attrReason.String(v.reason))
	if status > 0 {
		sp.SetAttributes(semconv.HTTPResponseStatusCode(status))
	}
	if v.outcome != outcomeSuccess && v.outcome != outcomeCanceled {
		sp.SetAttributes(semconv.ErrorTypeKey.String(v.outcome.String()))
		sp.SetStatus(codes.Error, v.outcome.String()+": "+v.reason)
	}
	sp.End()
}

// failover notes that the request fails over after last.
func (s *spans) failover(last *attemptResult, n int) {
	if s == nil {
		return
	}
	ev := []attribute.KeyValue{attrAttempt.Int(n), attrOutcome.String(last.verdict.outcome.String())}
	if last.channel != nil {
		ev = append(ev, attrChannel.String(last.channel.name))
	}
	s.span.AddEvent(eventFailover, trace.WithAttributes(ev...))
}

// learnedLack notes that ch's refusal taught it that it lacks features.
func (s *spans) learnedLack(ch *channel, features []string) {
	if s == nil {
		return
	}
	s.currentSpan().AddEvent(eventLearnedLack, trace.WithAttributes(attrChannel.String(ch.name), attrFeatures.StringSlice(features)))
}

// queued notes a wait in a group's queue.
func (s *spans) queued(prio string, wait time.Duration) {
	if s == nil {
		return
	}
	s.span.AddEvent(eventQueueWait, trace.WithAttributes(attrPriority.String(prio), attrWait.Float64(wait.Seconds())))
}

func (s *spans) currentSpan() trace.Span {
	if s.attempt != nil {
		return s.attempt
	}
	return s.span
}

// fromMessage reads what a non-streaming answer says of itself: its id,
// model and stop reason (never its content).
func (s *spans) fromMessage(body []byte) {
	if s == nil {
		return
	}
	r := gjson.GetMany(jsonscan.String(body), "id", "model", "stop_reason")
	s.respID, s.respModel, s.finish = strings.Clone(r[0].Str), strings.Clone(r[1].Str), strings.Clone(r[2].Str)
}

// fromEvent reads the same from a stream's events: message_start's
// message and message_delta's stop reason.
func (s *spans) fromEvent(name, data []byte) {
	if s == nil {
		return
	}
	d := jsonscan.String(data)
	switch string(name) {
	case "message_start":
		r := gjson.GetMany(d, "message.id", "message.model")
		s.respID, s.respModel = strings.Clone(r[0].Str), strings.Clone(r[1].Str)
	case "message_delta":
		if r := gjson.Get(d, "delta.stop_reason"); r.Str != "" {
			s.finish = strings.Clone(r.Str)
		}
	}
}

// end ends the request's span with what account knows of it.
func (s *spans) end(in *inbound, priced bool) {
	if s == nil {
		return
	}
	if s.attempt != nil { // a panic on the way: no attempt stays open
		s.attempt.End()
		s.attempt = nil
	}
	attrs := make([]attribute.KeyValue, 0, 24)
	if in.who.key != nil {
		attrs = append(attrs, attrKey.String(in.who.key.name), attrGroup.String(in.who.key.group.name))
	}
	if in.route == routeMessages {
		attrs = append(attrs, semconv.GenAIOperationNameChat, semconv.GenAIRequestStream(in.ask.stream))
	}
	if in.ask.model != "" {
		attrs = append(attrs, semconv.GenAIRequestModel(in.ask.model))
	}
	if in.ask.maxOut > 0 {
		attrs = append(attrs, semconv.GenAIRequestMaxTokens(int(in.ask.maxOut)))
	}
	outcome := in.end.errCode // the relay's own answer
	if n := len(in.end.chain); n > 0 && in.end.errCode == "" {
		outcome = in.end.chain[n-1].outcome.String()
	}
	if in.end.shared != "" {
		outcome = "shared"
		attrs = append(attrs, attrShared.String(in.end.shared))
		s.span.AddEvent(eventShared, trace.WithAttributes(attrShared.String(in.end.shared)))
	}
	if outcome != "" {
		attrs = append(attrs, attrOutcome.String(outcome))
	}
	attrs = append(attrs, attrCause.String(in.causeLabel()), attrAttempts.Int(in.end.attempts),
		semconv.HTTPResponseStatusCode(in.end.status))
	if ch := in.end.answered; ch != nil {
		u := in.end.usage
		attrs = append(attrs, attrChannel.String(ch.name), genAIProvider(ch),
			semconv.GenAIUsageInputTokens(int(u.prompt())), semconv.GenAIUsageOutputTokens(int(u.output)),
			attrCacheRead.Int64(u.cacheRead), attrCacheCreation.Int64(u.cacheWrite))
		if s.respModel != "" {
			attrs = append(attrs, semconv.GenAIResponseModel(s.respModel))
		}
		if s.respID != "" {
			attrs = append(attrs, semconv.GenAIResponseID(s.respID))
		}
		if s.finish != "" {
			attrs = append(attrs, semconv.GenAIResponseFinishReasons(s.finish))
		}
	}
	if priced {
		attrs = append(attrs, attrCost.Float64(in.end.cost))
	}
	if in.end.errCode != "" {
		attrs = append(attrs, attrError.String(in.end.errCode))
	}
	s.span.SetAttributes(attrs...)
	if in.end.status >= 500 {
		s.span.SetStatus(codes.Error, outcome)
	}
	s.span.End()
}

// observe records v in h, with the request's trace id as its exemplar
// when the request's trace is sampled.
func (s *spans) observe(h prometheus.Observer, v float64) {
	if s != nil && s.sampled {
		if eo, ok := h.(prometheus.ExemplarObserver); ok {
			eo.ObserveWithExemplar(v, prometheus.Labels{"trace_id": s.traceID})
			return
		}
	}
	h.Observe(v)
}

// injectTraceparent sets the W3C traceparent of the relay's own span on an
// upstream request's header, for a channel with forward_traceparent: the
// current attempt's span (else the request's, for a call made outside the
// attempt loop), so the upstream continues the trace under the attempt
// that called it. A request whose trace the sampler dropped has no span of
// the relay's; it sends the trace's id, unsampled, under a span id the
// relay makes for the call, so the upstream drops the trace too and never
// names the client's or Caddy's span as its parent. No tracestate is sent:
// it holds what the client's vendors put there, which is no upstream's
// business. Without tracing there is no trace, and nothing is sent.
func (s *spans) injectTraceparent(ctx context.Context, h http.Header) {
	var sc trace.SpanContext
	switch {
	case s != nil && s.attempt != nil:
		sc = s.attempt.SpanContext()
	case s != nil:
		sc = s.span.SpanContext()
	default:
		sc = trace.SpanContextFromContext(ctx)
		if !sc.IsValid() {
			return
		}
		sc = sc.WithSpanID(newSpanID()).WithTraceFlags(sc.TraceFlags() &^ trace.FlagsSampled)
	}
	sc = sc.WithTraceState(trace.TraceState{})
	propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(ctx, sc), propagation.HeaderCarrier(h))
}

// newSpanID is a random span id, never the invalid all-zero one.
func newSpanID() trace.SpanID {
	var id trace.SpanID
	for !id.IsValid() {
		binary.BigEndian.PutUint64(id[:], rand.Uint64())
	}
	return id
}
