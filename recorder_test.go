package relay

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// TestEveryAnswerLeavesByTheRecorder sends a request to each of the
// relay's exits: its own error before and after the body, the models
// list, an unknown route, an upstream's answer and its refusal, a
// resource list, and a Chat Completions answer and refusal (which the
// client gets later, translated, from the Chat Completions writer). The
// request's one log line says the status the client got, every time.
func TestEveryAnswerLeavesByTheRecorder(t *testing.T) {
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.Header.Get("User-Agent"), "refuse") {
			fakeupstream.Error(http.StatusBadRequest, "invalid_request_error", "messages: too short")(w, r)
			return
		}
		fakeupstream.Message("ok")(w, r)
	}))
	key := Key{Secret: "sk-exits-0123456789abcdef", Group: "exits", KeyOptions: KeyOptions{Name: "exits"}}
	ch := &Channel{Name: "exits-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	r := &Relay{Keys: []*Key{&key}, Channels: []*Channel{ch}, Groups: []*Group{{Name: "exits", Channels: []string{ch.Name}}}}
	logs := provisionHandler(t, r)
	const chat = `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	for _, c := range []struct {
		what, method, path, key, body, header string
	}{
		{"no key", http.MethodPost, "/v1/messages", "", simpleBody, ""},
		{"a body that is not JSON", http.MethodPost, "/v1/messages", key.Secret, "{", ""},
		{"the models list", http.MethodGet, "/v1/models", key.Secret, "", ""},
		{"an unknown route", http.MethodPost, "/v1/nothing", key.Secret, "{}", ""},
		{"an upstream's answer", http.MethodPost, "/v1/messages", key.Secret, simpleBody, ""},
		{"an upstream's refusal", http.MethodPost, "/v1/messages", key.Secret, simpleBody, "refuse"},
		{"a chat completion", http.MethodPost, PathChatCompletions, key.Secret, chat, ""},
		{"a chat completion refused", http.MethodPost, PathChatCompletions, key.Secret, chat, "refuse"},
	} {
		logs.TakeAll()
		req := httptest.NewRequest(c.method, c.path, strings.NewReader(c.body))
		req.Header.Set("Content-Type", "application/json")
		if c.key != "" {
			req.Header.Set("X-Api-Key", c.key)
		}
		if c.header != "" {
			req.Header.Set("User-Agent", c.header)
		}
		w, _ := serveHandler(t, r, req)
		lines := logs.FilterMessage("relayed request").All()
		if len(lines) != 1 {
			t.Errorf("%s: %d log lines", c.what, len(lines))
			continue
		}
		if got := lines[0].ContextMap()["status"]; got != int64(w.Code) {
			t.Errorf("%s: the client got %d, the log line says %v", c.what, w.Code, got)
		}
	}
}
