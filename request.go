package relay

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/tidwall/gjson"
)

// route is an endpoint the relay serves.
type route uint8

const (
	routeMessages route = iota + 1
	routeCountTokens
	routeModels
	routeModel // GET /v1/models/{id}
	routeCount
)

// upstreamPath is the path a relayed route takes upstream; empty for the
// routes the relay answers itself.
func (rt route) upstreamPath() string {
	switch rt {
	case routeMessages:
		return "/v1/messages"
	case routeCountTokens:
		return "/v1/messages/count_tokens"
	}
	return ""
}

// routeByPath returns the relayed route of a path, or 0.
func routeByPath(p string) route {
	switch p {
	case "/v1/messages":
		return routeMessages
	case "/v1/messages/count_tokens":
		return routeCountTokens
	}
	return 0
}

// routeOf finds the endpoint of a request, or the error that answers it.
func routeOf(req *http.Request) (route, *relayError) {
	p := req.URL.Path
	rt := routeByPath(p)
	switch {
	case rt != 0:
	case p == "/v1/models":
		rt = routeModels
	case strings.HasPrefix(p, "/v1/models/") && len(p) > len("/v1/models/") && !strings.Contains(p[len("/v1/models/"):], "/"):
		rt = routeModel
	default:
		return 0, errNotFound(p)
	}
	want := http.MethodPost
	if rt == routeModels || rt == routeModel {
		want = http.MethodGet
	}
	if req.Method != want {
		return 0, errMethod(req.Method, want)
	}
	return rt, nil
}

// key is a provisioned relay key.
type key struct {
	name   string
	group  *group
	prio   priority
	limits *limiter // kept across reloads by name
}

// authenticate finds the relay key of a request. Keys are looked up by the
// sha256 of what the client sent, so no comparison ever runs over the
// secret itself and the time taken says nothing about how close a guess was.
func (r *Relay) authenticate(req *http.Request) (*key, *relayError) {
	secret := req.Header.Get("X-Api-Key")
	if secret == "" {
		if auth := req.Header.Get("Authorization"); len(auth) > 7 && strings.EqualFold(auth[:7], "bearer ") {
			secret = strings.TrimSpace(auth[7:])
		}
	}
	if secret == "" {
		return nil, errAuth("missing relay key: send it as x-api-key or as Authorization: Bearer")
	}
	k, ok := r.keys[sha256.Sum256([]byte(secret))]
	if !ok {
		return nil, errAuth("invalid relay key")
	}
	return k, nil
}

// bodyPool holds request body buffers. Buffers that grew past
// maxPooledBody are dropped rather than kept alive by the pool.
var bodyPool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledBody = 4 << 20

func releaseBody(b *bytes.Buffer) {
	if b.Cap() <= maxPooledBody {
		b.Reset()
		bodyPool.Put(b)
	}
}

// readBody reads the whole request body, at most limit bytes, into a pooled
// buffer that serves every attempt. The caller releases it.
func readBody(req *http.Request, limit int64) (*bytes.Buffer, *relayError) {
	if req.ContentLength > limit {
		return nil, errTooLarge(limit)
	}
	buf := bodyPool.Get().(*bytes.Buffer)
	if req.ContentLength > 0 {
		buf.Grow(int(req.ContentLength))
	}
	_, err := buf.ReadFrom(io.LimitReader(req.Body, limit+1))
	switch {
	case err != nil:
		releaseBody(buf)
		return nil, errInvalid("could not read the request body: " + err.Error())
	case int64(buf.Len()) > limit:
		releaseBody(buf)
		return nil, errTooLarge(limit)
	}
	return buf, nil
}

// inbound is one client request: what the relay knows of it, and what it
// came to, for the account step (log line, metrics, placeholders).
type inbound struct {
	id       string
	route    route
	rawQuery string
	key      *key
	header   http.Header
	body     []byte // the client's body, unchanged; backed by a pooled buffer
	model    string // as the client asked
	target   string // the model being served: model, or a fallback of it
	userID   string // metadata.user_id, for sticky sessions
	stream   bool
	caps     capability
	// modelStart and modelEnd delimit the raw model value (quotes included)
	// in body, so a mapped name is spliced in without re-encoding the JSON.
	modelStart, modelEnd int

	start      time.Time
	status     int           // sent to the client; 0 until then
	attempts   int           // made so far
	answered   *channel      // the channel whose answer the client got
	firstByte  time.Duration // until the client's response headers
	chain      []attemptRecord
	chainBuf   [4]attemptRecord
	usage      usage
	incomplete bool  // the answer did not complete: tokens are the ones seen
	estimate   int64 // input tokens guessed at admission, for the token limits
	fallbacks  int   // fallback models tried so far

	bodyBuf *bytes.Buffer // the pooled buffer behind body; nil once released
	// writing counts the upstream requests whose transport may still read
	// body: net/http may write a request body even after RoundTrip returned,
	// until its WroteRequest trace says it is done.
	writing atomic.Int32
}

// billed is what the request used against token limits.
func (in *inbound) billed() int64 { return billedTokens(in.usage) }

// releaseBody lets go of the body's buffer, once: back to its pool when no
// transport can still read it, else to the garbage collector.
func (in *inbound) releaseBody() {
	if in.bodyBuf == nil {
		return
	}
	if in.writing.Load() == 0 {
		releaseBody(in.bodyBuf)
	}
	in.bodyBuf, in.body = nil, nil
}

// upstreamBody prepares an upstream request body b, which may share the
// client body's pooled buffer: ctx then traces when the transport is done
// writing it. The body stays a *bytes.Reader, which net/http writes best.
func (in *inbound) upstreamBody(ctx context.Context, b []byte) (context.Context, io.Reader, func() (io.ReadCloser, error)) {
	getBody := func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	if len(b) == 0 || len(in.body) == 0 || &b[0] != &in.body[0] {
		return ctx, bytes.NewReader(b), getBody // a copy (a mapped model): nothing shared
	}
	in.writing.Add(1)
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteRequest: in.wrote})
	return ctx, bytes.NewReader(b), func() (io.ReadCloser, error) {
		in.writing.Add(1) // a retry of the write, on a new connection
		return getBody()
	}
}

// wrote is the WroteRequest trace of an upstream request that shares the
// body's buffer.
func (in *inbound) wrote(httptrace.WroteRequestInfo) { in.writing.Add(-1) }

// attemptRecord is one link of a request's attempt chain.
type attemptRecord struct {
	channel  string
	outcome  outcome
	duration time.Duration
}

// reply answers with a relay error.
func (in *inbound) reply(w http.ResponseWriter, e *relayError) {
	in.status = e.status
	e.write(w, in.id)
}

// committed records that ch's answer, with status, is going to the client.
func (in *inbound) committed(ch *channel, status int) {
	in.status, in.answered = status, ch
	in.firstByte = time.Since(in.start)
}

// inspect reads the fields routing needs with one pass over the top level
// of the body: model, stream and the capability fields. The top level must
// be one well-formed JSON object; what the values hold inside is the
// upstream's to judge (it answers a malformed one with its own 400), so the
// relay never reads a body twice.
func (in *inbound) inspect() *relayError {
	// The string view of the body lives no longer than this call; the only
	// value kept (the model) is copied.
	s := unsafe.String(unsafe.SliceData(in.body), len(in.body))
	root := gjson.Parse(s)
	if !root.IsObject() {
		if root.Exists() {
			return errInvalid("request body must be a JSON object")
		}
		return errInvalid("request body is not valid JSON")
	}
	var model gjson.Result
	end := -1 // where the last top-level value ends
	root.ForEach(func(k, v gjson.Result) bool {
		switch k.Str {
		case "model":
			model = v
		case "stream":
			in.stream = v.Type == gjson.True
		case "metadata":
			if u := v.Get("user_id"); u.Type == gjson.String {
				in.userID = strings.Clone(u.Str)
			}
		default:
			if c := capabilityByName(k.Str); c != 0 && v.Type != gjson.Null {
				in.caps |= c
			}
		}
		end = v.Index + len(v.Raw)
		return v.Index > 0 // a value gjson could not place: stop
	})
	if end < 0 {
		if strings.TrimSpace(s) != "{}" {
			return errInvalid("request body is not valid JSON")
		}
	} else if end > len(s) || strings.TrimSpace(s[end:]) != "}" {
		return errInvalid("request body is not valid JSON")
	}
	if !model.Exists() {
		return errInvalid("model: field required")
	}
	if model.Type != gjson.String || model.Str == "" {
		return errInvalid("model: must be a non-empty string")
	}
	in.model = strings.Clone(model.Str)
	in.target = in.model
	in.modelStart, in.modelEnd = model.Index, model.Index+len(model.Raw)
	return nil
}

// sessionID names the request's session for sticky picks and canary
// splits: Claude Code's X-Claude-Code-Session-Id, else the session part of
// metadata.user_id (Claude Code's `user_<hash>_account_<id>_session_<id>`
// or its JSON form with session_id; any other user_id as a whole), else the
// key.
func (in *inbound) sessionID() string {
	if h := in.header.Get("X-Claude-Code-Session-Id"); h != "" {
		return h
	}
	if u := in.userID; u != "" {
		if i := strings.LastIndex(u, "_session_"); i >= 0 && i+len("_session_") < len(u) {
			return u[i+len("_session_"):]
		}
		if strings.HasPrefix(u, "{") {
			if sid := gjson.Get(u, "session_id").String(); sid != "" {
				return sid
			}
		}
		return u
	}
	return "key:" + in.key.name
}

// bodyFor returns the body to send to ch: the client's bytes, with the
// model's value replaced when the channel maps it to another name, or when
// a fallback model serves the request.
func (in *inbound) bodyFor(ch *channel) []byte {
	up := ch.upstreamModel(in.target)
	if up == in.model {
		return in.body
	}
	out := make([]byte, 0, len(in.body)+len(up)-len(in.model))
	out = append(out, in.body[:in.modelStart]...)
	out = append(out, '"')
	out = append(out, up...)
	out = append(out, '"')
	return append(out, in.body[in.modelEnd:]...)
}

// newRequestID returns the id that names a request in the x-relay-request-id
// header, the error bodies and the logs.
func newRequestID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	var out [6 + 24]byte
	copy(out[:], "relay_")
	hex.Encode(out[6:], b[:])
	return string(out[:])
}
