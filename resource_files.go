package relay

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"

	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/go-json-experiment/json/jsontext"
)

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
// holds them: the request's body gets the upstream's file ids, and its
// group becomes that channel alone.
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
	in.ask.modelStart += moved
	in.ask.modelEnd += moved
	in.ask.body = body
	pinned := *g
	pinned.channels, pinned.splits = []*channel{ch}, nil
	in.grant.pinned = &pinned
	return nil
}
