package relay

import (
	"bytes"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// The Message Batches and Files APIs: their routes, a call's way to its
// channel by the id it names, and the ids in what the client sees
// rewritten to the relay's (internal/resourceid).

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
	kind resourceid.Kind
	op   resourceOp
	id   string // the client's id of the item, for item operations
}

// parseResource reads the operation of a request under the Batches or Files
// API.
func parseResource(method, p string) (resourceRequest, *relayError) {
	var rq resourceRequest
	rest, ok := strings.CutPrefix(p, pathBatches)
	rq.kind = resourceid.Batch
	if !ok {
		rest, _ = strings.CutPrefix(p, pathFiles)
		rq.kind = resourceid.File
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
	case sub == "cancel" && rq.kind == resourceid.Batch:
		rq.op, allow = opCancel, http.MethodPost
	case sub == "results" && rq.kind == resourceid.Batch:
		rq.op, allow = opResults, http.MethodGet
	case sub == "content" && rq.kind == resourceid.File:
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
	if rq.kind == resourceid.Batch && rq.op == opCreate {
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
	defer func() { in.who.state.limits.Done(r.now(), in.grant.keyGrant, in.billed()) }()
	secret, ok := r.secret.Get()
	if !ok {
		return refused(errStorageUnavailable())
	}
	rc := &resourceCtx{r: r, w: w, req: req, in: in, rq: rq, secret: secret, group: in.who.key.group}
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
	g, scope, wait := in.who.state.limits.Take(r.now(), estimate)
	return r.keyAdmitted(in, g, scope, wait)
}

// keyAdmitted notes what the key's limits granted the request (for its
// rate limit headers), and answers a refusal.
func (r *Relay) keyAdmitted(in *inbound, g limits.Grant, scope limits.Scope, wait time.Duration) *relayError {
	in.grant.keyGrant, in.grant.keyAsked = g, true
	switch scope {
	case limits.ScopeNone:
		return nil
	case limits.ScopeFleetDown:
		return errStorageUnavailable()
	}
	metricRateLimited.WithLabelValues(in.who.key.name, string(scope)).Inc()
	return errKeyLimited(in.who.key.describe(), scope, wait)
}

// fleetClient is the Redis client of the relay's fleet, where the state
// of batches and files (their ids' secret, their owners) is kept; nil
// without a fleet.
func (r *Relay) fleetClient() *fleet.Client {
	if r.fleet == nil {
		return nil
	}
	return r.fleet.Client
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
	held   *money.BatchHolds // a batch create's hold of its key's budgets
}

// servesResource reports whether ch's provider serves kind.
func servesResource(ch *channel, kind resourceid.Kind) (provider.ResourceProvider, bool) {
	rp, ok := ch.provider.(provider.ResourceProvider)
	return rp, ok && rp.ServesResource(kind.String())
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
	if c.rq.kind == resourceid.Batch {
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

// gone reports whether the upstream's answer says the item itself does
// not exist: a 404 not_found_error to a get or a delete of it. A 404 to
// its content or results may say only that those are not there (yet).
func (c *resourceCtx) gone(last attemptResult) bool {
	return (c.rq.op == opGet || c.rq.op == opDelete) && last.status == http.StatusNotFound &&
		gjson.GetBytes(last.body, "error.type").Str == "not_found_error"
}

// rewriteItem replaces the upstream's ids in one object of the API (a
// batch, a file, a deletion) with the client's.
func (c *resourceCtx) rewriteItem(obj []byte, channel string) []byte {
	kind := resourceid.File
	switch gjson.GetBytes(obj, "type").Str {
	case "message_batch", "message_batch_deleted":
		kind = resourceid.Batch
	}
	id := gjson.GetBytes(obj, "id")
	if id.Type != gjson.String {
		return obj
	}
	clientID := resourceid.Item(c.secret, kind, c.group.name, channel, id.Str)
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

// rewriteErrorIDs replaces an upstream's id with the client's in an error
// body the relay passes on, so the upstream's ids stay the relay's.
func rewriteErrorIDs(body []byte, up, clientID string) []byte {
	if up == "" || !bytes.Contains(body, []byte(up)) {
		return body
	}
	return bytes.ReplaceAll(body, []byte(up), []byte(clientID))
}
