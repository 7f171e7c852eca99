package relay

import (
	"bytes"
	"context"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
	"go.uber.org/zap"
)

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

// rewriteErrorIDs replaces an upstream's id with the client's in an error
// body the relay passes on, so the upstream's ids stay the relay's.
func rewriteErrorIDs(body []byte, up, clientID string) []byte {
	if up == "" || !bytes.Contains(body, []byte(up)) {
		return body
	}
	return bytes.ReplaceAll(body, []byte(up), []byte(clientID))
}
