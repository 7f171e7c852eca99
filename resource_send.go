package relay

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/provider"
	"go.uber.org/zap"
)

// resourceAttempt is one request of the Batches or Files API sent to a
// channel: its upstream's 2xx answer, whose body the caller reads, or the
// failure to answer with.
type resourceAttempt struct {
	c       *resourceCtx
	ch      *channel
	t       *ticket
	resp    *http.Response
	failure *failure
	res     attemptResult // when resp is nil: the attempt's verdict and answer
	dl      *deadline
	cancel  context.CancelCauseFunc
	start   time.Time
}

// send sends call to ch, within the channel's limits and breaker: the
// answer must arrive within headerTimeout. An error answer comes back as the
// failure that passes it on.
func (c *resourceCtx) send(ch *channel, rp provider.ResourceProvider, call *provider.ResourceCall, headerTimeout time.Duration) *resourceAttempt {
	t, scope := ch.health.admit(c.r.now(), -1)
	switch {
	case scope == limits.ScopeFleetDown:
		return &resourceAttempt{c: c, ch: ch, failure: refused(errStorageUnavailable())}
	case t == nil:
		return &resourceAttempt{c: c, ch: ch, failure: refused(errQueue("the channel that holds this "+c.rq.kind.noun()+" is at its limit", time.Second))}
	}
	c.in.end.attempts++
	return c.sendAdmitted(ch, t, rp, call, headerTimeout)
}

// sendAdmitted is send on a channel that admitted the attempt with t,
// which the attempt ends.
func (c *resourceCtx) sendAdmitted(ch *channel, t *ticket, rp provider.ResourceProvider, call *provider.ResourceCall, headerTimeout time.Duration) *resourceAttempt {
	r := c.r
	a := &resourceAttempt{c: c, ch: ch, t: t, start: time.Now()}
	ctx, cancel := context.WithCancelCause(c.req.Context())
	a.cancel = cancel
	a.dl = &deadline{cancel: cancel}
	a.dl.start(stageFirstByte, headerTimeout)
	fail := func(err error) *resourceAttempt {
		a.res = attemptResult{verdict: classifyError(ctx, c.req.Context(), err), channel: ch}
		a.end(a.res.verdict)
		a.failure = &failure{last: a.res, attempts: 1}
		if a.res.verdict.outcome == outcomeCanceled {
			a.failure = nil
		}
		return a
	}
	upReq, err := rp.NewResourceRequest(ctx, call)
	if err != nil {
		return fail(err)
	}
	if ch.forwardTraceparent {
		c.in.tr.injectTraceparent(ctx, upReq.Header)
	}
	resp, err := ch.rt.RoundTrip(upReq)
	if err != nil {
		return fail(err)
	}
	firstByte := time.Since(a.start)
	c.in.tr.observe(metricFirstByte.WithLabelValues(ch.name), firstByte.Seconds())
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		_ = resp.Body.Close()
		if err != nil {
			return fail(err)
		}
		v := classifyStatus(resp.StatusCode, resp.Header, body, r.now())
		a.end(v)
		a.res = attemptResult{verdict: v, channel: ch, status: resp.StatusCode, header: resp.Header, body: body}
		a.failure = &failure{last: a.res, attempts: 1}
		return a
	}
	a.resp = resp
	return a
}

// end records the attempt's verdict: the channel's health and limits, the
// metrics, the request's chain of attempts.
func (a *resourceAttempt) end(v verdict) {
	if a.t == nil {
		return
	}
	r := a.c.r
	a.dl.stop()
	a.in().end.chain = append(a.in().end.chain, attemptRecord{channel: a.ch.name, outcome: v.outcome, duration: time.Since(a.start)})
	metricAttempts.WithLabelValues(a.ch.name, v.outcome.String()).Inc()
	if cooled := a.t.finish(v, a.ch.cooldown, r.now(), 0, 0); cooled > 0 {
		r.logger.Warn("channel cooling down", zap.String("channel", a.ch.name), zap.String("outcome", v.outcome.String()),
			zap.String("reason", v.reason), zap.Duration("cooldown", cooled), zap.String("request_id", a.in().id))
	}
	a.t = nil
}

// in is the request the attempt serves.
func (a *resourceAttempt) in() *inbound { return a.c.in }

// close ends a 2xx attempt whose body was read (or abandoned).
func (a *resourceAttempt) close() {
	_ = a.resp.Body.Close()
	a.end(verdict{outcome: outcomeSuccess, reason: "status " + strconv.Itoa(a.resp.StatusCode)})
	a.cancel(nil)
}

// commit writes the headers of a's 2xx answer to the client.
func (c *resourceCtx) commit(a *resourceAttempt, contentLength int) {
	h := c.w.Header()
	copyResponseHeaders(h, a.resp.Header, c.r.passRatelimit)
	h.Del("Content-Length")
	if contentLength >= 0 {
		h.Set("Content-Length", strconv.Itoa(contentLength))
	}
	relayHeaders(h, c.in, a.ch, c.in.end.attempts, false)
	c.r.ratelimitHeaders(h, c.in)
	c.in.committed(a.ch)
	metricResources.WithLabelValues(c.group.name, a.ch.name, c.rq.kind.String(), c.rq.op.String()).Inc()
	c.w.WriteHeader(a.resp.StatusCode)
}

// readObject reads a's JSON answer whole. When it cannot, it answers the
// client and returns false.
func (c *resourceCtx) readObject(a *resourceAttempt, ch *channel) ([]byte, bool) {
	a.dl.arm(stageResponse, ch.response)
	body, err := io.ReadAll(io.LimitReader(a.resp.Body, c.r.MaxResponseSize+1))
	if err == nil && int64(len(body)) > c.r.MaxResponseSize {
		err = errResponseTooLarge
	}
	if err != nil {
		v := classifyError(c.req.Context(), c.req.Context(), err)
		a.end(v)
		c.r.answer(c.w, c.in, &failure{last: attemptResult{verdict: v, channel: ch}, attempts: 1})
		return nil, false
	}
	return body, true
}

// sendObject sends body as a's answer.
func (c *resourceCtx) sendObject(a *resourceAttempt, body []byte) {
	c.commit(a, len(body))
	_, _ = c.w.Write(body)
}

// stream passes a's answer to the client as it comes, flushing each read;
// each chunk is also handed to see, when given. It stops when the client is
// gone, unless see wants the rest (then it reads on without writing).
func (c *resourceCtx) stream(a *resourceAttempt, see func([]byte)) (complete bool) {
	c.commit(a, -1)
	rc := http.NewResponseController(c.w)
	buf := make([]byte, 32<<10)
	clientGone := false
	for {
		a.dl.arm(stageIdle, a.ch.streamIdle)
		n, err := a.resp.Body.Read(buf)
		if n > 0 {
			if see != nil {
				see(buf[:n])
			}
			if !clientGone {
				if _, werr := c.w.Write(buf[:n]); werr != nil || rc.Flush() != nil {
					clientGone = true
					if see == nil {
						return false
					}
				}
			}
		}
		if err == io.EOF {
			return true
		}
		if err != nil {
			if !clientGone {
				c.in.end.incomplete = true
			}
			return false
		}
	}
}
