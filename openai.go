package relay

import (
	"bytes"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/openai"
)

// PathChatCompletions is OpenAI's Chat Completions route. The relay
// translates its requests into Messages requests up front, relays them as
// any other message (same selection, limits, failover, commit point and
// accounting), and translates the answer back as it is written
// (openai_answer.go). The translation both ways is internal/openai's.
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
