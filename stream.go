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
	held, res, ok := s.hold(rd, (*hb)[:0])
	if !ok {
		if res.body == nil { // a failed attempt's held events may be the answer yet
			heldBufs.Put(hb)
		}
		return res
	}
	committed := s.commit(held)
	s.deadline.readOn() // the client has content: its leaving is billed (settle.go)
	if cap(held) <= 4*maxHeld {
		*hb = held[:0]
		heldBufs.Put(hb)
	}
	// no attempt follows a commit: let go of the request body now rather
	// than when the stream ends (it is back in its pool if the transport has
	// sent it all)
	s.in.releaseBody()
	if !committed {
		s.in.end.incomplete = true
		return attemptResult{verdict: verdict{outcome: outcomeCanceled, reason: "client gone"}, channel: s.ch, done: true}
	}
	return s.pump(rd)
}

// hold reads the events before the commit point (message_start, ping,
// comments), bounded by maxHeld and the first content timeout, and returns
// them with the event that proves the stream, ready to commit. When the
// stream fails before that, ok is false and res says how.
func (s *streamAttempt) hold(rd *sse.Reader, held []byte) (_ []byte, res attemptResult, ok bool) {
	for first := true; ; first = false {
		ev, err := rd.Next()
		if first {
			// the first event came in time; content must come within
			// first_content_timeout of the response headers
			s.deadline.arm(stageFirstContent, s.ch.firstContent-time.Since(s.deadline.headers))
		}
		if err != nil {
			v := classifyError(s.ctx, s.clientCtx, err)
			if err == io.EOF || err == io.ErrUnexpectedEOF {
				v.reason = "stream ended before any content"
			}
			// the upstream had begun its answer: it broke, it timed out, or
			// the client left
			return nil, attemptResult{verdict: v, channel: s.ch, accepted: true}, false
		}
		if !s.wellFormed(ev) {
			continue
		}
		s.in.end.usage.fromEvent(ev.Name, ev.Data)
		s.in.tr.fromEvent(ev.Name, ev.Data)
		if s.in.ask.thinking.on {
			learnEvent(ev.Name, ev.Data, s.ch) // thinking.go
		}
		held = append(held, ev.Raw...)
		switch string(ev.Name) {
		case "message_start", "ping", "":
			// a nameless event (an SSE comment, a proxy's keep-alive) proves
			// nothing either
			if len(held) > maxHeld {
				return held, res, true
			}
		case "error":
			v := classifyStreamError(ev.Data)
			if !v.outcome.retryable() {
				// the request's own fault: the client sees the stream as sent
				s.commit(held)
				s.in.end.incomplete = true
				return nil, attemptResult{verdict: v, channel: s.ch, done: true}, false
			}
			return nil, attemptResult{verdict: v, channel: s.ch, status: s.resp.StatusCode, header: s.resp.Header, body: held}, false
		default:
			return held, res, true
		}
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
// (then it settles: reads on without the client for the usage).
func (s *streamAttempt) pump(rd *sse.Reader) attemptResult {
	s.deadline.arm(stageIdle, s.ch.streamIdle)
	rc := http.NewResponseController(s.w)
	done := func(v verdict) attemptResult {
		// anything but message_stop leaves the client with a partial answer,
		// whose output the upstream did not report: it is billed the estimate
		// of the content the client was sent, as a client that leaves is
		s.in.end.incomplete = v.reason != "message_stop"
		if u := &s.in.end.usage; s.in.end.incomplete && !u.final {
			u.output = max(u.output, u.estimatedOutput())
			s.in.end.estimated = true
		}
		return attemptResult{verdict: v, channel: s.ch, done: true}
	}
	for {
		ev, err := rd.Next()
		if s.deadline.gone() {
			return s.settle(rd, ev, err)
		}
		if err != nil {
			v := classifyError(s.ctx, s.clientCtx, err)
			if v.outcome == outcomeCanceled {
				return s.settle(rd, ev, err)
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
		s.in.end.usage.fromEvent(ev.Name, ev.Data)
		s.in.tr.fromEvent(ev.Name, ev.Data)
		if s.in.ask.thinking.on {
			learnEvent(ev.Name, ev.Data, s.ch) // thinking.go
		}
		if _, err := s.w.Write(ev.Raw); err != nil {
			return s.settle(rd, sse.Event{}, nil)
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
