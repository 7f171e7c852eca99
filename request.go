package relay

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/provider"
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
	routeUsage    // GET /v1/relay/usage (self_usage.go)
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
	case p == PathRelayUsage:
		rt = routeUsage
	case strings.HasPrefix(p, "/v1/models/") && len(p) > len("/v1/models/") && !strings.Contains(p[len("/v1/models/"):], "/"):
		rt = routeModel
	case isResourcePath(p):
		return routeResource, nil // its methods are checked with its operation
	default:
		return 0, errNotFound(p)
	}
	want := http.MethodPost
	if rt == routeModels || rt == routeModel || rt == routeUsage {
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
		return nil, errTooLarge("max_body_size", limit)
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
		return nil, errTooLarge("max_body_size", limit)
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
	who   requester  // who asks: the auth step's
	ask   asked      // what was asked: the body and inspect steps'
	grant granted    // what the admit and select steps gave it
	try   attempting // its current attempt: the attempt step's (attempt.go)
	end   ending     // how it ended: written through ending.go's methods

	id    string
	route route
	start time.Time
	rec   answerRecorder // the one exit its answer leaves by (recorder.go)
	tr    *spans         // its spans, with Caddy's tracing on; nil: none (trace.go)

	triedBuf [4]*channel
	chainBuf [4]attemptRecord
	bodyBuf  *bytes.Buffer // the pooled buffer behind body; nil once released
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
	// searches is what its web search tools may search, which it holds
	// (internal/money's servertools.go)
	searches int64
	chat     *chat          // a Chat Completions request, translated; nil for Anthropic's routes
	needs    features.Needs // the features it carries
	// modelStart and modelEnd delimit the raw model value (quotes included)
	// in body, so a mapped name is spliced in without re-encoding the JSON.
	modelStart, modelEnd int
	estimate             int64        // input tokens guessed from the body, for the token limits
	prefix               *cachePrefix // its prompt's cache breakpoints (affinity.go); nil: none

	// thinking is whether it asks for thinking, and who signed the
	// thinking blocks it carries (thinking.go)
	thinking thinkingAsk

	// loop is the digest of the (tool call, tool result) pair the
	// conversation ends with, read when a loop guard applies (session_loop.go);
	// 0: none
	loop uint64
}

// granted is what the admit and select steps gave the request: its limits'
// grants and budget holds, the model it is served and the channels that may
// serve it.
type granted struct {
	target       string          // the model being served: model, or a fallback of it
	fallbacks    int             // fallback models tried so far
	sel          selection       // its channels, as the relay picks them
	keyGrant     limits.Grant    // what the key's limits admitted
	keyAsked     bool            // the key's limits were asked (admitted or refused): its rate limit headers are known
	endUser      *limits.Limiter // its end user's limits (user_rate, user_tokens) that admitted it; nil: none
	endUserGrant limits.Grant    // what they admitted
	// endUserPending, in a fleet, is the end user's limiter to admit along
	// with the first channel, charged endUserEstimate tokens
	endUserPending  *limits.Limiter
	endUserEstimate int64
	holds           *money.Holds  // its worst case held against its budgets (holds.go); nil: none
	worst           money.NanoUSD // its worst case, when a budget or a channel's spend cap may apply
	// capOf is the channel whose spend cap holds is against (the last of
	// them): a settled hold wakes the requests of every group waiting for
	// room on it; nil: none
	capOf *channel
	// counted says that a budget or a channel's spend cap applies to it:
	// a model the price table does not know costs its estimate
	counted bool
	// pinned, for a message that references files, is its group with only
	// the channel that holds them
	pinned *group
	// pinnedBody is the body the pinned channel gets: the asked body with
	// its upstream's file ids; nil body: the asked body goes as it is
	pinnedBody pinnedBody
	// session is its agent session, when its key has session limits
	// (sessions.go); nil: none. sessionLimits admitted it to session_rate
	// with sessionGrant.
	session       *session
	sessionLimits *limits.Limiter
	sessionGrant  limits.Grant
	// degrade is what budget_degrade did to it (degrade.go)
	degrade degraded
}

// pinnedBody is a body rewritten for the channel it is pinned to, and where
// its model is.
type pinnedBody struct {
	body                 []byte
	modelStart, modelEnd int
}

// outBody is the body the request's channels get and where its model is:
// the asked body, or, pinned to the channel that holds its files, the body
// with that channel's file ids.
func (in *inbound) outBody() (body []byte, modelStart, modelEnd int) {
	if p := &in.grant.pinnedBody; p.body != nil {
		return p.body, p.modelStart, p.modelEnd
	}
	return in.ask.body, in.ask.modelStart, in.ask.modelEnd
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
	if in.try.writing.Load() == 0 {
		releaseBody(in.bodyBuf)
	}
	in.bodyBuf, in.ask.body = nil, nil
}

// attemptRecord is one link of a request's attempt chain.
type attemptRecord struct {
	channel  string
	outcome  outcome
	duration time.Duration
}

// committed records that ch's answer is going to the client (its status
// and first byte are the recorder's to see).
func (in *inbound) committed(ch *channel) { in.end.committed(ch) }

// sessionID names the request's session for sticky picks and canary
// splits: Claude Code's X-Claude-Code-Session-Id, else the session part of
// metadata.user_id (Claude Code's `user_<hash>_account_<id>_session_<id>`
// or its JSON form with session_id; any other user_id as a whole), else the
// principal (the key, or the identity).
func (in *inbound) sessionID() string {
	if sid := in.agentSession(); sid != "" {
		return sid
	}
	if u := in.ask.userID; u != "" {
		return u
	}
	return "key:" + in.who.stateID
}

// jsonSessionID is the session_id of the JSON form of metadata.user_id;
// "" for none.
func jsonSessionID(u string) string { return gjson.Get(u, "session_id").String() }

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

// estimateTokens guesses the input tokens of a request from its body
// before the upstream says: about 4 bytes a token. The guess is corrected
// with the real usage when the answer ends.
func estimateTokens(body []byte) int64 { return int64(len(body)/4) + 1 }

// billedTokens is what a request costs against a token limit: input, cache
// writes and output, as Anthropic counts its own rate limits (cache reads do
// not count).
func billedTokens(u usage) int64 { return u.input + u.cacheWrite + u.output }
