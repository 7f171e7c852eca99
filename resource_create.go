package relay

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
)

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
		defer held.Abandon() // unless the batch was made
		c.held = held
	}

	ca := &createAttempt{c: c, models: models, body: body, path: pathFiles}
	ca.cands = cands
	if c.rq.kind == kindBatch {
		ca.path = pathBatches
	}
	if c.rq.kind == kindFile {
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
		if refused, _ := ch.health.refuses(m, now); refused {
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
