package relay

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
	"go.uber.org/zap"
)

// Paths of the Message Batches and Files APIs.
const (
	pathBatches = "/v1/messages/batches"
	pathFiles   = "/v1/files"
)

// isResourcePath reports whether p is under the Batches or Files API.
func isResourcePath(p string) bool {
	return strings.HasPrefix(p, pathBatches) && (len(p) == len(pathBatches) || p[len(pathBatches)] == '/') ||
		strings.HasPrefix(p, pathFiles) && (len(p) == len(pathFiles) || p[len(pathFiles)] == '/')
}

// resourceOp is what a request does to a resource.
type resourceOp uint8

const (
	opCreate  resourceOp = iota + 1 // POST /v1/messages/batches, POST /v1/files
	opList                          // GET of the collection
	opGet                           // GET /…/{id}
	opDelete                        // DELETE /…/{id}
	opCancel                        // POST /v1/messages/batches/{id}/cancel
	opResults                       // GET /v1/messages/batches/{id}/results
	opContent                       // GET /v1/files/{id}/content
)

var opNames = [...]string{opCreate: "create", opList: "list", opGet: "get", opDelete: "delete", opCancel: "cancel", opResults: "results", opContent: "content"}

func (o resourceOp) String() string { return opNames[o] }

// resourceRequest is a request of the Batches or Files API.
type resourceRequest struct {
	kind resourceKind
	op   resourceOp
	id   string // the client's id of the item, for item operations
}

// parseResource reads the operation of a request under the Batches or Files
// API.
func parseResource(method, p string) (resourceRequest, *relayError) {
	var rq resourceRequest
	rest, ok := strings.CutPrefix(p, pathBatches)
	rq.kind = kindBatch
	if !ok {
		rest, _ = strings.CutPrefix(p, pathFiles)
		rq.kind = kindFile
	}
	rest = strings.TrimPrefix(rest, "/")
	id, sub, _ := strings.Cut(rest, "/")
	var allow string
	switch {
	case rest == "":
		rq.op, allow = opList, "GET, POST"
		if method == http.MethodPost {
			rq.op = opCreate
		}
	case strings.Contains(sub, "/"):
		return rq, errNotFound(p)
	case sub == "":
		rq.op, allow = opGet, "GET, DELETE"
		if method == http.MethodDelete {
			rq.op = opDelete
		}
	case sub == "cancel" && rq.kind == kindBatch:
		rq.op, allow = opCancel, http.MethodPost
	case sub == "results" && rq.kind == kindBatch:
		rq.op, allow = opResults, http.MethodGet
	case sub == "content" && rq.kind == kindFile:
		rq.op, allow = opContent, http.MethodGet
	default:
		return rq, errNotFound(p)
	}
	if !slices.Contains(strings.Split(allow, ", "), method) {
		return rq, errMethod(method, allow)
	}
	rq.id = id
	return rq, nil
}

// serveResource serves the Message Batches and Files APIs: a create goes to
// a channel picked as a message's would be, among those whose provider
// serves the resource; a list merges the group's; every other call goes to
// the channel its id names.
func (r *Relay) serveResource(w http.ResponseWriter, req *http.Request, in *inbound) *failure {
	rq, rerr := parseResource(req.Method, req.URL.Path)
	if rerr != nil {
		return refused(rerr)
	}
	if rq.kind == kindBatch && rq.op == opCreate {
		if rerr := r.withinBudget(in, 0); rerr != nil {
			return refused(rerr)
		}
	}
	// results are held to the key's token limit: their tokens are charged
	// when they are read
	estimate := int64(-1)
	if rq.op == opResults {
		estimate = 0
	}
	if rerr := r.admitKeyAs(in, estimate); rerr != nil {
		return refused(rerr)
	}
	defer func() { in.state.limits.done(r.now(), in.keyGrant, in.billed()) }()
	secret, ok := r.secret.get()
	if !ok {
		return refused(errStorageUnavailable())
	}
	rc := &resourceCtx{r: r, w: w, req: req, in: in, rq: rq, secret: secret, group: in.key.group}
	switch rq.op {
	case opCreate:
		return rc.create()
	case opList:
		return rc.list()
	}
	return rc.item()
}

// admitKeyAs holds a request to its key's limits as admitKey does a
// message's; estimate -1 leaves it out of the token limit.
func (r *Relay) admitKeyAs(in *inbound, estimate int64) *relayError {
	g, scope, wait := in.state.limits.take(r.now(), estimate)
	in.keyGrant, in.keyAsked = g, true
	switch scope {
	case scopeNone:
		return nil
	case scopeStorage:
		return errStorageUnavailable()
	}
	metricRateLimited.WithLabelValues(in.key.name, string(scope)).Inc()
	return errKeyLimited(in.key.describe(), scope, wait)
}

// resourceCtx is one request of the Batches or Files API on its way.
type resourceCtx struct {
	r      *Relay
	w      http.ResponseWriter
	req    *http.Request
	in     *inbound
	rq     resourceRequest
	secret []byte
	group  *group
	held   *batchHoldTaken // a batch create's hold of its key's budgets
}

// servesResource reports whether ch's provider serves kind.
func servesResource(ch *channel, kind resourceKind) (provider.ResourceProvider, bool) {
	rp, ok := ch.provider.(provider.ResourceProvider)
	return rp, ok && rp.ServesResource(kind.String())
}

// errResourceNotFound answers an id that names nothing the group may see.
func errResourceNotFound(kind resourceKind, id string) *relayError {
	if len(id) > 128 {
		id = id[:128] + "..."
	}
	return &relayError{status: http.StatusNotFound, typ: "not_found_error", msg: "no such " + kind.noun() + ": " + strconv.Quote(id)}
}

// errOwnerGone answers an id whose channel is no longer in the group.
func errOwnerGone(kind resourceKind, channel, group string) *relayError {
	return &relayError{status: http.StatusNotFound, typ: "not_found_error",
		msg: "the channel that holds this " + kind.noun() + ", " + strconv.Quote(channel) + ", is no longer a channel of group " + strconv.Quote(group) + " that serves " + kind.String()}
}

// owner resolves a client's item id to its channel and the upstream's id:
// the id must be sealed for the group, and the item recorded as made by
// it. An item of another group, or of none, is answered as an id that
// does not exist.
func (c *resourceCtx) owner(kind resourceKind, id string) (*channel, provider.ResourceProvider, string, *relayError) {
	name, up, ok := parseItemID(c.secret, kind, c.group.name, id)
	if !ok {
		return nil, nil, "", errResourceNotFound(kind, id)
	}
	if rerr := c.r.checkOwners(c.req.Context(), kind, c.group.name, name, []string{up}, []string{id}); rerr != nil {
		return nil, nil, "", rerr
	}
	for _, ch := range c.group.channels {
		if ch.name == name {
			if rp, ok := servesResource(ch, kind); ok {
				return ch, rp, up, nil
			}
		}
	}
	return nil, nil, "", errOwnerGone(kind, name, c.group.name)
}

// waitForOwner waits, as wait_for_recovery allows, for the channel that
// holds an item to be live: no other channel has it.
func (c *resourceCtx) waitForOwner(ch *channel) *relayError {
	var deadline time.Time
	for {
		now := c.r.now()
		ok, until := ch.health.available(now)
		if ok {
			return nil
		}
		if c.group.waitMax > 0 && c.r.waitForRecovery(c.req.Context(), untilFrom(until, now), c.group.waitMax, now, &deadline) {
			continue
		}
		e := &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "no_healthy_channel", cause: causeRelay,
			msg: "the channel that holds this " + c.rq.kind.noun() + " is cooling down after failures; retry later", retryAfter: untilFrom(until, now)}
		if until.IsZero() {
			e.msg, e.noRetry = "the channel that holds this "+c.rq.kind.noun()+" is disabled", true
		}
		return e
	}
}

// item serves a call on one batch or file: at its channel, and only there.
func (c *resourceCtx) item() *failure {
	ch, rp, up, rerr := c.owner(c.rq.kind, c.rq.id)
	if rerr != nil {
		return refused(rerr)
	}
	if rerr := c.waitForOwner(ch); rerr != nil {
		return refused(rerr)
	}
	path := pathFiles
	if c.rq.kind == kindBatch {
		path = pathBatches
	}
	path += "/" + url.PathEscape(up)
	switch c.rq.op {
	case opCancel:
		path += "/cancel"
	case opResults:
		path += "/results"
	case opContent:
		path += "/content"
	}
	call := &provider.ResourceCall{Channel: ch.name, Method: c.req.Method, Path: path, RawQuery: c.req.URL.RawQuery, Header: c.req.Header, ContentLength: -1}
	a := c.send(ch, rp, call, ch.firstByte)
	if a.resp == nil {
		if f := a.failure; f != nil && f.err == nil {
			if c.gone(f.last) {
				c.forgetOwner(ch, up)
			}
			f.last.body = rewriteErrorIDs(f.last.body, up, c.rq.id)
		}
		return a.failure
	}
	defer a.close()
	switch c.rq.op {
	case opResults:
		c.results(a, up)
	case opContent:
		c.stream(a, nil)
	default:
		body, ok := c.readObject(a, ch)
		if !ok {
			return nil
		}
		if c.rq.op == opDelete {
			c.forgetOwner(ch, up)
		}
		c.sendObject(a, c.rewriteItem(body, ch.name))
	}
	return nil
}

// checkOwners checks that group made the items ups of kind at channel,
// whose client ids are ids: nil when it made them all, else the answer,
// 404 for the first it did not make, as for an id that does not exist.
func (r *Relay) checkOwners(ctx context.Context, kind resourceKind, group, channel string, ups, ids []string) *relayError {
	owners, err := r.owners.lookup(ctx, kind, channel, ups, false)
	if err != nil {
		if r.fleet == nil { // a fleet logs its storage's outages itself
			r.logger.Warn("could not read the owners of batches or files", zap.String("channel", channel), zap.Error(err))
		}
		return errOwnersUnavailable("the relay could not read who owns this " + kind.noun() + " from its storage; retry later")
	}
	for i, g := range owners {
		if g != group {
			return errResourceNotFound(kind, ids[i])
		}
	}
	return nil
}

// gone reports whether the upstream's answer says the item itself does
// not exist: a 404 not_found_error to a get or a delete of it. A 404 to
// its content or results may say only that those are not there (yet).
func (c *resourceCtx) gone(last attemptResult) bool {
	return (c.rq.op == opGet || c.rq.op == opDelete) && last.status == http.StatusNotFound &&
		gjson.GetBytes(last.body, "error.type").Str == "not_found_error"
}

// forgetOwner removes the record of the item up at ch, which the upstream
// no longer has. A record left behind names an item no list shows and
// every call finds gone, so failing to remove it is only logged.
func (c *resourceCtx) forgetOwner(ch *channel, up string) {
	if err := c.r.owners.forget(c.req.Context(), c.rq.kind, ch.name, up); err != nil {
		c.r.logger.Warn("could not remove the owner record of a deleted "+c.rq.kind.noun(), zap.String("channel", ch.name),
			zap.String("upstream_id", up), zap.Error(err))
	}
}

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
	r, in := c.r, c.in
	a := &resourceAttempt{c: c, ch: ch, start: time.Now()}
	t, scope := ch.health.admit(r.now(), -1)
	switch {
	case scope == scopeStorage:
		a.failure = refused(errStorageUnavailable())
		return a
	case t == nil:
		a.failure = refused(errQueue("the channel that holds this "+c.rq.kind.noun()+" is at its limit", time.Second))
		return a
	}
	a.t = t
	in.attempts++
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
	resp, err := ch.rt.RoundTrip(upReq)
	if err != nil {
		return fail(err)
	}
	firstByte := time.Since(a.start)
	metricFirstByte.WithLabelValues(ch.name).Observe(firstByte.Seconds())
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
	a.in().chain = append(a.in().chain, attemptRecord{channel: a.ch.name, outcome: v.outcome, duration: time.Since(a.start)})
	metricAttempts.WithLabelValues(a.ch.name, v.outcome.String()).Inc()
	if cooled := a.t.finish(v, a.ch.cooldown, r.now(), 0, 0); cooled > 0 {
		r.logger.Warn("channel cooling down", zap.String("channel", a.ch.name), zap.String("outcome", v.outcome.String()),
			zap.String("reason", v.reason), zap.Duration("cooldown", cooled), zap.String("request_id", a.in().id))
	}
	a.t = nil
}

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
	relayHeaders(h, c.in, a.ch, c.in.attempts, false)
	c.r.ratelimitHeaders(h, c.in)
	c.in.committed(a.ch, a.resp.StatusCode)
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
				c.in.incomplete = true
			}
			return false
		}
	}
}

// rewriteItem replaces the upstream's ids in one object of the API (a
// batch, a file, a deletion) with the client's.
func (c *resourceCtx) rewriteItem(obj []byte, channel string) []byte {
	kind := kindFile
	switch gjson.GetBytes(obj, "type").Str {
	case "message_batch", "message_batch_deleted":
		kind = kindBatch
	}
	id := gjson.GetBytes(obj, "id")
	if id.Type != gjson.String {
		return obj
	}
	clientID := itemID(c.secret, kind, c.group.name, channel, id.Str)
	out, err := sjson.SetBytes(obj, "id", clientID)
	if err != nil {
		return obj
	}
	if u := gjson.GetBytes(out, "results_url"); u.Type == gjson.String {
		if o, err := sjson.SetBytes(out, "results_url", c.baseURL()+pathBatches+"/"+clientID+"/results"); err == nil {
			out = o
		}
	}
	return out
}

// baseURL is the relay's own address as the client reached it.
func (c *resourceCtx) baseURL() string {
	scheme := "http"
	if c.req.TLS != nil {
		scheme = "https"
	}
	return scheme + "://" + c.req.Host
}

// create makes a batch or uploads a file on a channel picked among the
// group's that serve the resource: healthy, within limits, the best tier,
// by weight; for a batch, serving the model of every one of its requests
// and holding every file they reference. It fails over as a message does,
// except that an upload, streamed, fails over only before any of it was
// sent.
func (c *resourceCtx) create() *failure {
	var body []byte
	var models []string
	var pinned *channel
	if c.rq.kind == kindBatch {
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
	if c.rq.kind == kindBatch { // a batch holds its worst case before anything is sent
		held, rerr := c.r.holdBatch(c.in, body, &cands)
		if rerr != nil {
			return refused(rerr)
		}
		defer held.abandon() // unless the batch was made
		c.held = held
	}

	var upload *uploadBody
	if c.rq.kind == kindFile {
		if c.req.ContentLength > c.r.MaxUploadSize {
			return refused(errTooLarge(c.r.MaxUploadSize))
		}
		upload = &uploadBody{r: c.req.Body, limit: c.r.MaxUploadSize}
	}
	path := pathFiles
	if c.rq.kind == kindBatch {
		path = pathBatches
	}
	var tried []*channel
	var last *failure
	var recoveryDeadline time.Time
	for n := 1; ; {
		now := c.r.now()
		ch, recovery := pickResource(cands, tried, models, now, c.r.rand)
		if ch == nil {
			if last != nil {
				return last
			}
			if c.group.waitMax > 0 && c.r.waitForRecovery(c.req.Context(), untilFrom(recovery, now), c.group.waitMax, now, &recoveryDeadline) {
				continue
			}
			return refused(errNoHealthyChannel(c.rq.kind.String(), untilFrom(recovery, now)))
		}
		tried = append(tried, ch)
		rp, _ := servesResource(ch, c.rq.kind)
		call := &provider.ResourceCall{Channel: ch.name, Method: http.MethodPost, Path: path, RawQuery: c.req.URL.RawQuery, Header: c.req.Header, ContentLength: int64(len(body))}
		timeout := ch.firstByte
		if upload != nil {
			call.Body, call.ContentLength, timeout = upload, c.req.ContentLength, ch.response
			if call.ContentLength <= 0 {
				call.ContentLength = -1
			}
		} else {
			call.Body = bytes.NewReader(body)
		}
		if n > 1 {
			metricFailovers.WithLabelValues(c.group.name).Inc()
		}
		a := c.send(ch, rp, call, timeout)
		if a.resp != nil {
			defer a.close()
			obj, ok := c.readObject(a, ch)
			if !ok {
				return nil
			}
			if rerr := c.recordOwner(ch, rp, obj); rerr != nil {
				return refused(rerr)
			}
			c.held.keep(ch.name, gjson.GetBytes(obj, "id").Str)
			c.sendObject(a, c.rewriteItem(obj, ch.name))
			return nil
		}
		if upload != nil && upload.over.Load() {
			return refused(errTooLarge(c.r.MaxUploadSize))
		}
		if a.failure == nil || a.failure.err != nil { // the client is gone, or the relay refused
			return a.failure
		}
		a.failure.attempts = n
		last = a.failure
		sent := upload != nil && upload.n.Load() > 0
		if !a.res.verdict.outcome.retryable() || sent || n > c.group.retries || !c.group.state.budget.allowRetry(now, c.group.budgetRatio, c.group.budgetFloor) {
			return last
		}
		n++
	}
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
	if reqs := gjson.Get(unsafe.String(unsafe.SliceData(body), len(body)), "requests"); reqs.IsArray() {
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

// pickResource picks the channel for a create among cands: not tried,
// live, not refusing a model, not at a limit, of the best tier, by weight.
// With none, it says when the first cooling one recovers (zero: none will
// by itself).
func pickResource(cands, tried []*channel, models []string, now time.Time, rnd randIntN) (*channel, time.Time) {
	var buf [maxChannelsPerPick]*channel
	live := buf[:0]
	var recovery time.Time
	for _, ch := range cands {
		if contains(tried, ch) {
			continue
		}
		if ok, until := ch.health.available(now); !ok {
			if !until.IsZero() && (recovery.IsZero() || until.Before(recovery)) {
				recovery = until
			}
			continue
		}
		refused := false
		for _, m := range models {
			if r, _ := ch.health.refuses(m, now); r {
				refused = true
			}
		}
		if busy, _, _ := ch.health.busy(now); busy || refused {
			continue
		}
		live = append(live, ch)
	}
	if len(live) == 0 {
		return nil, recovery
	}
	return weighted(bestTier(live), rnd), time.Time{}
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

var errUploadTooLarge = errors.New("upload larger than max_upload_size")

func (u *uploadBody) Read(p []byte) (int, error) {
	n, err := u.r.Read(p)
	if u.n.Add(int64(n)) > u.limit {
		u.over.Store(true)
		return 0, errUploadTooLarge
	}
	return n, err
}

// rewriteErrorIDs replaces an upstream's id with the client's in an error
// body the relay passes on, so the upstream's ids stay the relay's.
func rewriteErrorIDs(body []byte, up, clientID string) []byte {
	if up == "" || !bytes.Contains(body, []byte(up)) {
		return body
	}
	return bytes.ReplaceAll(body, []byte(up), []byte(clientID))
}
