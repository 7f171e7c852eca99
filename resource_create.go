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
