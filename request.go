package relay

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/http/httptrace"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/caddy-relay/relay/provider"
	"github.com/go-json-experiment/json/jsontext"
	"github.com/tidwall/gjson"
)

// route is an endpoint the relay serves.
type route uint8

const (
	routeMessages route = iota + 1
	routeCountTokens
	routeModels
	routeModel    // GET /v1/models/{id}
	routeResource // the Message Batches and Files APIs (resources.go)
	routeCount
)

// upstreamPath is the path a relayed route takes upstream; empty for the
// routes the relay answers itself.
func (rt route) upstreamPath() string {
	switch rt {
	case routeMessages:
		return provider.PathMessages
	case routeCountTokens:
		return provider.PathCountTokens
	}
	return ""
}

// routeByPath returns the relayed route of a path, or 0.
func routeByPath(p string) route {
	switch p {
	case provider.PathMessages:
		return routeMessages
	case provider.PathCountTokens:
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
	case p == PathChatCompletions:
		rt = routeMessages // translated to a message (openai.go)
	case p == "/v1/models":
		rt = routeModels
	case strings.HasPrefix(p, "/v1/models/") && len(p) > len("/v1/models/") && !strings.Contains(p[len("/v1/models/"):], "/"):
		rt = routeModel
	case isResourcePath(p):
		return routeResource, nil // its methods are checked with its operation
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

// maxBodyReserve bounds what a request's declared Content-Length reserves
// before its bytes arrive; the buffer grows with what really comes.
const maxBodyReserve = 64 << 10

// readBody reads the whole request body, at most max_body_size bytes and
// within read_body_timeout, into a pooled buffer that serves every attempt.
// The caller releases it.
func (r *Relay) readBody(w http.ResponseWriter, req *http.Request) (*bytes.Buffer, *relayError) {
	limit, timeout := r.MaxBodySize, time.Duration(r.ReadBodyTimeout)
	if req.ContentLength > limit {
		return nil, errTooLarge(limit)
	}
	// the connection's read deadline bounds a client that sends slowly; it
	// is lifted afterwards, or the server's background read of an idle
	// connection would cancel a long stream. (Where the connection has no
	// deadline to set, as over HTTP/3, Caddy's own timeouts apply.)
	rc := http.NewResponseController(w)
	if rc.SetReadDeadline(time.Now().Add(timeout)) == nil {
		defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
	}
	buf := bodyPool.Get().(*bytes.Buffer)
	if req.ContentLength > 0 {
		buf.Grow(int(min(req.ContentLength, maxBodyReserve)))
	}
	_, err := buf.ReadFrom(io.LimitReader(req.Body, limit+1))
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		releaseBody(buf)
		return nil, errBodyTimeout(timeout)
	case err != nil:
		releaseBody(buf)
		return nil, errInvalid("could not read the request body: " + err.Error())
	case int64(buf.Len()) > limit:
		releaseBody(buf)
		return nil, errTooLarge(limit)
	}
	// read to its end: closed now, net/http knows it has nothing left to
	// discard when the response's headers go out, and does not look (a read
	// deep in the stack of a stream's first flush, which would grow the
	// goroutine's stack for as long as the stream lasts)
	_ = req.Body.Close()
	return buf, nil
}

// inbound is one client request: what the relay knows of it, and what it
// came to, for the account step (log line, metrics, placeholders). Its state
// is grouped by the step that writes it: who asks (auth), what was asked
// (body and inspect), what was granted (admit and select), how it ended
// (attempt, stream and account); the rest is the plumbing of the attempt in
// flight.
type inbound struct {
	who   requester
	ask   asked
	grant granted
	end   ending

	id    string
	route route
	start time.Time
	rec   answerRecorder // the one exit its answer leaves by (recorder.go)

	call     provider.Call // the current attempt's, for its provider
	strip    featureSet    // the features the current attempt's channel removes
	triedBuf [4]*channel
	chainBuf [4]attemptRecord
	bodyBuf  *bytes.Buffer // the pooled buffer behind body; nil once released
	// writing counts the upstream requests whose transport may still read
	// body: net/http may write a request body even after RoundTrip returned,
	// until its WroteRequest trace says it is done.
	writing atomic.Int32
	// left is when the client left, in Unix nanoseconds; 0: it has not, as
	// far as the relay knows (settle.go)
	left atomic.Int64
}

// requester is who asks: the key (or identity) a request is served as, set
// by the auth step and read by all the others.
type requester struct {
	key *key // the key or user entry it is served as
	// stateID names the request's principal, where state per principal
	// (limits, and whatever else is kept per key) is kept: a key's name,
	// or user:<id> for an identity (for user *, the identity itself, where
	// key is the * entry). state is that state.
	stateID string
	state   *keyState
}

// asked is what the client asked for, as the body and inspect steps read
// it; nothing after them writes it.
type asked struct {
	rawQuery string
	header   http.Header
	body     []byte // the client's body, unchanged; backed by a pooled buffer
	model    string // as the client asked
	userID   string // metadata.user_id, for sticky sessions
	stream   bool
	maxOut   int32 // the body's max_tokens; 0: none, or not a whole number that fits
	chat     *chat // a Chat Completions request, translated; nil for Anthropic's routes
	needs    needs // the features it carries
	// modelStart and modelEnd delimit the raw model value (quotes included)
	// in body, so a mapped name is spliced in without re-encoding the JSON.
	modelStart, modelEnd int
	estimate             int64 // input tokens guessed from the body, for the token limits
}

// granted is what the admit and select steps gave the request: its limits'
// grants and budget holds, the model it is served and the channels that may
// serve it.
type granted struct {
	target       string    // the model being served: model, or a fallback of it
	fallbacks    int       // fallback models tried so far
	sel          selection // its channels, as the relay picks them
	keyGrant     grant     // what the key's limits admitted
	keyAsked     bool      // the key's limits were asked (admitted or refused): its rate limit headers are known
	endUser      *limiter  // its end user's limits (user_rate, user_tokens) that admitted it; nil: none
	endUserGrant grant     // what they admitted
	// endUserPending, in a fleet, is the end user's limiter to admit along
	// with the first channel, charged endUserEstimate tokens
	endUserPending  *limiter
	endUserEstimate int64
	holds           *holds  // its worst case held against its budgets (hold.go); nil: none
	worst           nanoUSD // its worst case, when a budget or a channel's spend cap may apply
	// pinned, for a message that references files, is its group with only
	// the channel that holds them
	pinned *group
}

// ending is how the request ended, written by the attempt, stream and
// account steps; zero until they run.
type ending struct {
	status     int           // sent to the client; 0 until then
	cause      string        // of a failure's answer, for the cause label; "" until then
	errCode    string        // of the relay's own error answer: its error.code, else its type; "" none
	attempts   int           // made so far
	answered   *channel      // the channel whose answer the client got
	firstByte  time.Duration // until the client's response headers
	chain      []attemptRecord
	usage      usage
	incomplete bool    // the answer did not complete: tokens are the ones seen
	estimated  bool    // its output is an estimate: its client left, and the final count never came (settle.go)
	cost       float64 // in USD: list price x price_factor of the channel that answered; set by account (price)
	wasted     int64   // input tokens of attempts abandoned on the way (relay_wasted_tokens_total)
	shared     string  // what answered it instead of an upstream (dedup.go); "": none
}

// group is the group whose channels serve the request: its key's, or only
// the channel that holds the files it references (pinned).
func (in *inbound) group() *group {
	if in.grant.pinned != nil {
		return in.grant.pinned
	}
	return in.who.key.group
}

// billed is what the request used against token limits.
func (in *inbound) billed() int64 { return billedTokens(in.end.usage) }

// releaseBody lets go of the body's buffer, once: back to its pool when no
// transport can still read it, else to the garbage collector.
func (in *inbound) releaseBody() {
	if in.bodyBuf == nil {
		return
	}
	if in.writing.Load() == 0 {
		releaseBody(in.bodyBuf)
	}
	in.bodyBuf, in.ask.body = nil, nil
}

// Body implements provider.Source: the client's body with model in place
// of its own, without the features the current attempt's channel strips.
// When nothing changes it is the pooled buffer itself, not a copy.
func (in *inbound) Body(model string) []byte {
	if model == in.ask.model && in.strip == 0 {
		return in.ask.body
	}
	out := in.ask.body
	if model != in.ask.model {
		out = make([]byte, 0, len(in.ask.body)+len(model)-len(in.ask.model))
		out = append(out, in.ask.body[:in.ask.modelStart]...)
		out = append(out, '"')
		out = append(out, model...)
		out = append(out, '"')
		out = append(out, in.ask.body[in.ask.modelEnd:]...)
	}
	if in.strip != 0 {
		// the body is valid JSON (inspect checked): this cannot fail
		if stripped, err := stripBody(out, in.strip); err == nil {
			out = stripped
		}
	}
	return out
}

// NewRequest implements provider.Source: an upstream request with body b,
// which may share the client body's pooled buffer: the request then traces
// when the transport is done writing it, which releaseBody waits for. The
// body stays a *bytes.Reader, which net/http writes best.
func (in *inbound) NewRequest(ctx context.Context, method, url string, b []byte) (*http.Request, error) {
	getBody := func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }
	shared := len(b) > 0 && len(in.ask.body) > 0 && &b[0] == &in.ask.body[0] // else a copy (a mapped model): nothing shared
	if shared {
		ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{WroteRequest: in.wrote})
	}
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(b))
	if err != nil {
		return nil, err
	}
	req.GetBody = getBody
	if shared {
		in.writing.Add(1)
		req.GetBody = func() (io.ReadCloser, error) {
			in.writing.Add(1) // a retry of the write, on a new connection
			return getBody()
		}
	}
	return req, nil
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

// committed records that ch's answer is going to the client (its status
// and first byte are the recorder's to see).
func (in *inbound) committed(ch *channel) { in.end.answered = ch }

// scanners pools the strict JSON scanners of request bodies, which keep
// the buffers they grew (internal/jsonscan).
var scanners = sync.Pool{New: func() any { return new(jsonscan.Scanner) }}

// maxModelLen bounds a model name: the longest real ids (Bedrock inference
// profile ARNs) are about 100 characters.
const maxModelLen = 256

// inspect reads the fields routing needs in one strict pass over the body:
// model, stream, metadata.user_id and the features it needs (the feature
// fields, the types of its tools; and its anthropic-beta values and
// whether its prompt needs a long context). The body must
// be exactly one valid JSON object, with no data after it and no key twice
// in any object: a parser that kept the first of two "model" keys, or read
// only the first of two objects, would otherwise serve another model than
// the one the relay routed and priced. Values the relay does not read are
// validated and skipped, never decoded. The scan is internal/jsonscan's,
// which accepts exactly what jsontext accepts, eight bytes a step.
func (in *inbound) inspect() *relayError {
	sc := scanners.Get().(*jsonscan.Scanner)
	defer func() {
		sc.Reset(nil) // no reference to the pooled body stays
		scanners.Put(sc)
	}()
	sc.Reset(in.ask.body)

	if k := sc.PeekKind(); k != '{' && k != 0 { // 0: not JSON, which ReadObjectStart says
		return errInvalid("request body must be a JSON object")
	}
	if err := sc.ReadObjectStart(); err != nil {
		return errBodyJSON(err)
	}
	var model []byte
	for {
		name, err := sc.NextName()
		if err != nil {
			return errBodyJSON(err)
		}
		if name == nil { // the closing brace
			break
		}
		field := unquoteJSON(name)
		switch k := sc.PeekKind(); {
		case field == "tools" && k == '[':
			if err := in.scanTools(sc); err != nil {
				return errBodyJSON(err)
			}
		case field == "metadata" && k == '{':
			if err := in.scanMetadata(sc); err != nil {
				return errBodyJSON(err)
			}
		default:
			if rerr := in.readField(sc, field, &model); rerr != nil {
				return rerr
			}
		}
	}
	if err := sc.End(); err != nil {
		if errors.Is(err, jsonscan.ErrSyntax) {
			return errInvalid("request body is not valid JSON: data after the top-level object")
		}
		return errBodyJSON(err)
	}

	if model == nil {
		return errInvalid("model: field required")
	}
	if jsonscan.KindOf(model) != '"' || len(model) == 2 {
		return errInvalid("model: must be a non-empty string")
	}
	name := unquoteJSON(model) // valid: the scan checked it
	if msg := modelIDProblem(name); msg != "" {
		return errInvalid("model: " + msg)
	}
	in.ask.model = strings.Clone(name)
	in.grant.target = in.ask.model
	if in.route == routeMessages && estimateTokens(in.ask.body) > longContextTokens {
		in.ask.needs.set |= featLongContext
	}
	if _, ok := in.ask.header["Anthropic-Beta"]; ok {
		in.ask.needs.betas = make([]string, 0, 4)
		if !in.ask.needs.readBetas(in.ask.header) {
			return errInvalid("anthropic-beta: more than " + strconv.Itoa(maxBetas) + " values")
		}
	}
	return nil
}

// readField reads the value of the top-level field, noting what the relay
// routes on: the raw model (into model, with its offsets), stream,
// max_tokens and the feature fields; a body anthropic_beta is refused.
func (in *inbound) readField(sc *jsonscan.Scanner, field string, model *[]byte) *relayError {
	v, err := sc.ReadValue()
	if err != nil {
		return errBodyJSON(err)
	}
	switch field {
	case "model":
		*model = v
		in.ask.modelEnd = sc.InputOffset()
		in.ask.modelStart = in.ask.modelEnd - len(v)
	case "stream":
		in.ask.stream = jsonscan.KindOf(v) == 't'
	case "max_tokens":
		if jsonscan.KindOf(v) == '0' {
			n, _ := strconv.ParseInt(unsafe.String(unsafe.SliceData(v), len(v)), 10, 32)
			in.ask.maxOut = int32(n)
		}
	case "anthropic_beta":
		return errInvalid("anthropic_beta: betas go in the anthropic-beta header, which the relay routes on")
	default:
		if f := fieldFeature(field); f != 0 && jsonscan.KindOf(v) != 'n' {
			in.ask.needs.set |= f
		}
	}
	return nil
}

// scanMetadata reads a `metadata` object for its user_id, a string: the
// same strict pass, one level deeper.
func (in *inbound) scanMetadata(sc *jsonscan.Scanner) error {
	if err := sc.ReadObjectStart(); err != nil {
		return err
	}
	for {
		name, err := sc.NextName()
		if err != nil || name == nil {
			return err
		}
		v, err := sc.ReadValue()
		if err != nil {
			return err
		}
		if jsonscan.KindOf(v) == '"' && unquoteJSON(name) == "user_id" {
			in.ask.userID = strings.Clone(unquoteJSON(v))
		}
	}
}

// scanTools reads a `tools` array, noting the server tools among them by
// the type of each: the same strict pass, one level deeper.
func (in *inbound) scanTools(sc *jsonscan.Scanner) error {
	if err := sc.ReadArrayStart(); err != nil {
		return err
	}
	for {
		more, err := sc.NextElement()
		if err != nil || !more {
			return err
		}
		if sc.PeekKind() != '{' {
			if _, err := sc.ReadValue(); err != nil {
				return err
			}
			continue
		}
		if err := sc.ReadObjectStart(); err != nil {
			return err
		}
		for {
			name, err := sc.NextName()
			if err != nil {
				return err
			}
			if name == nil {
				break
			}
			v, err := sc.ReadValue()
			if err != nil {
				return err
			}
			if jsonscan.KindOf(v) == '"' && unquoteJSON(name) == "type" {
				in.ask.needs.set |= toolFeature(unquoteJSON(v))
			}
		}
	}
}

// unquoteJSON is the string a raw JSON string holds: shared with the body
// when it has no escape sequence (compare it, never keep it), decoded
// when it has. The string must be valid (the scan checked it).
func unquoteJSON(raw []byte) string {
	if s := fieldName(raw); s != "" || len(raw) == 2 {
		return s
	}
	return string(jsonscan.AppendUnquote(nil, raw))
}

// fieldName is the name a raw JSON object key holds when it has no escape
// sequence, else "". It shares the body's memory: compare it, never keep
// it.
func fieldName(raw []byte) string {
	inner := raw[1 : len(raw)-1]
	if bytes.IndexByte(inner, '\\') >= 0 {
		return ""
	}
	return unsafe.String(unsafe.SliceData(inner), len(inner))
}

// errBodyJSON answers a body the strict scan refused (internal/jsonscan's,
// or jsontext's where a route still decodes with it), saying where and why
// without echoing more of the body than a short key.
func errBodyJSON(err error) *relayError {
	if err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF) {
		return errInvalid("request body is not valid JSON: it ends before the object does")
	}
	var key, pointer string
	var offset int64
	var se *jsonscan.Error
	var jse *jsontext.SyntacticError
	switch {
	case errors.As(err, &se):
		key, pointer, offset = se.Name, se.Pointer, int64(se.Offset)
		if !errors.Is(se.Err, jsonscan.ErrDuplicateName) {
			pointer = ""
		}
	case errors.As(err, &jse):
		offset = jse.ByteOffset
		if errors.Is(jse.Err, jsontext.ErrDuplicateName) {
			key, pointer = jse.JSONPointer.LastToken(), string(jse.JSONPointer)
		}
	default:
		return errInvalid("request body is not valid JSON")
	}
	if pointer != "" {
		if len(key) > 64 {
			key = key[:64] + "..."
		}
		return errInvalid("request body is not valid JSON: duplicate key " + strconv.Quote(key) + " at " + strconv.Quote(pointer[:min(len(pointer), 128)]))
	}
	return errInvalid("request body is not valid JSON: error at byte offset " + strconv.FormatInt(offset, 10))
}

// modelIDProblem says why s cannot be a model id, or "" when it can be:
// ids are at most maxModelLen characters among letters, digits and -._:@/
// (Anthropic's names, Bedrock's ids and ARNs, Vertex's name@version), with
// no "." or ".." path segment, since providers put the id in a URL path.
func modelIDProblem(s string) string {
	switch {
	case s == "":
		return "must be a non-empty string"
	case len(s) > maxModelLen:
		return "longer than " + strconv.Itoa(maxModelLen) + " characters; not a model id"
	case !validModelName(s):
		return "not a model id: only letters, digits and - . _ : @ / may appear"
	}
	for seg := range strings.SplitSeq(s, "/") {
		if seg == "." || seg == ".." {
			return "not a model id: it has a \".\" or \"..\" path segment"
		}
	}
	return ""
}

// sessionID names the request's session for sticky picks and canary
// splits: Claude Code's X-Claude-Code-Session-Id, else the session part of
// metadata.user_id (Claude Code's `user_<hash>_account_<id>_session_<id>`
// or its JSON form with session_id; any other user_id as a whole), else the
// principal (the key, or the identity).
func (in *inbound) sessionID() string {
	if h := in.ask.header.Get("X-Claude-Code-Session-Id"); h != "" {
		return h
	}
	if u := in.ask.userID; u != "" {
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
	return "key:" + in.who.stateID
}

// callFor is the Call of an attempt of the request on ch: the request as
// the channel's provider sees it. One Call serves the request's attempts in
// turn.
func (in *inbound) callFor(ch *channel) *provider.Call {
	in.call = provider.NewCall(provider.Call{Channel: ch.name, Path: in.route.upstreamPath(), RawQuery: in.ask.rawQuery, Header: in.ask.header,
		Model: ch.upstreamModel(in.grant.target), Stream: in.ask.stream}, in)
	in.strip = 0
	if !in.ask.needs.empty() {
		set, betas := ch.stripFor(&in.ask.needs, in.grant.sel.now)
		in.strip = set
		if len(betas) > 0 {
			in.call.Header = stripBetas(in.ask.header, betas)
		}
	}
	return &in.call
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
