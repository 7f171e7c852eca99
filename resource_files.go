package relay

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"slices"
	"strconv"

	"github.com/go-json-experiment/json/jsontext"
)

// A message (or a batch) whose content references an uploaded file (a
// document or image block with a source of type "file", a
// container_upload) can only be served by the channel that holds the file:
// the relay finds every "file_id" in the body, checks that the group made
// each file (resource_owners.go), sends the request to that channel alone,
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

// fileRef is one file id in a body: where its JSON string is.
type fileRef struct {
	start, end int
	channel    string
	up         string
}

// pinFiles resolves the file ids of body (from group) to the one channel
// that holds them all, and returns the body with the upstream's ids. An id
// that is not the group's (sealed for another group, or naming a file the
// group did not make) is a 404 not_found_error, as an id that does not
// exist; files held by different channels, a 400. The owners of the files
// are one look-up per channel they name (one, unless the 400 follows).
func (r *Relay) pinFiles(ctx context.Context, secret []byte, g *group, body []byte) ([]byte, *channel, *relayError) {
	refs, err := findFileIDs(body)
	if err != nil {
		return nil, nil, errBodyJSON(err)
	}
	if len(refs) == 0 {
		return body, nil, nil
	}
	ids := make([]string, len(refs))
	var channels []string
	for i := range refs {
		ref := &refs[i]
		raw, err := jsontext.AppendUnquote(nil, body[ref.start:ref.end])
		if err != nil {
			return nil, nil, errInvalid("file_id must be a string")
		}
		ids[i] = string(raw)
		name, up, ok := parseItemID(secret, kindFile, g.name, ids[i])
		if !ok {
			return nil, nil, errResourceNotFound(kindFile, ids[i])
		}
		ref.channel, ref.up = name, up
		if !slices.Contains(channels, name) {
			channels = append(channels, name)
		}
	}
	for _, name := range channels {
		var ups, of []string
		for i, ref := range refs {
			if ref.channel == name {
				ups, of = append(ups, ref.up), append(of, ids[i])
			}
		}
		if rerr := r.checkOwners(ctx, kindFile, g.name, name, ups, of); rerr != nil {
			return nil, nil, rerr
		}
	}
	if len(channels) > 1 {
		return nil, nil, errInvalid("the files this request references are held by different channels (" +
			strconv.Quote(channels[0]) + " and " + strconv.Quote(channels[1]) + "); one request can only use files uploaded through one channel")
	}
	var owner *channel
	for _, ch := range g.channels {
		if _, serves := servesResource(ch, kindFile); serves && ch.name == channels[0] {
			owner = ch
		}
	}
	if owner == nil {
		return nil, nil, errOwnerGone(kindFile, channels[0], g.name)
	}
	out := make([]byte, 0, len(body))
	at := 0
	for _, ref := range refs {
		out = append(out, body[at:ref.start]...)
		out = strconv.AppendQuote(out, ref.up)
		at = ref.end
	}
	return append(out, body[at:]...), owner, nil
}

// findFileIDs finds the string value of every object member named file_id,
// at any depth.
func findFileIDs(body []byte) ([]fileRef, error) {
	dec := jsontext.NewDecoder(bytes.NewReader(body))
	var refs []fileRef
	for {
		kind, n := dec.StackIndex(dec.StackDepth())
		tok, err := dec.ReadToken()
		if err == io.EOF {
			return refs, nil
		}
		if err != nil {
			return nil, err
		}
		if kind != '{' || n%2 != 0 || tok.Kind() != '"' || tok.String() != "file_id" {
			continue
		}
		if dec.PeekKind() != '"' {
			continue
		}
		v, err := dec.ReadValue()
		if err != nil {
			return nil, err
		}
		end := int(dec.InputOffset())
		refs = append(refs, fileRef{start: end - len(v), end: end})
	}
}

// pinToFiles sends a message that references files to the channel that
// holds them: the request's body gets the upstream's file ids, and its
// group becomes that channel alone.
func (r *Relay) pinToFiles(ctx context.Context, in *inbound) *relayError {
	secret, ok := r.secret.get()
	if !ok {
		return errStorageUnavailable()
	}
	g := in.key.group
	body, ch, rerr := r.pinFiles(ctx, secret, g, in.body)
	if rerr != nil || ch == nil {
		return rerr
	}
	if !ch.serves(in.model) {
		return &relayError{status: http.StatusBadRequest, typ: "invalid_request_error",
			msg: "the files this request references are held by channel " + strconv.Quote(ch.name) + ", which does not serve model " + strconv.Quote(in.model)}
	}
	// the model's place moves by what the ids before it changed
	if len(body) != len(in.body) {
		start := in.modelStart
		delta := 0
		refs, _ := findFileIDs(in.body)
		out, _ := findFileIDs(body)
		for i := range refs {
			if refs[i].end <= start {
				delta = out[i].end - refs[i].end
			}
		}
		in.modelStart += delta
		in.modelEnd += delta
	}
	in.body = body
	pinned := *g
	pinned.channels, pinned.splits = []*channel{ch}, nil
	in.pinned = &pinned
	return nil
}
