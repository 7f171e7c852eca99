package providertest

import (
	"io"
	"net/http"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// ChatReply is an OpenAI-format server's chat.completion of "Hello there",
// of 12 prompt tokens (4 of them cached) and 3 completion tokens.
const ChatReply = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"claude-upstream","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],` +
	`"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":4}}}`

// ChatAnswer answers as an OpenAI-format server: a chat.completion.
func ChatAnswer(body string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, body)
	}
}

// ChatChunks answers as an OpenAI-format server streaming: each chunk a
// data line, then [DONE].
func ChatChunks(chunks ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		for _, c := range append(chunks, "[DONE]") {
			if !fakeupstream.WriteEvent(w, "data: "+c+"\n\n") {
				return
			}
		}
	}
}
