package relay

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/provider"
	"go.uber.org/zap"
)

// attempting is the state of a request's current attempt, which the
// attempt step owns: the Call its channel's provider builds the upstream
// request from, what that channel strips from the body, and the writes of
// the client's body still under way.
type attempting struct {
	call  provider.Call // the current attempt's, for its provider
	strip features.Set  // the features the current attempt's channel removes
	// thinkingTo, when set, is the signature domain of the current
	// attempt's channel, which gets the body without the thinking blocks
	// it did not sign (thinking.go)
	thinkingTo string
	// trace is the current attempt's trace, in its context already:
	// NewRequest sets its WroteRequest rather than add a trace of its own
	// (a second one is composed with the first by reflection, and would
	// fire the first's hook as well)
	trace *httptrace.ClientTrace
	// writing counts the upstream requests whose transport may still read
	// the body: net/http may write a request body even after RoundTrip
	// returned, until its WroteRequest trace says it is done.
	writing atomic.Int32
}

// callFor is the Call of an attempt of the request on ch: the request as
// the channel's provider sees it. One Call serves the request's attempts in
// turn.
func (in *inbound) callFor(ch *channel) *provider.Call {
	in.try.call = provider.NewCall(provider.Call{Channel: ch.name, Path: in.route.upstreamPath(), RawQuery: in.ask.rawQuery, Header: in.ask.header,
		Model: ch.upstreamModel(in.grant.target), Stream: in.ask.stream}, in)
	in.try.strip, in.try.thinkingTo = 0, ""
	if in.grant.sel.signer != "" {
		in.try.thinkingTo = in.thinkingFor(ch)
	}
	if !in.ask.needs.Empty() {
		set, betas := ch.stripFor(in.ask.needs, in.grant.sel.now)
		in.try.strip = set
		if len(betas) > 0 {
			in.try.call.Header = features.StripBetas(in.ask.header, betas)
		}
	}
	return &in.try.call
}

// Body implements provider.Source: the client's body with model in place
// of its own, without the features the current attempt's channel strips.
// When nothing changes it is the pooled buffer itself, not a copy.
func (in *inbound) Body(model string) []byte {
	body, start, end := in.outBody()
	if model == in.ask.model && in.try.strip == 0 && in.try.thinkingTo == "" {
		return body
	}
	out := body
	if model != in.ask.model {
		out = make([]byte, 0, len(body)+len(model)-len(in.ask.model))
		out = append(out, body[:start]...)
		out = append(out, '"')
		out = append(out, model...)
		out = append(out, '"')
		out = append(out, body[end:]...)
	}
	if in.try.strip != 0 {
		// the body is valid JSON (inspect checked): this cannot fail
		if stripped, err := features.StripBody(out, in.try.strip); err == nil {
			out = stripped
		}
	}
	if in.try.thinkingTo != "" {
		out, _ = stripThinking(out, in.try.thinkingTo)
	}
	return out
}

// NewRequest implements provider.Source: an upstream request with body b,
// which may share the client body's pooled buffer: the request then traces
// when the transport is done writing it, which releaseBody waits for. The
// body stays a *bytes.Reader, which net/http writes best.
func (in *inbound) NewRequest(ctx context.Context, method, url string, b []byte) (*http.Request, error) {
	getBody := func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	shared := len(b) > 0 && len(in.ask.body) > 0 && &b[0] == &in.ask.body[0] // else a copy (a mapped model): nothing shared
	if shared {
		// every write of a request made with the attempt's own trace in
		// its context is counted by that trace's hook, set once; any other
		// context gets a trace of its own (composed with what it has)
		if t := httptrace.ContextClientTrace(ctx); t != nil && t == in.try.trace {
			t.WroteRequest = in.wrote
		} else {
			ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteRequest: in.wrote})
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.GetBody = getBody
	if shared {
		in.try.writing.Add(1)
		req.GetBody = func() (io.ReadCloser, error) {
			in.try.writing.Add(1) // a retry of the write, on a new connection
			return getBody()
		}
	}
	return req, nil
}

// wrote is the WroteRequest trace of an upstream request that shares the
// body's buffer.
func (in *inbound) wrote(httptrace.WroteRequestInfo) { in.try.writing.Add(-1) }

// attemptResult is how one attempt ended. When done, the client has its
// answer (or is gone); otherwise the relay may try another channel, and
// status, header and body hold the upstream's answer for the client in case
// this attempt stays the last one (status 0: there was no answer).
type attemptResult struct {
	verdict   verdict
	done      bool
	final     bool // no other attempt may follow (an upload that was sent in part)
	channel   *channel
	firstByte time.Duration // until the upstream's response headers
	status    int
	header    http.Header
	body      []byte
	// accepted says that the upstream took the request and was working on
	// it when the attempt ended: it timed out after connecting, the client
	// left meanwhile, or its 2xx answer broke before it proved itself. An
	// error answer was not accepted. Abandoned, its input is wasted.
	accepted bool
	wasted   int64 // the input tokens wasted, once the attempt is abandoned
	// prompt is the usage of the input of an accepted attempt that
	// ended before its answer: as the upstream counted it (a stream's
	// message_start), else the input estimate (estimatedInput). A client
	// that left is charged it (settle.go).
	prompt         usage
	estimatedInput bool
}

// attempt runs one admitted attempt of a message (its exchange with the
// upstream) and records its verdict in the channel's health. The ticket is
// released on every path, a panic included.
func (r *Relay) attempt(w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int, t *ticket) attemptResult {
	defer t.release(r.now)
	start := time.Now()
	res := r.exchange(w, req, in, ch, n)
	var tokens int64 // what the attempt spent of the channel's token limit
	if in.end.answered == ch {
		tokens = in.billed()
	}
	if !res.done {
		// nothing of it reached the client, whose accounting never has its
		// tokens; what the upstream processed is wasted if the attempt is
		// abandoned, and the channel's quota spent it all the same
		if res.accepted && in.route == routeMessages {
			res.wasted, tokens = in.ask.estimate, in.ask.estimate
			res.prompt, res.estimatedInput = usage{input: in.ask.estimate}, true
			if p := in.end.usage.prompt(); p > 0 {
				res.wasted, tokens = p, in.billed()
				u := in.end.usage
				res.prompt, res.estimatedInput = usage{input: u.input, cacheRead: u.cacheRead, cacheWrite: u.cacheWrite, cacheWrite1h: u.cacheWrite1h}, false
			}
		}
		in.end.retry() // only the answer that reaches the client counts: every attempt starts from none
	}
	v := res.verdict
	if v.outcome.ByClass() { // an upstream's limit: the class of the model it answered for cools
		v.class = ch.classOf(in.grant.target)
	}
	in.end.attempted(attemptRecord{channel: ch.name, outcome: v.outcome, duration: time.Since(start)})
	if v.outcome == outcomeSuccess && res.firstByte > 0 {
		m := ch.metrics.attempted(ch.name)
		m.success.Inc()
		in.tr.observe(m.firstByte, res.firstByte.Seconds())
	} else {
		metricAttempts.WithLabelValues(ch.name, v.outcome.String()).Inc()
		if res.firstByte > 0 {
			in.tr.observe(metricFirstByte.WithLabelValues(ch.name), res.firstByte.Seconds())
		}
	}
	if cooled := t.finish(v, ch.cooldown, r.now(), res.firstByte, tokens); cooled > 0 {
		r.logCooling(in, ch, &v, cooled)
	}
	return res
}

// logCooling logs that an attempt's verdict cools its channel down. Apart
// from attempt, so that the log fields take no room in attempt's frame,
// which a stream keeps on its goroutine's stack while it lasts.
func (r *Relay) logCooling(in *inbound, ch *channel, v *verdict, cooled time.Duration) {
	if v.class != "" && v.outcome.ByClass() {
		r.logger.Warn("channel cooling down for a model class",
			zap.String("channel", ch.name),
			zap.String("class", v.class),
			zap.String("outcome", v.outcome.String()),
			zap.String("reason", v.reason),
			zap.Duration("cooldown", cooled),
			zap.String("request_id", in.id))
		return
	}
	r.logger.Warn("channel cooling down",
		zap.String("channel", ch.name),
		zap.String("outcome", v.outcome.String()),
		zap.String("reason", v.reason),
		zap.Duration("cooldown", cooled),
		zap.String("request_id", in.id))
}

// lacking turns a 400 (or a 403) that says, in the words of ch's
// provider, that its wire does not support a feature the request carries
// into the channel's limitation (fail over, and set the feature aside on
// the channel) when another channel the request could still use supports
// it. Otherwise the refusal stays the client's answer, and does not cool
// the channel: its account is not at fault. When the refusal does not say
// which of several features it means (Bedrock's beta flags), the request
// fails over but nothing is set aside: a client must not be able to take a
// feature from a shared channel by pairing it with one the channel lacks.
func (r *Relay) lacking(v *verdict, in *inbound, ch *channel, body []byte) {
	if lacked, certain := features.Lacked(ch.features.Refusals(), body, in.ask.needs); len(lacked) > 0 {
		r.setAside(v, in, ch, lacked, certain)
	}
}

// unentitled turns an upstream's refusal that says the channel's account
// lacks long context (in Anthropic's words, on a 429, a 403 or a 400) into
// the channel's lack of it, as lacking does for a feature its wire lacks:
// the request fails over to a channel that has it, and the channel keeps
// serving every request that does not need it. It is not a cooldown: the
// account is not busy, it is not entitled. The refusal is the upstream's
// own sentence, which no client can write.
func (r *Relay) unentitled(v *verdict, in *inbound, ch *channel) {
	lacked := features.LongContext.Names()
	for _, b := range in.ask.needs.Betas {
		if strings.HasPrefix(b, features.LongContextBetaPrefix) && len(b) <= features.MaxBetaName {
			lacked = append(lacked, strings.Clone(b))
		}
	}
	r.setAside(v, in, ch, lacked, true)
	if v.outcome == outcomeClientError {
		v.reason = "the channel's account lacks long context"
	}
}

// setAside makes v the channel's lack of the features lacked (certain:
// the refusal named them) when another channel the request could still
// use supports them, so that the request fails over; otherwise the
// refusal is the client's answer, and no cooldown.
func (r *Relay) setAside(v *verdict, in *inbound, ch *channel, lacked []string, certain bool) {
	if in.who.key == nil || !in.group().anotherTakes(&in.grant.sel, ch, lacked) {
		v.outcome = outcomeClientError
		return
	}
	v.outcome, v.reason = outcomeLacksFeature, "lacks "+strings.Join(lacked, ", ")
	if !certain {
		v.reason = "lacks one of " + strings.Join(lacked, ", ")
		metricCapabilityMisses.WithLabelValues(ch.name, "other").Inc()
		return
	}
	v.features = lacked
	in.tr.learnedLack(ch, lacked)
	for _, f := range lacked {
		metricCapabilityMisses.WithLabelValues(ch.name, features.Label(f)).Inc()
	}
}

// maxErrorBody bounds how much of an upstream error body is read: as much
// as a provider reads.
const maxErrorBody = provider.MaxErrorBody

// exchange sends the request to ch once and, when the answer proves itself,
// commits it to the client. A stream is relayed from inside it, for as
// long as the stream lasts, so it keeps its frame small: every answer but
// a stream's is handled by a function of its own, whose locals are gone
// by the time a stream runs (a handler's goroutine whose stack outgrows
// 16 KiB keeps 32 KiB for as long as its stream is open).
func (r *Relay) exchange(w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int) (res attemptResult) {
	// The attempt's context has the client's values but not its end: the
	// client's leaving reaches it through dl (watch), which ends it at once
	// or, once reading on pays, after settle_grace (settle.go).
	dl := &deadline{detached: detached{req.Context()}, in: in, relay: r}
	ctx, cancel := context.WithCancelCause(&dl.detached)
	defer cancel(nil)
	dl.cancel = cancel
	// an upstream that never had a connection never had the request
	dl.trace.GotConn = dl.gotConn
	ctx = httptrace.WithClientTrace(ctx, &dl.trace)

	call := in.callFor(ch)
	in.try.trace = &dl.trace
	upReq, err := ch.provider.NewRequest(ctx, call)
	in.try.trace = nil
	if err != nil {
		return r.notSent(ctx, req, in, ch, err)
	}
	if ch.forwardTraceparent {
		in.tr.injectTraceparent(ctx, upReq.Header)
	}
	if in.ask.stream {
		dl.start(stageFirstByte, ch.firstByte)
	} else {
		dl.start(stageResponse, ch.response)
		if req.Context().Err() == nil { // none is asked for a client gone already
			dl.readOn() // its whole answer may come after its client left
		}
	}
	defer dl.end(&res)
	dl.watch(req.Context())

	sent := time.Now()
	resp, err := ch.rt.RoundTrip(upReq)
	if err != nil {
		return sendFailed(ctx, req, ch, err, dl.connected.Load())
	}
	firstByteTime := time.Since(sent) // before a provider reads an error body
	defer resp.Body.Close()
	if resp, err = ch.provider.Response(resp, call); err != nil {
		return failed(ctx, req, ch, err)
	}
	defer resp.Body.Close() // the provider may have replaced it
	ch.observeQuota(resp.Header, r.now(), in.grant.target)

	switch {
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		return r.errorStatus(ctx, req, in, ch, call, resp, firstByteTime)
	case !isEventStream(resp.Header):
		return r.message(ctx, w, req, in, ch, n, resp, dl, firstByteTime)
	}
	// until the first event, both its limit (from sending) and the hold's
	// (first_content_timeout from these headers) run; the tighter one applies
	dl.headers = time.Now()
	s := &streamAttempt{r: r, w: w, in: in, ch: ch, n: n, ctx: ctx, clientCtx: req.Context(), deadline: dl, resp: resp, last: dl.headers}
	dl.stream = s
	if left := ch.firstByte - firstByteTime; left < ch.firstContent {
		dl.arm(stageFirstByte, left)
	} else {
		dl.arm(stageFirstContent, ch.firstContent)
	}
	res = s.run()
	res.firstByte = firstByteTime
	return res
}

// failed is an attempt that failed with err.
func failed(ctx context.Context, req *http.Request, ch *channel, err error) attemptResult {
	return attemptResult{verdict: classifyError(ctx, req.Context(), err), channel: ch}
}

// sendFailed is an attempt whose request got no answer, for err. With
// connected (the upstream had a connection), one that timed out or whose
// client left was accepted: the upstream was working on it.
func sendFailed(ctx context.Context, req *http.Request, ch *channel, err error, connected bool) attemptResult {
	res := failed(ctx, req, ch, err)
	res.accepted = connected && (res.verdict.timeout || res.verdict.outcome == outcomeCanceled)
	return res
}

// notSent is an attempt whose provider could not make its request: it
// failed, or it answers for its upstream (an UpstreamError).
func (r *Relay) notSent(ctx context.Context, req *http.Request, in *inbound, ch *channel, err error) attemptResult {
	var ue provider.UpstreamError
	if !errors.As(err, &ue) {
		return failed(ctx, req, ch, err)
	}
	body := provider.ErrorBody(provider.ErrorType(ue.Status), ue.Message, cmp.Or(ue.RequestID, in.id))
	h := http.Header{"Content-Type": {"application/json"}}
	return attemptResult{verdict: classifyStatus(ue.Status, h, body, r.now()), channel: ch, status: ue.Status, header: h, body: body}
}

// errorStatus is an attempt the upstream answered with an error status:
// its answer is classified, and kept for the client in case no other
// attempt follows.
func (r *Relay) errorStatus(ctx context.Context, req *http.Request, in *inbound, ch *channel, call *provider.Call, resp *http.Response, firstByte time.Duration) attemptResult {
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	if err != nil {
		return failed(ctx, req, ch, err)
	}
	v := classifyStatus(resp.StatusCode, resp.Header, body, r.now())
	if refusesModel(resp.StatusCode, body, provider.RefusesModel(resp), call.Model) {
		v.outcome, v.reason, v.model = outcomeModelRefused, "model refused", in.grant.target
	}
	switch {
	case v.outcome == outcomeModelRefused:
	case features.LongContextRefused(resp.StatusCode, body):
		r.unentitled(&v, in, ch)
	case (resp.StatusCode == http.StatusBadRequest || resp.StatusCode == http.StatusForbidden) && !in.ask.needs.Empty():
		r.lacking(&v, in, ch, body)
	}
	return attemptResult{verdict: v, channel: ch, firstByte: firstByte, status: resp.StatusCode, header: resp.Header, body: body}
}

// message commits a 2xx answer that is not a stream, once it is whole.
func (r *Relay) message(ctx context.Context, w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int, resp *http.Response, dl *deadline, firstByte time.Duration) attemptResult {
	// the upstream has done the work, whatever happens to its body now
	buf := bodyPool.Get().(*bytes.Buffer)
	defer releaseBody(buf)
	_, err := buf.ReadFrom(io.LimitReader(resp.Body, r.MaxResponseSize+1))
	if err == nil && int64(buf.Len()) > r.MaxResponseSize {
		err = errResponseTooLarge
	}
	if err != nil {
		res := failed(ctx, req, ch, err)
		res.accepted = true
		return res
	}
	dl.stop()
	in.end.countedMessage(buf.Bytes())
	in.tr.fromMessage(buf.Bytes())
	if dl.gone() {
		// its client left while it came: nothing is written, but the answer
		// was made for the client, whose bill it is (settle.go)
		in.end.cutOn(ch)
		return attemptResult{verdict: verdict{outcome: outcomeCanceled, reason: "client canceled"}, channel: ch, done: true, firstByte: firstByte}
	}
	in.committed(ch)
	r.commitHeaders(w, in, ch, n, resp)
	w.Header().Set("Content-Length", strconv.Itoa(buf.Len()))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(buf.Bytes())
	if in.ask.thinking.on {
		learnMessage(buf.Bytes(), ch) // its signatures are ch's domain's (thinking.go)
	}
	return attemptResult{verdict: verdict{outcome: outcomeSuccess, reason: "status " + strconv.Itoa(resp.StatusCode)}, done: true, firstByte: firstByte}
}

// stage is a part of an attempt with its own time limit.
type stage uint32

const (
	stageResponse     stage = iota // non-streaming: until the whole body
	stageFirstByte                 // streaming: until the first event
	stageFirstContent              // streaming: the hold's limit, first_content_timeout from the headers (stream.go)
	stageStall                     // streaming, held past that limit: until first_content_timeout of silence
	stageIdle                      // streaming, after the commit point: between two events
)

var stageCauses = [...]error{errResponseTimeout, errFirstByteTimeout, errFirstContentTimeout, errFirstContentTimeout, errStreamIdle}

// deadline cancels an attempt when its current stage runs out of time:
// one timer per attempt, re-armed at each stage with the cause it will
// cancel with. It also holds what else an attempt keeps for itself, in one
// allocation: the parent of its context, its trace, and what its client's
// leaving does to it (settle.go).
type deadline struct {
	timer   *time.Timer
	stage   atomic.Uint32
	cancel  context.CancelCauseFunc
	headers time.Time // when a stream's response headers arrived
	// stream is the attempt's stream once its headers came: the end of its
	// hold is its to decide
	stream *streamAttempt

	detached  detached // the parent of the attempt's context
	trace     httptrace.ClientTrace
	connected atomic.Bool // the upstream had a connection: it had the request
	in        *inbound
	relay     *Relay                     // its settle_grace, and the grace's timer
	phase     atomic.Uint32              // what the client's leaving does (settle.go)
	unwatch   func() bool                // stops watching the client; nil: not watching
	settling  atomic.Pointer[time.Timer] // the grace after the client left
}

// gotConn is the attempt's GotConn trace.
func (d *deadline) gotConn(httptrace.GotConnInfo) { d.connected.Store(true) }

func (d *deadline) start(s stage, limit time.Duration) {
	d.stage.Store(uint32(s))
	d.timer = time.AfterFunc(limit, d.fire)
}

// fire ends the current stage: it cancels the attempt with the stage's
// cause, but for the end of a stream's hold, which the stream decides.
func (d *deadline) fire() {
	st := stage(d.stage.Load())
	if st == stageFirstContent && d.stream != nil {
		d.stream.holdLimit()
		return
	}
	d.cancel(stageCauses[st])
}

// arm starts stage s with limit left.
func (d *deadline) arm(s stage, limit time.Duration) {
	d.stage.Store(uint32(s))
	d.timer.Reset(max(limit, 0))
}

func (d *deadline) stop() { d.timer.Stop() }

// commitHeaders sets the response headers of a committed answer: the
// upstream's (without hop-by-hop ones, nor its rate limits unless they
// pass) and the relay's own.
func (r *Relay) commitHeaders(w http.ResponseWriter, in *inbound, ch *channel, n int, resp *http.Response) {
	h := w.Header()
	copyResponseHeaders(h, resp.Header, r.passRatelimit)
	h.Del("Content-Length")
	relayHeaders(h, in, ch, n, false)
	r.ratelimitHeaders(h, in)
}

// relayHeaders sets the relay's own response headers: the channel that
// answered (with expose_channel), the attempts when there were several (or
// when they ran out), and the model that served, when a fallback did.
func relayHeaders(h http.Header, in *inbound, ch *channel, attempts int, ranOut bool) {
	if in.who.key.group.expose && ch != nil {
		h.Set("X-Relay-Channel", ch.name)
	}
	if attempts > 1 || ranOut {
		h.Set("X-Relay-Attempts", strconv.Itoa(attempts))
	}
	if in.grant.target != in.ask.model {
		h.Set("X-Relay-Model", in.grant.target)
	}
}

func isEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	return strings.HasPrefix(strings.ToLower(strings.TrimSpace(ct)), "text/event-stream")
}
