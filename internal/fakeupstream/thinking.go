package fakeupstream

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strings"

	"github.com/tidwall/gjson"
)

// Claude signs the thinking blocks of its answers for the account that
// made them, and refuses a conversation that sends back a block another
// account signed. A fake upstream with an Account does the same: the
// signatures it makes (Signature, RedactedData) are MACs under its
// account's secret, and before its handler sees a Messages request it
// refuses, with the real API's 400, one whose assistant messages carry a
// thinking block it did not sign.
//
// Every fake also holds a Messages body to the API's rules on thinking
// blocks that need no account (internal/apirules): no message but the
// final assistant one may have empty content, and while thinking is on,
// the final assistant message of a tool loop (one with a tool_use) starts
// with a thinking block.

// Account makes the upstream an account whose secret signs its thinking
// blocks, and verifies those it is sent back.
func Account(secret string) Option {
	return func(u *Upstream) { u.account = secret }
}

// Signature is the signature an account with secret gives a thinking
// block whose text is thinking.
func Signature(secret, thinking string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte("thinking\x00" + thinking))
	return "Eq" + base64.StdEncoding.EncodeToString(m.Sum(nil))
}

// RedactedData is the data of a redacted thinking block an account with
// secret made: a nonce and its MAC.
func RedactedData(secret, nonce string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte("redacted\x00" + nonce))
	return base64.StdEncoding.EncodeToString([]byte(nonce + "\x00" + string(m.Sum(nil))))
}

// redactedValid reports whether data is a redacted block secret made.
func redactedValid(secret, data string) bool {
	raw, err := base64.StdEncoding.DecodeString(data)
	if err != nil {
		return false
	}
	nonce, _, ok := strings.Cut(string(raw), "\x00")
	return ok && hmac.Equal([]byte(data), []byte(RedactedData(secret, nonce)))
}

// signed reports whether a thinking or redacted_thinking block is one the
// upstream's account signed: the apirules' Rules.Thinking of an upstream
// with an Account.
func (u *Upstream) signed(b gjson.Result) bool {
	if b.Get("type").Str == "redacted_thinking" {
		return redactedValid(u.account, b.Get("data").Str)
	}
	return hmac.Equal([]byte(b.Get("signature").Str), []byte(Signature(u.account, b.Get("thinking").Str)))
}

// ThinkingContent is the content of an answer with a thinking block
// signed for secret, then blocks (a text "ok" when none).
func ThinkingContent(secret, thinking string, blocks ...map[string]any) []map[string]any {
	if len(blocks) == 0 {
		blocks = []map[string]any{{"type": "text", "text": "ok"}}
	}
	return append([]map[string]any{{"type": "thinking", "thinking": thinking, "signature": Signature(secret, thinking)}}, blocks...)
}

// ThinkingMessage answers with a whole reply of a thinking block signed
// for secret, then blocks (a text "ok" when none), echoing the request's
// model.
func ThinkingMessage(secret, thinking string, blocks ...map[string]any) http.HandlerFunc {
	content := ThinkingContent(secret, thinking, blocks...)
	return func(w http.ResponseWriter, r *http.Request) {
		model := gjson.GetBytes(readAll(r), "model").Str
		stop := "end_turn"
		for _, b := range content {
			if b["type"] == "tool_use" {
				stop = "tool_use"
			}
		}
		body, _ := json.Marshal(map[string]any{
			"id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": content,
			"stop_reason": stop, "stop_sequence": nil, "usage": Usage{InputTokens: 10, OutputTokens: 20},
		})
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(body)
	}
}

// ThinkingStream answers with a stream of a thinking block signed for
// secret (its signature in a signature_delta, as the API sends it) and a
// text block.
func ThinkingStream(secret, thinking, text string) http.HandlerFunc {
	q := func(s string) string { b, _ := json.Marshal(s); return string(b) }
	evs := StreamEvents("claude-sonnet-4-5", Usage{InputTokens: 10, OutputTokens: 20}, text)
	// the text block becomes the second: its events' index is 1
	for i := range evs {
		evs[i] = strings.Replace(evs[i], `"index":0`, `"index":1`, 1)
	}
	think := []string{
		Event("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}`),
		Event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":`+q(thinking)+`}}`),
		Event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":`+q(Signature(secret, thinking))+`}}`),
		Event("content_block_stop", `{"type":"content_block_stop","index":0}`),
	}
	all := append(append([]string{evs[0]}, think...), evs[1:]...)
	return Stream(all...)
}

// readAll reads a request's body (the fake already read it once: this is
// its copy).
func readAll(r *http.Request) []byte {
	var b bytes.Buffer
	_, _ = b.ReadFrom(r.Body)
	return b.Bytes()
}
