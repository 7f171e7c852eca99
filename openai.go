package relay

import (
	"bytes"
	"net/http"
	"strconv"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/openai"
)

// PathChatCompletions is OpenAI's Chat Completions route. The relay
// translates its requests into Messages requests up front, relays them as
// any other message (same selection, limits, failover, commit point and
// accounting), and translates the answer back as it is written
// (chatWriter, a ResponseWriter only that route goes through). The
// translation both ways is internal/openai's.
const PathChatCompletions = "/v1/chat/completions"

// chat is what the relay keeps of a Chat Completions request for writing
// its answer in OpenAI's shape.
type chat struct {
	includeUsage bool   // stream_options.include_usage
	param        string // the parameter a refused request got wrong
}

// translateChat replaces the request's Chat Completions body by its
// Messages translation, in a pooled buffer of its own. A request that
// sets no max_tokens asks a model the pricing table knows for its maximum
// output, which is also what the request holds against its budgets.
func (in *inbound) translateChat() *relayError {
	buf := bodyPool.Get().(*bytes.Buffer)
	c, perr := openai.TranslateChat(buf, in.ask.body, money.MaxOutputTokens)
	if perr != nil {
		releaseBody(buf)
		in.ask.chat.param = perr.Param
		return errInvalid(perr.Msg)
	}
	*in.ask.chat = chat{includeUsage: c.IncludeUsage}
	in.releaseBody()
	in.bodyBuf, in.ask.body = buf, buf.Bytes()
	return nil
}

// chatParam is the parameter a refused Chat Completions request got wrong.
func (in *inbound) chatParam() string {
	if in.ask.chat == nil {
		return ""
	}
	return in.ask.chat.param
}

// chatWriter writes the answer of a Chat Completions request in OpenAI's
// shape. The relay serves the request as a message and writes Anthropic's
// wire to it (a message, an event stream, an error); it translates what it
// is given (internal/openai). Only Chat Completions requests go through
// it, so the Messages path pays nothing for it.
//
// A non-streaming answer or an error is held until finish, which writes it
// whole; an event stream is translated event by event as the relay writes
// and flushes it, so the commit point and flushing stay the relay's.
type chatWriter struct {
	w      http.ResponseWriter
	in     *inbound
	status int // 0 until WriteHeader
	stream bool
	held   bytes.Buffer // a non-streaming body, until finish
	chunks openai.Chunks
}

// newChatWriter returns the writer of in's answer, in OpenAI's shape, to w.
func newChatWriter(w http.ResponseWriter, in *inbound) *chatWriter {
	cw := &chatWriter{w: w, in: in}
	cw.chunks = openai.Chunks{Created: in.start.Unix(), MaxEvent: maxEvent, StatusOf: statusOfType}
	return cw
}

// Header implements http.ResponseWriter.
func (cw *chatWriter) Header() http.Header { return cw.w.Header() }

// Unwrap lets http.ResponseController reach the connection (read
// deadlines).
func (cw *chatWriter) Unwrap() http.ResponseWriter { return cw.w }

// WriteHeader implements http.ResponseWriter: a successful event stream
// starts at once, anything else waits for its body.
func (cw *chatWriter) WriteHeader(status int) {
	if cw.status != 0 {
		return
	}
	cw.status = status
	if status >= 200 && status < 300 && isEventStream(cw.w.Header()) {
		cw.stream = true
		cw.w.Header().Del("Content-Length")
		cw.w.WriteHeader(status)
	}
}

// Write implements http.ResponseWriter.
func (cw *chatWriter) Write(p []byte) (int, error) {
	if cw.status == 0 {
		cw.WriteHeader(http.StatusOK)
	}
	if !cw.stream {
		return cw.held.Write(p)
	}
	if err := cw.translateEvents(p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// FlushError flushes a stream (http.ResponseController calls it); a held
// answer waits for finish.
func (cw *chatWriter) FlushError() error {
	if !cw.stream {
		return nil
	}
	return http.NewResponseController(cw.w).Flush()
}

// finish writes a held answer: a message as a chat.completion, an error in
// OpenAI's error shape.
func (cw *chatWriter) finish() {
	if cw.stream || cw.status == 0 {
		return
	}
	var body []byte
	if cw.status >= 200 && cw.status < 300 {
		body = openai.Completion(cw.held.Bytes(), cw.chunks.Created, cw.in.grant.target, chatUsage(cw.in.end.usage))
	} else {
		body = openai.ErrorBody(cw.status, cw.held.Bytes(), cw.in.chatParam())
	}
	h := cw.w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	cw.w.WriteHeader(cw.status)
	_, _ = cw.w.Write(body)
}

// translateEvents translates whole Anthropic events (the relay writes
// events whole: the held ones at the commit point, then one at a time)
// into chat.completion.chunk events, with the request's model and usage
// as they stand.
func (cw *chatWriter) translateEvents(p []byte) error {
	cw.chunks.Model, cw.chunks.IncludeUsage, cw.chunks.Usage = cw.in.grant.target, cw.in.ask.chat.includeUsage, chatUsage(cw.in.end.usage)
	out := cw.chunks.Translate(p)
	if len(out) == 0 {
		return nil
	}
	_, err := cw.w.Write(out)
	return err
}

// chatUsage is the usage the relay counted, as OpenAI's answers give it:
// every input token is a prompt token, cache reads are its cached tokens.
func chatUsage(u usage) openai.Usage {
	return openai.Usage{Prompt: u.prompt(), Completion: u.output, CacheRead: u.cacheRead}
}

// statusOfType is the status Anthropic answers an error type with, for an
// error that comes without one (in a stream).
func statusOfType(typ string) int {
	for _, c := range classes {
		if c.typ == typ {
			return c.status
		}
	}
	return http.StatusInternalServerError
}
