package relay

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// The end-to-end tests of thinking signatures: fake upstreams that are
// accounts of their own (fakeupstream.Account) sign the thinking blocks
// they answer with and refuse, as the real API does, a block another
// account signed, which fails the test.

// thinkingBody is a Messages body with thinking on and these messages.
func thinkingBody(messages ...string) string {
	return `{"model":"claude-sonnet-4-5","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[` + strings.Join(messages, ",") + `]}`
}

const (
	hiUser   = `{"role":"user","content":"Hi"}`
	nextUser = `{"role":"user","content":"And then?"}`
)

// signedTurn is an assistant turn with a thinking block signed for
// secret, then blocks.
func signedTurn(secret, thinking string, blocks ...string) string {
	th, _ := json.Marshal(map[string]string{"type": "thinking", "thinking": thinking, "signature": fakeupstream.Signature(secret, thinking)})
	return `{"role":"assistant","content":[` + strings.Join(append([]string{string(th)}, blocks...), ",") + `]}`
}

// assistantTurn is the assistant turn of a whole answer, as a client
// sends it back.
func assistantTurn(t *testing.T, r reply) string {
	t.Helper()
	var m struct {
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(r.body, &m); err != nil || r.status != 200 {
		t.Fatalf("answer %d: %s", r.status, r.body)
	}
	return `{"role":"assistant","content":` + string(m.Content) + `}`
}

func TestThinkingFailsOverWithinItsDomain(t *testing.T) {
	const secretA, secretB = "org-a-secret", "org-b-secret"
	a1 := fakeupstream.New(t, fakeupstream.ThinkingMessage(secretA, "let me plan"), fakeupstream.Account(secretA))
	b1 := fakeupstream.New(t, fakeupstream.Message("ok"), fakeupstream.Account(secretB))
	a2 := fakeupstream.New(t, fakeupstream.Message("ok"), fakeupstream.Account(secretA))
	startRelay(t, channelBlock("th-a1", a1.URL, "signature_domain org-a", "priority 1")+
		channelBlock("th-b1", b1.URL, "priority 2")+
		channelBlock("th-a2", a2.URL, "signature_domain org-a", "priority 3")+
		keyAndGroup("th-g", "th-a1 th-b1 th-a2"))

	first := message(t, thinkingBody(hiUser))
	if a1.Hits() != 1 {
		t.Fatalf("the first turn went elsewhere: a1 %d b1 %d a2 %d", a1.Hits(), b1.Hits(), a2.Hits())
	}
	// org-a's first channel fails: the session goes to its second one, not
	// to the better tier of another account, whose upstream would refuse
	// the signature
	a1.SetHandler(fakeupstream.Error(500, "api_error", "down"))
	r := message(t, thinkingBody(hiUser, assistantTurn(t, first), nextUser))
	if r.status != 200 || a2.Hits() != 1 || b1.Hits() != 0 {
		t.Fatalf("status %d, a2 %d b1 %d hits; body %s", r.status, a2.Hits(), b1.Hits(), r.body)
	}
	if got := string(a2.Last(t).Body); !strings.Contains(got, fakeupstream.Signature(secretA, "let me plan")) {
		t.Errorf("a2 did not get the signed turn: %s", got)
	}

	// a conversation with no thinking goes by priority, as before
	if r := message(t, simpleBody); r.status != 200 || b1.Hits() != 1 {
		t.Errorf("a request without thinking: status %d, b1 %d hits", r.status, b1.Hits())
	}
}

func TestThinkingAcrossDomainsIsRefused(t *testing.T) {
	const secretA, secretB = "org-ra-secret", "org-rb-secret"
	a := fakeupstream.New(t, fakeupstream.ThinkingStream(secretA, "streamed plan", "ok"), fakeupstream.Account(secretA))
	b := fakeupstream.New(t, fakeupstream.Message("ok"), fakeupstream.Account(secretB))
	const otherKey = "sk-client-other-0123456789"
	startRelay(t, channelBlock("th-ra", a.URL, "signature_domain org-ra")+
		channelBlock("th-rb", b.URL)+
		keyAndGroup("th-ga", "th-ra")+
		"\t\tkey "+otherKey+" th-gb\n\t\tgroup th-gb {\n\t\t\tchannels th-rb\n\t\t}\n")

	// learned from the stream's signature_delta
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s := openStream(t, ctx, strings.Replace(thinkingBody(hiUser), `"messages"`, `"stream":true,"messages"`, 1))
	if rest := s.rest(t); !strings.Contains(rest, "signature_delta") || !strings.Contains(rest, "message_stop") {
		t.Fatalf("stream: %s", rest)
	}

	// the same conversation through a group with no channel of org-ra
	r := send(t, http.MethodPost, "/v1/messages", otherKey, thinkingBody(hiUser, signedTurn(secretA, "streamed plan", `{"type":"text","text":"ok"}`), nextUser))
	wantRelayError(t, r, http.StatusServiceUnavailable, "relay_error", "capability_not_available")
	if !strings.Contains(string(r.body), featThinkingSignature) || b.Hits() != 0 {
		t.Errorf("b %d hits; body %s", b.Hits(), r.body)
	}
	if strings.Contains(string(r.body), "org-ra") {
		t.Errorf("the answer names the signer's domain: %s", r.body)
	}
	// without thinking blocks the group serves it
	if r := send(t, http.MethodPost, "/v1/messages", otherKey, thinkingBody(hiUser)); r.status != 200 || b.Hits() != 1 {
		t.Errorf("status %d, b %d hits: %s", r.status, b.Hits(), r.body)
	}
	// and a count of tokens, which ignores earlier turns' thinking, is
	// routed as before
	count := `{"model":"claude-sonnet-4-5","messages":[` + hiUser + `,` + signedTurn(secretA, "streamed plan", `{"type":"text","text":"ok"}`) + `,` + nextUser + `]}`
	if r := send(t, http.MethodPost, "/v1/messages/count_tokens", otherKey, count); r.status != 200 || b.Hits() != 2 {
		t.Errorf("count_tokens: status %d, b %d hits: %s", r.status, b.Hits(), r.body)
	}
}

func TestThinkingFailoverStripRemovesForeignThinking(t *testing.T) {
	const secretA, secretB = "org-sa-secret", "org-sb-secret"
	a := fakeupstream.New(t, fakeupstream.ThinkingMessage(secretA, "first plan"), fakeupstream.Account(secretA))
	b := fakeupstream.New(t, fakeupstream.ThinkingMessage(secretB, "b's plan"), fakeupstream.Account(secretB))
	startRelay(t, channelBlock("th-sa", a.URL, "priority 1")+
		channelBlock("th-sb", b.URL, "priority 2")+
		keyAndGroup("th-gs", "th-sa th-sb", "thinking_failover strip"))
	stripped := func() float64 {
		mf, _ := scrape(t)
		return value(mf, "relay_thinking_stripped_total", "group=th-gs")
	}

	first := message(t, thinkingBody(hiUser))
	if a.Hits() != 1 || stripped() > 0 {
		t.Fatalf("first turn: a %d hits, stripped %v", a.Hits(), stripped())
	}
	a.SetHandler(fakeupstream.Error(500, "api_error", "down"))

	// an earlier turn's thinking block goes; the rest is the client's, byte
	// for byte
	const text = `{"text":"ok","type":"text"}` // as the fake answers it: keys in order
	sent := thinkingBody(hiUser, signedTurn(secretA, "first plan", text), nextUser)
	if turn := assistantTurn(t, first); turn != signedTurn(secretA, "first plan", text) {
		t.Fatalf("the first answer's turn is %s", turn)
	}
	r := message(t, sent)
	if r.status != 200 || b.Hits() != 1 {
		t.Fatalf("status %d, b %d hits: %s", r.status, b.Hits(), r.body)
	}
	want := thinkingBody(hiUser, `{"role":"assistant","content":[`+text+`]}`, nextUser)
	if got := string(b.Last(t).Body); got != want {
		t.Errorf("b got\n%s\nwant\n%s", got, want)
	}
	if got := stripped(); got != 1 {
		t.Errorf("relay_thinking_stripped_total = %v, want 1", got)
	}

	// in a tool loop the last turn loses its block, and the request its
	// thinking: the API wants that turn to start with a thinking block
	// while thinking is on
	const tool = `{"type":"tool_use","id":"toolu_01","name":"ls","input":{}}`
	const result = `{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_01","content":"a.go"}]}`
	r = message(t, thinkingBody(hiUser, signedTurn(secretA, "first plan", tool), result))
	if r.status != 200 || b.Hits() != 2 {
		t.Fatalf("tool loop: status %d, b %d hits: %s", r.status, b.Hits(), r.body)
	}
	want = `{"model":"claude-sonnet-4-5","max_tokens":2048,"messages":[` + hiUser + `,{"role":"assistant","content":[` + tool + `]},` + result + `]}`
	if got := string(b.Last(t).Body); got != want {
		t.Errorf("b got\n%s\nwant\n%s", got, want)
	}

	// b's own blocks stay when the conversation goes on there
	second := assistantTurn(t, r)
	r = message(t, thinkingBody(hiUser, signedTurn(secretA, "first plan", text), nextUser, second, nextUser))
	if r.status != 200 || b.Hits() != 3 {
		t.Fatalf("third turn: status %d, b %d hits: %s", r.status, b.Hits(), r.body)
	}
	want = thinkingBody(hiUser, `{"role":"assistant","content":[`+text+`]}`, nextUser, second, nextUser)
	if got := string(b.Last(t).Body); got != want {
		t.Errorf("b got\n%s\nwant\n%s", got, want)
	}
	if got := stripped(); got != 3 {
		t.Errorf("relay_thinking_stripped_total = %v, want 3", got)
	}

	// a foreign block last in its turn goes with the comma before it: the
	// strict upstream refuses a body the splice left invalid
	last := strings.Replace(signedTurn(secretA, "first plan"), `"content":[`, `"content":[`+text+`,`, 1)
	r = message(t, thinkingBody(hiUser, last, nextUser))
	if r.status != 200 || b.Hits() != 4 {
		t.Fatalf("a last block: status %d, b %d hits: %s", r.status, b.Hits(), r.body)
	}
}

// TestThinkingGarbageSignatures: a client's signatures no upstream made
// route as any request; the upstream's 400 is the client's answer, and
// nothing cools.
func TestThinkingGarbageSignatures(t *testing.T) {
	const secret = "org-g-secret"
	// started without the test: its refusal of the garbage is expected
	g := fakeupstream.Start(fakeupstream.Message("ok"), true, fakeupstream.Account(secret))
	t.Cleanup(g.Close)
	startRelay(t, channelBlock("th-g1", g.URL, "cooldown 1m")+keyAndGroup("th-gg", "th-g1", "thinking_failover strip"))

	garbage := `{"role":"assistant","content":[{"type":"thinking","thinking":"x","signature":"not-a-signature"},{"type":"redacted_thinking","data":"bm90IGRhdGE="},{"type":"text","text":"y"}]}`
	r := message(t, thinkingBody(hiUser, garbage, nextUser))
	if r.status != http.StatusBadRequest || !strings.Contains(string(r.body), "Invalid `signature` in `thinking` block") {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if got := string(g.Last(t).Body); got != thinkingBody(hiUser, garbage, nextUser) {
		t.Errorf("the upstream got another body than the client's: %s", got)
	}
	if st := channels(t)["th-g1"].State; st != "healthy" {
		t.Errorf("th-g1 is %s after a client's garbage", st)
	}
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("the next request: %d %s", r.status, r.body)
	}
	mf, _ := scrape(t)
	if v := value(mf, "relay_thinking_stripped_total", "group=th-gg"); v > 0 {
		t.Errorf("relay_thinking_stripped_total = %v for garbage", v)
	}
}
