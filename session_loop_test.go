package relay

import (
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/memtest"
)

// loopOf inspects body for a key with a loop guard and returns the digest
// of the pair it ends with.
func loopOf(t *testing.T, body string) uint64 {
	t.Helper()
	in := loopInbound(body)
	if rerr := in.inspect(); rerr != nil {
		t.Fatalf("inspect: %s", rerr.msg)
	}
	return in.ask.loop
}

func loopInbound(body string) *inbound {
	k := &key{name: "k", group: &group{name: "g", affinity: true}, sessions: &sessionRules{loopGuard: 5}}
	return &inbound{route: routeMessages, who: requester{key: k}, ask: asked{body: []byte(body), header: http.Header{}}}
}

// conversation is a body whose messages end with turns.
func conversation(turns ...string) string {
	return `{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"fix it"}` + strings.Join(append([]string{""}, turns...), ",") + `]}`
}

func call(id, name, input string) string {
	return `{"role":"assistant","content":[{"type":"text","text":"ok"},{"type":"tool_use","id":"` + id + `","name":"` + name + `","input":` + input + `}]}`
}

func result(id, content string, isError bool) string {
	return `{"role":"user","content":[{"type":"tool_result","tool_use_id":"` + id + `","content":` + strconv.Quote(content) + `,"is_error":` + strconv.FormatBool(isError) + `}]}`
}

func TestLoopDigestIsTheLastToolCallAndResult(t *testing.T) {
	base := loopOf(t, conversation(call("toolu_1", "Bash", `{"command":"make"}`), result("toolu_1", "error 2", true)))
	if base == 0 {
		t.Fatal("a conversation that ends with a tool call and its result has no digest")
	}
	for _, c := range []struct {
		what string
		body string
		same bool
	}{
		{"the same call and result with new ids, after more turns",
			conversation(call("toolu_1", "Bash", `{"command":"make"}`), result("toolu_1", "error 2", true),
				call("toolu_9", "Bash", `{"command":"make"}`), result("toolu_9", "error 2", true)), true},
		{"another result", conversation(call("toolu_1", "Bash", `{"command":"make"}`), result("toolu_1", "ok", false)), false},
		{"the same result, no longer an error", conversation(call("toolu_1", "Bash", `{"command":"make"}`), result("toolu_1", "error 2", false)), false},
		{"another input", conversation(call("toolu_1", "Bash", `{"command":"make all"}`), result("toolu_1", "error 2", true)), false},
		{"another tool", conversation(call("toolu_1", "Shell", `{"command":"make"}`), result("toolu_1", "error 2", true)), false},
		{"name and input run together otherwise", conversation(call("toolu_1", "Bas", `{"command":"make"}`), result("toolu_1", "error 2", true)), false},
	} {
		if got := loopOf(t, c.body); (got == base) != c.same || got == 0 {
			t.Errorf("%s: digest %x, base %x, want same %v", c.what, got, base, c.same)
		}
	}
	for _, c := range []struct{ what, body string }{
		{"a new prompt", conversation(call("toolu_1", "Bash", `{}`), result("toolu_1", "x", false), `{"role":"assistant","content":"done"}`, `{"role":"user","content":"now the docs"}`)},
		{"the assistant's call without its result", conversation(result("toolu_0", "x", false), call("toolu_1", "Bash", `{}`))},
		{"no messages but the prompt", conversation()},
		{"a result with no call before it", conversation(`{"role":"assistant","content":"hm"}`, result("toolu_1", "x", false))},
	} {
		if got := loopOf(t, c.body); got != 0 {
			t.Errorf("%s: digest %x, want none", c.what, got)
		}
	}
	// parallel calls: every call and every result counts, past the parts kept
	var calls, results []string
	for i := range maxTurnParts + 3 {
		calls = append(calls, `{"type":"tool_use","id":"t`+strconv.Itoa(i)+`","name":"Read","input":{"file":"`+strconv.Itoa(i)+`"}}`)
		results = append(results, `{"type":"tool_result","tool_use_id":"t`+strconv.Itoa(i)+`","content":"r`+strconv.Itoa(i)+`"}`)
	}
	parallel := func(last string) string {
		return conversation(`{"role":"assistant","content":[`+strings.Join(calls, ",")+`]}`, `{"role":"user","content":[`+strings.Join(results[:len(results)-1], ",")+`,`+last+`]}`)
	}
	a, b := loopOf(t, parallel(results[len(results)-1])), loopOf(t, parallel(`{"type":"tool_result","tool_use_id":"tx","content":"other"}`))
	if a == 0 || a == b {
		t.Errorf("parallel calls: %x and %x, want two digests", a, b)
	}
}

// TestTheLoopScanStaysStrict: reading the messages for the loop guard
// refuses what the strict scan refuses anywhere else.
func TestTheLoopScanStaysStrict(t *testing.T) {
	for _, body := range []string{
		conversation(`{"role":"user","role":"assistant","content":"x"}`),
		conversation(`{"role":"assistant","content":[{"type":"tool_use","type":"text"}]}`),
		conversation(`{"role":"user","content":[{"type":"text","text":"x"}`),
		`{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"x"}]]}`,
	} {
		in := loopInbound(body)
		if rerr := in.inspect(); rerr == nil || rerr.status != 400 {
			t.Errorf("%s: %v, want a 400", body, rerr)
		}
	}
}

// TestTheLoopScanAllocatesNothing: reading the conversation for the loop
// guard allocates nothing more than the scan without it.
// TestAllocationOfTheLoopScan: reading the conversation for a loop guard
// allocates nothing more than skipping it. Named for .ci/run's run of the
// allocation tests without the race detector, which allocates for itself.
func TestAllocationOfTheLoopScan(t *testing.T) {
	if memtest.Race {
		t.Skip("the race detector changes what code allocates; .ci/run runs this test without -race")
	}
	var turns []string
	for i := range 40 {
		id := "toolu_" + strconv.Itoa(i)
		turns = append(turns, call(id, "Bash", `{"command":"npm test","timeout":120000}`), result(id, strings.Repeat("FAIL ", 50), true))
	}
	body := conversation(turns...)
	with := testing.AllocsPerRun(100, func() { _ = loopInbound(body).inspect() })
	without := testing.AllocsPerRun(100, func() {
		in := loopInbound(body)
		in.who.key.sessions = nil
		_ = in.inspect()
	})
	if with != without {
		t.Errorf("inspect allocates %v with the loop guard, %v without", with, without)
	}
}

func BenchmarkInspectLoopGuard(b *testing.B) {
	var turns []string
	for i := range 40 {
		id := "toolu_" + strconv.Itoa(i)
		turns = append(turns, call(id, "Bash", `{"command":"npm test","timeout":120000}`), result(id, strings.Repeat("FAIL ", 50), true))
	}
	body := conversation(turns...)
	for _, guard := range []bool{false, true} {
		b.Run("loop_guard="+strconv.FormatBool(guard), func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				in := loopInbound(body)
				if !guard {
					in.who.key.sessions = nil
				}
				_ = in.inspect()
			}
		})
	}
}

// TestOneWalkServesEveryReader checks that the loop guard, the prompt
// cache and the thinking signers read one conversation in the same walk
// (inspect_messages.go): a Claude Code turn carries all three at once.
func TestOneWalkServesEveryReader(t *testing.T) {
	learnSig("sig-one-walk", "one-walk-domain")
	thinkingCall := `{"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":"sig-one-walk"},{"type":"tool_use","id":"toolu_1","name":"Bash","input":{"command":"make"}}]}`
	plainCall := call("toolu_1", "Bash", `{"command":"make"}`)
	marked := `{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"error 2","cache_control":{"type":"ephemeral"}}],"is_error":true}]}`

	in := loopInbound(conversation(thinkingCall, marked))
	if rerr := in.inspect(); rerr != nil {
		t.Fatal(rerr.msg)
	}
	if in.ask.prefix == nil || in.ask.prefix.Breakpoints() != 1 {
		t.Fatalf("prefix = %+v, want one breakpoint (in a tool result's content)", in.ask.prefix)
	}
	if in.ask.thinking.signed != 1 || in.ask.thinking.signer != "one-walk-domain" {
		t.Errorf("thinking = %+v, want one block signed by one-walk-domain", in.ask.thinking)
	}
	// the thinking block is not what the loop compares (Claude Code marks
	// the last result the same way every turn, so the mark may count)
	want := loopOf(t, conversation(plainCall, marked))
	if in.ask.loop == 0 || in.ask.loop != want {
		t.Errorf("loop digest %x, want %x (the same call and result without thinking)", in.ask.loop, want)
	}
}
