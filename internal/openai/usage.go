package openai

import (
	"strconv"

	"github.com/tidwall/gjson"
)

// Usage is a message's token counts as the relay counted them, for an
// answer in OpenAI's terms.
type Usage struct {
	Prompt     int64 // every input token, cached or not
	Completion int64 // output tokens
	CacheRead  int64 // input tokens read from the prompt cache
}

// chat is u in OpenAI's terms: every input token is a prompt token, cache
// reads are its cached tokens.
func (u Usage) chat() chatUsage {
	var c chatUsage
	c.PromptTokens = u.Prompt
	c.CompletionTokens = u.Completion
	c.TotalTokens = c.PromptTokens + c.CompletionTokens
	c.PromptTokensDetails.CachedTokens = u.CacheRead
	return c
}

// msgUsage renders a chat completion's usage as Messages': cached prompt
// tokens are cache reads, the rest input.
func msgUsage(u gjson.Result) []byte {
	prompt, cached := u.Get("prompt_tokens").Int(), u.Get("prompt_tokens_details.cached_tokens").Int()
	b := []byte(`{"input_tokens":`)
	b = strconv.AppendInt(b, max(prompt-cached, 0), 10)
	b = append(b, `,"cache_creation_input_tokens":0,"cache_read_input_tokens":`...)
	b = strconv.AppendInt(b, cached, 10)
	b = append(b, `,"output_tokens":`...)
	b = strconv.AppendInt(b, u.Get("completion_tokens").Int(), 10)
	return append(b, '}')
}
