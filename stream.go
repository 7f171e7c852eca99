package relay

import (
	"context"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/sse"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

const (
	// maxHeld bounds the events held back before the commit point; an
	// upstream that sends more than this without content is committed.
	maxHeld = 64 << 10
	// maxEvent bounds one SSE event from an upstream.
	maxEvent = 16 << 20
)

// readers and heldBufs pool the per-stream buffers: an SSE reader (its
// event buffers; its read buffer comes from a pool of its own while it has
// bytes to give, so an idle stream holds none) and the events held back
// before the commit point.
var (
	readers  = sync.Pool{New: func() any { return sse.NewReader(nil, maxEvent) }}
	heldBufs = sync.Pool{New: func() any { b := make([]byte, 0, 4<<10); return &b }}
)

// maxPooledReader keeps readers that grew for a huge event out of the pool.
const maxPooledReader = 256 << 10

// streamAttempt is one attempt whose upstream answered 2xx with an event
// stream. Until the first content event nothing reaches the client, so a
// stream that fails before it (an `event: error`, a cut, a timeout) fails
// over invisibly. After it, every event is forwarded byte for byte and
// flushed at once, and a failure ends the stream with an `event: error`.
//
// The hold lasts at most first_content_timeout from the response headers:
// an upstream that is slow to its first content but keeps sending (a long
// prefill sends message_start and then pings) is committed at that limit,
// its held events sent, and then relayed as it goes; it is never cut for
// being slow. One that falls silent for first_content_timeout is a stall,
// and fails over (holdLimit).
type streamAttempt struct {
	r         *Relay
	w         http.ResponseWriter
	in        *inbound
	ch        *channel
	n         int
	ctx       context.Context // the attempt's; canceled with a cause by its deadline
	clientCtx context.Context
	deadline  *deadline
	resp      *http.Response

	// The hold, which the timer at its limit (holdLimit) shares with the
	// loop that reads the events (hold), under mu.
	mu      sync.Mutex
	held    []byte    // the events held back
	last    time.Time // when the upstream's last event came; its headers before any
	over    bool      // the hold is over: the loop ended it, or its limit committed it
	waiting bool      // its limit passed without a recent event: the next event commits, silence is a stall
	early   bool      // its limit committed it, before any content
	took    bool      // with early: the client took what was committed
	content bool      // with early: content has reached the client since
}

// pendingRead is an event (or the error) the hold read after its limit
// had committed the stream: the pass-through takes it first.
type pendingRead struct {
	ev   sse.Event
	err  error
	have bool
}

func (s *streamAttempt) run() attemptResult {
	rd := readers.Get().(*sse.Reader)
	rd.Reset(s.resp.Body)
	defer func() {
		rd.Reset(nil)
		if rd.Size() <= maxPooledReader {
			readers.Put(rd)
		}
	}()
	hb := heldBufs.Get().(*[]byte)
	s.held = (*hb)[:0]
	res, ok, next := s.hold(rd)
	held := s.held // the hold is over: nothing else touches it now
	s.held = nil
	if !ok {
		if res.body == nil { // a failed attempt's held events may be the answer yet
			heldBufs.Put(hb)
		}
		return res
	}
	committed := s.took
	if !s.early {
		committed = s.commit(held)
		s.deadline.readOn() // the client has content: its leaving is billed (settle.go)
	}
	if cap(held) <= 4*maxHeld {
		*hb = held[:0]
		heldBufs.Put(hb)
	}
	// no attempt follows a commit: let go of the request body now rather
	// than when the stream ends (it is back in its pool if the transport has
	// sent it all)
	s.in.releaseBody()
	if !committed {
		s.in.end.cut()
		return attemptResult{verdict: verdict{outcome: outcomeCanceled, reason: "client gone"}, channel: s.ch, done: true}
	}
	return s.pump(rd, next)
}

// hold reads the events before the commit point (message_start, ping,
// comments) into s.held, bounded by maxHeld, and reports ok when the
// stream proved itself (an event of content, or any event once its limit
// passed) or its limit committed it (next is then what it read since).
// When the stream fails before that, ok is false and res says how.
func (s *streamAttempt) hold(rd *sse.Reader) (res attemptResult, ok bool, next pendingRead) {
	for first := true; ; first = false {
		ev, err := rd.Next()
		if res, ok, next, over := s.take(ev, err, first); over {
			return res, ok, next
		}
	}
}

// take is hold's step: what the read brought (an event, or err), taken
// under s.mu, which the hold's limit shares. over says that the hold is
// over, and res, ok and next are then hold's answer.
func (s *streamAttempt) take(ev sse.Event, err error, first bool) (res attemptResult, ok bool, next pendingRead, over bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.early { // the hold's limit committed the stream while it read
		return res, true, pendingRead{ev: ev, err: err, have: true}, true
	}
	defer func() { s.over = over }() // before the unlock
	if first && !s.waiting {
		// the first event came in time; the hold ends first_content_timeout
		// after the response headers
		s.deadline.arm(stageFirstContent, s.ch.firstContent-time.Since(s.deadline.headers))
	}
	if err != nil {
		v := classifyError(s.ctx, s.clientCtx, err)
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			v.reason = "stream ended before any content"
		}
		// the upstream had begun its answer: it broke, it timed out, or
		// the client left
		return attemptResult{verdict: v, channel: s.ch, accepted: true}, false, next, true
	}
	s.last = time.Now()
	if !s.wellFormed(ev) {
		return res, false, next, false
	}
	s.in.end.counted(ev.Name, ev.Data)
	s.in.tr.fromEvent(ev.Name, ev.Data)
	if s.in.ask.thinking.on {
		learnEvent(ev.Name, ev.Data, s.ch) // thinking.go
	}
	s.held = append(s.held, ev.Raw...)
	switch string(ev.Name) {
	case "message_start", "ping", "":
		// a nameless event (an SSE comment, a proxy's keep-alive) proves
		// nothing either; past the hold's limit, any event commits
		return res, true, next, len(s.held) > maxHeld || s.waiting
	case "error":
		v := classifyStreamError(ev.Data)
		if !v.outcome.Retryable() {
			// the request's own fault: the client sees the stream as sent
			s.commit(s.held)
			s.in.end.cut()
			return attemptResult{verdict: v, channel: s.ch, done: true}, false, next, true
		}
		return attemptResult{verdict: v, channel: s.ch, status: s.resp.StatusCode, header: s.resp.Header, body: s.held}, false, next, true
	}
	return res, true, next, true
}

// holdLimit is the end of the hold, first_content_timeout after the
// response headers, on the deadline's timer. An upstream that sent an
// event in the last half of that time is alive: the stream is committed
// now, its held events flushed, and relayed as it comes from then on.
// Otherwise the hold goes on until the upstream's next event, which
// commits it at once, or until first_content_timeout of silence since its
// last event, a stall that fails over.
func (s *streamAttempt) holdLimit() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.over {
		return
	}
	silent := time.Since(s.last)
	if silent >= s.ch.firstContent/2 {
		s.waiting = true
		s.deadline.arm(stageStall, s.ch.firstContent-silent)
		return
	}
	s.over, s.early = true, true
	if s.took = s.commit(s.held); s.took {
		// stream_idle_timeout counts from the commit: it may be shorter than
		// the silence the limit accepts
		s.deadline.arm(stageIdle, s.ch.streamIdle)
	}
}

// commit sends the response headers and the held events; it reports whether
// the client took them.
func (s *streamAttempt) commit(held []byte) bool {
	s.in.committed(s.ch)
	s.r.commitHeaders(s.w, s.in, s.ch, s.n, s.resp)
	s.w.WriteHeader(s.resp.StatusCode)
	if _, err := s.w.Write(held); err != nil {
		return false
	}
	return http.NewResponseController(s.w).Flush() == nil
}

// pump forwards the rest of the stream, one flushed event at a time, until
// message_stop, an upstream `event: error`, a failure or the client leaving
// (then it settles: reads on without the client for the usage). It starts
// with next when the hold read it.
func (s *streamAttempt) pump(rd *sse.Reader, next pendingRead) attemptResult {
	s.deadline.arm(stageIdle, s.ch.streamIdle)
	rc := http.NewResponseController(s.w)
	done := func(v verdict) attemptResult {
		// an answer that did not end whole leaves the client with a partial
		// answer, whose output the upstream did not report: it is billed the
		// estimate of the content the client was sent, as a client that
		// leaves is
		s.in.end.finished(v.outcome == outcomeSuccess)
		return attemptResult{verdict: v, channel: s.ch, done: true}
	}
	for {
		ev, err := next.ev, next.err
		if !next.have {
			ev, err = rd.Next()
		}
		next.have = false
		if s.deadline.gone() {
			return s.settle(rd, ev, err)
		}
		if err != nil {
			v := classifyError(s.ctx, s.clientCtx, err)
			if v.outcome == outcomeCanceled {
				return s.settle(rd, ev, err)
			}
			if s.in.end.usage.stopped {
				// a message_delta gave the stop_reason: the answer is whole,
				// whatever became of the message_stop after it
				return done(verdict{outcome: outcomeSuccess, reason: "message_delta"})
			}
			if err == io.EOF || err == io.ErrUnexpectedEOF {
				v.reason = "upstream stream ended before message_stop"
			}
			s.endWithError(v)
			return done(v)
		}
		s.deadline.arm(stageIdle, s.ch.streamIdle)
		if !s.wellFormed(ev) {
			continue
		}
		s.in.end.counted(ev.Name, ev.Data)
		s.in.tr.fromEvent(ev.Name, ev.Data)
		if s.in.ask.thinking.on {
			learnEvent(ev.Name, ev.Data, s.ch) // thinking.go
		}
		if _, err := s.w.Write(ev.Raw); err != nil {
			return s.settle(rd, sse.Event{}, nil)
		}
		if s.early && !s.content {
			s.contentSent(ev.Name)
		}
		last := string(ev.Name) == "message_stop" || string(ev.Name) == "error"
		// Flush unless the upstream already sent more: every event reaches
		// the client as soon as the upstream pauses, and a burst of events
		// costs one flush, not one each.
		if last || !rd.Buffered() {
			if err := rc.Flush(); err != nil {
				if last {
					return done(verdict{outcome: outcomeCanceled, reason: "client gone"})
				}
				return s.settle(rd, sse.Event{}, nil)
			}
		}
		switch string(ev.Name) {
		case "message_stop":
			s.drain(rd)
			return done(verdict{outcome: outcomeSuccess, reason: "message_stop"})
		case "error":
			return done(classifyStreamError(ev.Data))
		}
	}
}

// contentSent notes, for a stream its hold's limit committed, that an
// event of content has been written: from now on, its client's leaving is
// billed (settle.go), as for any stream once its content reaches the client.
func (s *streamAttempt) contentSent(name []byte) {
	switch string(name) {
	case "message_start", "ping", "":
		return
	}
	s.content = true
	s.deadline.readOn()
}

// After message_stop, drain waits up to drainTimeout for the upstream to
// end its response, reading at most maxDrain bytes: a response body closed
// before its end closes its connection, so without this wait the next
// request would dial anew (with TLS, a handshake) whenever the end of the
// response was a moment behind its last event.
const (
	drainTimeout = 100 * time.Millisecond
	maxDrain     = 4 << 10
)

// drain reads the rest of an ended stream until the upstream ends its
// response, within drainTimeout and maxDrain: its connection then goes
// back to the transport's pool. The client has had the whole stream.
func (s *streamAttempt) drain(rd *sse.Reader) {
	s.deadline.arm(stageIdle, drainTimeout)
	for n := 0; n <= maxDrain; {
		ev, err := rd.Next()
		if err != nil {
			return
		}
		n += len(ev.Raw)
	}
}

// endWithError ends a committed stream with an Anthropic `event: error`, so
// the client's SDK raises an error instead of seeing a clean, truncated
// reply.
func (s *streamAttempt) endWithError(v verdict) {
	_, _ = s.w.Write(sseError("api_error", "upstream stream failed after the response started: "+v.reason, s.in.id))
	_ = http.NewResponseController(s.w).Flush()
}

// wellFormed reports whether an event may reach the client: one whose data
// is not JSON would break the client's SDK, so it is dropped and logged.
func (s *streamAttempt) wellFormed(ev sse.Event) bool {
	if len(ev.Data) == 0 || gjson.ValidBytes(ev.Data) {
		return true
	}
	metricDropped.WithLabelValues(s.ch.name).Inc()
	s.r.logger.Warn("dropped an upstream event whose data is not JSON",
		zap.String("channel", s.ch.name),
		zap.ByteString("event", ev.Name),
		zap.String("request_id", s.in.id))
	return false
}
