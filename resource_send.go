package relay

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

// A call of the Batches or Files API goes to a channel here: a call on an
// item or a list's page to the channel that holds them (send), a create
// through the attempt loop, as a message goes (create), an upload held to
// max_upload_size on its way.

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
		return &resourceAttempt{c: c, ch: ch, failure: refused(errQueue("the channel that holds this "+c.rq.kind.Noun()+" is at its limit", time.Second))}
	}
	c.in.end.another()
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
	a.in().end.attempted(attemptRecord{channel: a.ch.name, outcome: v.outcome, duration: time.Since(a.start)})
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
				c.in.end.cut()
			}
			return false
		}
	}
}

// create makes a batch or uploads a file through the attempt loop of a
// message (failover): picked by the group's policy among its channels that
// serve the resource (for a batch, serving the model of every one of its
// requests and holding every file they reference), queued while they are
// all busy, failing over as a message does, except that an upload,
// streamed, fails over only before any of it was sent.
func (c *resourceCtx) create() *failure {
	var body []byte
	var models []string
	var pinned *channel
	if c.rq.kind == resourceid.Batch {
		buf, rerr := c.r.readBody(c.w, c.req)
		if rerr != nil {
			return refused(rerr)
		}
		defer releaseBody(buf)
		body = buf.Bytes()
		if models, rerr = batchModels(body); rerr != nil {
			return refused(rerr)
		}
		if mayReferenceFiles(body) {
			b, ch, _, rerr := c.r.pinFiles(c.req.Context(), c.secret, c.group, body, 0)
			if rerr != nil {
				return refused(rerr)
			}
			body, pinned = b, ch
		}
	}
	var cands []*channel
	for _, ch := range c.group.channels {
		if _, ok := servesResource(ch, c.rq.kind); !ok || pinned != nil && ch != pinned {
			continue
		}
		if !ch.servesAll(models) {
			continue
		}
		cands = append(cands, ch)
	}
	if len(cands) == 0 {
		msg := "no channel of group " + strconv.Quote(c.group.name) + " serves " + c.rq.kind.String()
		switch {
		case pinned != nil:
			msg = "the channel that holds the files this batch references, " + strconv.Quote(pinned.name) + ", does not serve every model of the batch (" + strings.Join(models, ", ") + ")"
		case len(models) > 0:
			msg += " and every model of the batch (" + strings.Join(models, ", ") + ")"
		}
		return refused(&relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "model_not_found", msg: msg, noRetry: true})
	}
	if c.rq.kind == resourceid.Batch { // a batch holds its worst case before anything is sent
		held, rerr := c.r.holdBatch(c.in, body, &cands)
		if rerr != nil {
			return refused(rerr)
		}
		defer held.Abandon() // unless the batch was made
		c.held = held
	}

	ca := &createAttempt{c: c, models: models, body: body, path: pathFiles}
	ca.cands = cands
	if c.rq.kind == resourceid.Batch {
		ca.path = pathBatches
	}
	if c.rq.kind == resourceid.File {
		if c.req.ContentLength > c.r.MaxUploadSize {
			return refused(errTooLarge("max_upload_size", c.r.MaxUploadSize))
		}
		ca.upload = &uploadBody{r: c.req.Body, limit: c.r.MaxUploadSize}
	}
	c.in.ask.estimate = -1 // a create is not held to a channel's token limit
	return c.r.failover(c.w, c.req, c.in, ca)
}

// createAttempt is a create's part of the attempt loop.
type createAttempt struct {
	c      *resourceCtx
	cands  []*channel // the group's channels that may make it
	models []string   // a batch's
	body   []byte     // a batch's
	upload *uploadBody
	path   string
}

func (a *createAttempt) accept() func(*channel, time.Time) bool { return a.accepts }

// accepts reports whether ch may make the resource now: it is a
// candidate, and refuses none of the batch's models.
func (a *createAttempt) accepts(ch *channel, now time.Time) bool {
	if !contains(a.cands, ch) {
		return false
	}
	for _, m := range a.models {
		if refused, _ := ch.health.Refuses(m, now); refused {
			return false
		}
	}
	return true
}

// noChannel answers a create that found no channel: all busy, as a
// message is; otherwise none is live.
func (a *createAttempt) noChannel(p pickResult, s *selection, g *group) *relayError {
	if p.reason == allBusy {
		return p.err(s, g)
	}
	return errNoHealthyChannel(a.c.rq.kind.String(), untilFrom(p.until, s.now))
}

// attempt sends the create to ch and, on its 2xx answer, records who owns
// the resource and passes it on.
func (a *createAttempt) attempt(r *Relay, w http.ResponseWriter, req *http.Request, in *inbound, ch *channel, n int, t *ticket) attemptResult {
	defer t.release(r.now) // on a panic: sendAdmitted ends it on every other path
	c := a.c
	rp, _ := servesResource(ch, c.rq.kind)
	call := &provider.ResourceCall{Channel: ch.name, Method: http.MethodPost, Path: a.path, RawQuery: req.URL.RawQuery, Header: req.Header, ContentLength: int64(len(a.body))}
	timeout := ch.firstByte
	if a.upload != nil {
		call.Body, call.ContentLength, timeout = a.upload, req.ContentLength, ch.response
		if call.ContentLength <= 0 {
			call.ContentLength = -1
		}
	} else {
		call.Body = bytes.NewReader(a.body)
	}
	ra := c.sendAdmitted(ch, t, rp, call, timeout)
	done := attemptResult{done: true} // the client has its answer
	if ra.resp != nil {
		defer ra.close()
		obj, ok := c.readObject(ra, ch)
		if !ok {
			return done
		}
		if rerr := c.recordOwner(ch, rp, obj); rerr != nil {
			r.answer(w, in, refused(rerr))
			return done
		}
		c.held.Keep(ch.name, gjson.GetBytes(obj, "id").Str)
		c.sendObject(ra, c.rewriteItem(obj, ch.name))
		return done
	}
	if a.upload != nil && a.upload.over.Load() {
		r.answer(w, in, refused(errTooLarge("max_upload_size", r.MaxUploadSize)))
		return done
	}
	res := ra.res
	res.final = a.upload != nil && a.upload.n.Load() > 0
	return res
}

// batchModels reads the distinct models of a batch's requests (each
// request's params.model) in one pass over them that keeps nothing but
// those models: a batch of any number of requests costs a small multiple
// of its size to read.
func batchModels(body []byte) ([]string, *relayError) {
	if !gjson.ValidBytes(body) {
		return nil, errInvalid("request body is not valid JSON")
	}
	var models []string
	seen := map[string]bool{} // a batch may name as many models as requests
	ok := true
	// read in place: what is kept is cloned
	if reqs := gjson.Get(jsonscan.String(body), "requests"); reqs.IsArray() {
		reqs.ForEach(func(_, r gjson.Result) bool {
			m := r.Get("params.model")
			switch {
			case !m.Exists(): // a request without one is the upstream's to refuse
			case m.Type != gjson.String || modelIDProblem(m.Str) != "":
				ok = false
			case !seen[m.Str]:
				m := strings.Clone(m.Str)
				seen[m] = true
				models = append(models, m)
			}
			return ok
		})
	}
	if !ok {
		return nil, errInvalid("requests: every request needs params.model, a model id")
	}
	if len(models) == 0 {
		return nil, errInvalid("requests: field required, with params.model in each")
	}
	return models, nil
}

// servesAll reports whether the channel serves every model in models.
func (ch *channel) servesAll(models []string) bool {
	for _, m := range models {
		if !ch.serves(m) {
			return false
		}
	}
	return true
}

// uploadBody is a client's upload on its way upstream: bounded by
// max_upload_size, counted (an upload fails over only while nothing of it
// was read), and never closed by a transport, so that an attempt that did
// not read it leaves it for the next.
type uploadBody struct {
	r     io.Reader
	limit int64
	n     atomic.Int64
	over  atomic.Bool
}

// errUploadTooLarge ends an upload that passes max_upload_size.
var errUploadTooLarge = errors.New("upload larger than max_upload_size")

// Read reads the upload on, and fails it once it passes its limit.
func (u *uploadBody) Read(p []byte) (int, error) {
	n, err := u.r.Read(p)
	if u.n.Add(int64(n)) > u.limit {
		u.over.Store(true)
		return 0, errUploadTooLarge
	}
	return n, err
}
