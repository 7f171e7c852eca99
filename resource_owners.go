package relay

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

// Who made each batch and file is kept by internal/owners; here, the
// record of a new item, taken back at the upstream when it cannot be made.

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
