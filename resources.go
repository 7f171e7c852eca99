package relay

import (
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
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
	defer func() { in.who.state.limits.Done(r.now(), in.grant.keyGrant, in.billed()) }()
	secret, ok := r.secret.get()
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
