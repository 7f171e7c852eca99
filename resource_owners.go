package relay

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddy-relay/relay/provider"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

// The owner of a batch or a file is the channel that holds it, which its
// id names (internal/resourceid), and the group that made it, which
// internal/owners records. Here the root resolves a client's ids to their
// owner: an item's id in a path (owner), the file ids in a message's body
// (pinFiles); checks the group's records on every call; records a new
// item's (taking it back at the upstream when that fails) and forgets a
// deleted one's.

// errResourceNotFound answers an id that names nothing the group may see.
func errResourceNotFound(kind resourceid.Kind, id string) *relayError {
	if len(id) > 128 {
		id = id[:128] + "..."
	}
	return &relayError{status: http.StatusNotFound, typ: "not_found_error", msg: "no such " + kind.Noun() + ": " + strconv.Quote(id)}
}

// errOwnerGone answers an id whose channel is no longer in the group.
func errOwnerGone(kind resourceid.Kind, channel, group string) *relayError {
	return &relayError{status: http.StatusNotFound, typ: "not_found_error",
		msg: "the channel that holds this " + kind.Noun() + ", " + strconv.Quote(channel) + ", is no longer a channel of group " + strconv.Quote(group) + " that serves " + kind.String()}
}

// owner resolves a client's item id to its channel and the upstream's id:
// the id must be sealed for the group, and the item recorded as made by
// it. An item of another group, or of none, is answered as an id that
// does not exist.
func (c *resourceCtx) owner(kind resourceid.Kind, id string) (*channel, provider.ResourceProvider, string, *relayError) {
	name, up, ok := resourceid.ParseItem(c.secret, kind, c.group.name, id)
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
		ok, until := ch.health.Available(now)
		if ok {
			return nil
		}
		if c.group.waitMax > 0 && c.r.waitForRecovery(c.req.Context(), untilFrom(until, now), c.group.waitMax, now, &deadline) {
			continue
		}
		e := &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "no_healthy_channel", cause: causeRelay,
			msg: "the channel that holds this " + c.rq.kind.Noun() + " is cooling down after failures; retry later", retryAfter: untilFrom(until, now)}
		if until.IsZero() {
			e.msg, e.noRetry = "the channel that holds this "+c.rq.kind.Noun()+" is disabled", true
		}
		return e
	}
}

// checkOwners checks that group made the items ups of kind at channel,
// whose client ids are ids: nil when it made them all, else the answer,
// 404 for the first it did not make, as for an id that does not exist.
func (r *Relay) checkOwners(ctx context.Context, kind resourceid.Kind, group, channel string, ups, ids []string) *relayError {
	owners, err := r.owners.Lookup(ctx, kind, channel, ups, false)
	if err != nil {
		if r.fleet == nil { // a fleet logs its storage's outages itself
			r.logger.Warn("could not read the owners of batches or files", zap.String("channel", channel), zap.Error(err))
		}
		return errOwnersUnavailable("the relay could not read who owns this " + kind.Noun() + " from its storage; retry later")
	}
	for i, g := range owners {
		if g != group {
			return errResourceNotFound(kind, ids[i])
		}
	}
	return nil
}

// forgetOwner removes the record of the item up at ch, which the upstream
// no longer has. A record left behind names an item no list shows and
// every call finds gone, so failing to remove it is only logged.
func (c *resourceCtx) forgetOwner(ch *channel, up string) {
	if err := c.r.owners.Forget(c.req.Context(), c.rq.kind, ch.name, up); err != nil {
		c.r.logger.Warn("could not remove the owner record of a deleted "+c.rq.kind.Noun(), zap.String("channel", ch.name),
			zap.String("upstream_id", up), zap.Error(err))
	}
}

// errOwnersUnavailable answers a call on batches or files when the
// relay's storage could not say, or could not record, who owns an item:
// the relay serves no item without knowing whose it is.
func errOwnersUnavailable(msg string) *relayError {
	return &relayError{status: http.StatusServiceUnavailable, typ: "relay_error", code: "storage_unavailable",
		msg: msg, retryAfter: time.Second, cause: causeRelay}
}

// recordOwner records the group as the owner of the item the upstream has
// just made (obj, its answer), before the client learns its id.
//
// When the record cannot be written, the item would be no one's: no list
// would show it and no call could reach it. So the relay takes it back at
// the upstream (deletes a file; cancels a batch, which can be deleted only
// once it has ended), logs that, and answers 503 storage_unavailable, which
// the SDKs retry. Only when taking it back fails too is an item left that
// no group sees; the relay then logs an error with the channel and the
// upstream's id, for an operator to remove it.
func (c *resourceCtx) recordOwner(ch *channel, rp provider.ResourceProvider, obj []byte) *relayError {
	id := gjson.GetBytes(obj, "id")
	if id.Type != gjson.String || id.Str == "" {
		return nil // nothing a client could call it by: passed on as it is
	}
	ctx := context.WithoutCancel(c.req.Context()) // the client may be gone; the record is the relay's
	err := c.r.owners.Record(ctx, c.rq.kind, ch.name, id.Str, c.group.name)
	if err == nil {
		return nil
	}
	noun, undone := c.rq.kind.Noun(), "deleted"
	if c.rq.kind == resourceid.Batch {
		undone = "cancelled"
	}
	fields := []zap.Field{zap.String("channel", ch.name), zap.String("group", c.group.name), zap.String("upstream_id", id.Str),
		zap.String("request_id", c.in.id), zap.NamedError("record_error", err)}
	if undoErr := c.undoCreate(ctx, ch, rp, id.Str); undoErr != nil {
		c.r.logger.Error("the owner of a new "+noun+" could not be recorded, and it could not be "+undone+
			" at the upstream either: no group sees it through the relay; remove it at the upstream", append(fields, zap.NamedError("undo_error", undoErr))...)
		return errOwnersUnavailable("the relay could not record that the new " + noun + " is your group's; retry later")
	}
	c.r.logger.Warn("the owner of a new "+noun+" could not be recorded; it was "+undone+" at the upstream", fields...)
	return errOwnersUnavailable("the relay could not record that the new " + noun + " is your group's, so it " + undone + " it at the upstream; retry later")
}

// undoCreate takes back the item up the channel has just made: a file is
// deleted, a batch cancelled.
func (c *resourceCtx) undoCreate(ctx context.Context, ch *channel, rp provider.ResourceProvider, up string) error {
	h := c.req.Header.Clone()
	h.Del("Content-Type") // the create's, not this call's
	call := &provider.ResourceCall{Channel: ch.name, Method: http.MethodDelete, Path: pathFiles + "/" + url.PathEscape(up), Header: h, ContentLength: -1}
	if c.rq.kind == resourceid.Batch {
		call.Method, call.Path = http.MethodPost, pathBatches+"/"+url.PathEscape(up)+"/cancel"
	}
	ctx, cancel := context.WithTimeout(ctx, ch.response)
	defer cancel()
	req, err := rp.NewResourceRequest(ctx, call)
	if err != nil {
		return err
	}
	resp, err := ch.rt.RoundTrip(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("the upstream answered %d", resp.StatusCode)
	}
	return nil
}

// A message (or a batch) whose content references an uploaded file (a
// document or image block with a source of type "file", a
// container_upload) can only be served by the channel that holds the file:
// the relay finds every "file_id" in the body, checks that the group made
// each file (internal/owners), sends the request to that channel alone,
// and puts the upstream's ids in place of the client's. Only bodies that
// hold "file_id" pay for this.

// fileIDKey is what a body that references a file holds. Bodies without it
// (nearly all) are not scanned again.
var fileIDKey = []byte(`"file_id"`)

// mayReferenceFiles reports whether body holds fileIDKey. It looks for the
// key's '_', rare in prose, at memchr speed, and leaves it to bytes.Contains
// (several times slower on JSON, where '"' is everywhere) only once a body
// shows many underscores, as source code does.
func mayReferenceFiles(body []byte) bool {
	const k = len(`"file`)
	for misses := 0; misses < 16; misses++ {
		i := bytes.IndexByte(body, '_')
		if i < 0 {
			return false
		}
		if i >= k && len(body)-i >= 4 && string(body[i-k:i+4]) == `"file_id"` {
			return true
		}
		body = body[i+1:]
	}
	return bytes.Contains(body, fileIDKey)
}

// fileRef is one file id in a body: where its JSON string is, and the
// upstream's id in its place.
type fileRef struct {
	start, end int
	up         string
}

// pinFiles resolves the file ids of body (from group) to the one channel
// that holds them all, and returns the body with the upstream's ids, and
// how far that moved the byte at offset at (where a message's model is).
// An id that is not the group's (sealed for another group, or naming a
// file the group did not make) is a 404 not_found_error, as an id that does
// not exist; files held by different channels, a 400. Ids are resolved as
// they are found, each once, and once one is refused the rest of the body
// is only checked to be JSON: what a body of many ids costs is a small
// multiple of its size. The owners of its files are then one look-up.
func (r *Relay) pinFiles(ctx context.Context, secret []byte, g *group, body []byte, at int) (_ []byte, owner *channel, moved int, _ *relayError) {
	var refs []fileRef
	var refusal *relayError
	resolved := map[string]string{} // by the id's JSON: an id is checked once
	var ups, ids []string           // each file once: the upstream's id, the client's
	err := eachFileID(body, func(start, end int) {
		if refusal != nil {
			return
		}
		if up, ok := resolved[string(body[start:end])]; ok {
			refs = append(refs, fileRef{start: start, end: end, up: up})
			return
		}
		raw, err := jsontext.AppendUnquote(nil, body[start:end])
		if err != nil {
			refusal = errInvalid("file_id must be a string")
			return
		}
		id := string(raw)
		name, up, ok := resourceid.ParseItem(secret, resourceid.File, g.name, id)
		if !ok {
			refusal = errResourceNotFound(resourceid.File, id)
			return
		}
		if owner != nil && owner.name != name {
			refusal = errInvalid("the files this request references are held by different channels (" +
				strconv.Quote(owner.name) + " and " + strconv.Quote(name) + "); one request can only use files uploaded through one channel")
			return
		}
		if owner == nil {
			for _, ch := range g.channels {
				if _, serves := servesResource(ch, resourceid.File); serves && ch.name == name {
					owner = ch
				}
			}
			if owner == nil {
				refusal = errOwnerGone(resourceid.File, name, g.name)
				return
			}
		}
		resolved[string(body[start:end])] = up
		ups, ids = append(ups, up), append(ids, id)
		refs = append(refs, fileRef{start: start, end: end, up: up})
	})
	switch {
	case err != nil:
		return nil, nil, 0, errBodyJSON(err)
	case refusal != nil:
		return nil, nil, 0, refusal
	case len(refs) == 0:
		return body, nil, 0, nil
	}
	if rerr := r.checkOwners(ctx, resourceid.File, g.name, owner.name, ups, ids); rerr != nil {
		return nil, nil, 0, rerr
	}
	out := make([]byte, 0, len(body))
	prev := 0
	for _, ref := range refs {
		out = append(out, body[prev:ref.start]...)
		out = strconv.AppendQuote(out, ref.up)
		prev = ref.end
		if ref.end <= at {
			moved = len(out) - ref.end
		}
	}
	return append(out, body[prev:]...), owner, moved, nil
}

// eachFileID calls f with where the string value of every object member
// named file_id is in body (its quotes included), at any depth, in order.
// It fails as the strict scan of a body does.
func eachFileID(body []byte, f func(start, end int)) error {
	src := bytes.NewBuffer(body) // read in place, never copied
	dec := jsontext.NewDecoder(src)
	for {
		kind, n := dec.StackIndex(dec.StackDepth())
		tok, err := dec.ReadToken()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if kind != '{' || n%2 != 0 || tok.Kind() != '"' || tok.String() != "file_id" || dec.PeekKind() != '"' {
			continue
		}
		v, err := dec.ReadValue()
		if err != nil {
			return err
		}
		end := int(dec.InputOffset())
		f(end-len(v), end)
	}
}

// pinToFiles sends a message that references files to the channel that
// holds them: its group becomes that channel alone, which gets the body
// with the upstream's file ids (the body as asked stays as it came).
func (r *Relay) pinToFiles(ctx context.Context, in *inbound) *relayError {
	secret, ok := r.secret.Get()
	if !ok {
		return errStorageUnavailable()
	}
	g := in.who.key.group
	body, ch, moved, rerr := r.pinFiles(ctx, secret, g, in.ask.body, in.ask.modelStart)
	if rerr != nil || ch == nil {
		return rerr
	}
	if !ch.serves(in.ask.model) {
		return &relayError{status: http.StatusBadRequest, typ: "invalid_request_error",
			msg: "the files this request references are held by channel " + strconv.Quote(ch.name) + ", which does not serve model " + strconv.Quote(in.ask.model)}
	}
	// the model's place moves by what the ids before it changed
	in.grant.pinnedBody = pinnedBody{body: body, modelStart: in.ask.modelStart + moved, modelEnd: in.ask.modelEnd + moved}
	pinned := *g
	pinned.channels, pinned.splits = []*channel{ch}, nil
	in.grant.pinned = &pinned
	return nil
}
