package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// thinkingConversation is a Messages body with thinking on and these
// messages.
func thinkingConversation(messages ...string) string {
	return `{"model":"claude-sonnet-4-5","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[` + strings.Join(messages, ",") + `]}`
}

// TestFleetSharesThinkingSignatures runs two relay processes on one Redis:
// a thinking answer one node passed teaches the other who signed it, so
// the next turn of the conversation, sent to the other node, goes to a
// channel of the signer's account and not to a better tier of another
// account, whose upstream would refuse the signature.
func TestFleetSharesThinkingSignatures(t *testing.T) {
	const secretA, secretB = "fleet-org-a-secret", "fleet-org-b-secret"
	srv := redistest.Start(t)
	// each upstream is an account of its own: it signs its answers'
	// thinking and refuses a block another account signed
	a1 := fakeupstream.New(t, fakeupstream.ThinkingMessage(secretA, "plan the refactor"), fakeupstream.Account(secretA))
	b := fakeupstream.New(t, fakeupstream.Message("from b"), fakeupstream.Account(secretB))
	a2 := fakeupstream.New(t, fakeupstream.Message("from a2"), fakeupstream.Account(secretA))
	// the probe's channel, of domain org-b and disabled, is never sent a
	// request: a node that knows the signer refuses the probe before
	// health is looked at (capability_not_available), one that does not
	// finds no live channel
	probe := fakeupstream.New(t, fakeupstream.Message("from the probe"), fakeupstream.Account(secretB))
	const probeKey = "sk-fleet-probe-0123456789abcdef"
	nodes := startFleet(t, 2, fleetConfig{redisAddr: srv.Addr, prefix: "sigf:",
		channels: []string{"a1=" + a1.URL, "b=" + b.URL, "a2=" + a2.URL},
		options: map[string]string{
			"a1": "\t\t\tsignature_domain org-a\n",
			"b":  "\t\t\tsignature_domain org-b\n",
			"a2": "\t\t\tsignature_domain org-a\n",
		},
		extra: fmt.Sprintf("\t\tchannel probe {\n\t\t\turl %s\n\t\t\tapi_key %s\n\t\t\tsignature_domain org-b\n\t\t}\n"+
			"\t\tkey %s probe {\n\t\t\tname probe\n\t\t}\n\t\tgroup probe {\n\t\t\tchannels probe\n\t\t}\n", probe.URL, fakeupstream.Key, probeKey),
	})

	// both nodes listen for the signatures the other learns (what is
	// published before a node subscribes never reaches it)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	within(t, "both nodes subscribe", 5*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(context.Background(), "sigf:signatures").Result()
		return n["sigf:signatures"] == 2
	})

	// node 1 answers the first turn from a1, the best tier
	status, body, err := nodes[0].attemptBody(fleetKey, thinkingConversation(`{"role":"user","content":"Hi"}`))
	var answer struct {
		Content json.RawMessage `json:"content"`
	}
	if err != nil || status != 200 || json.Unmarshal([]byte(body), &answer) != nil || a1.Hits() != 1 {
		t.Fatalf("node 1, first turn: %d %s %v; a1 hit %d times", status, body, err, a1.Hits())
	}
	signature := fakeupstream.Signature(secretA, "plan the refactor")
	if !strings.Contains(string(answer.Content), signature) {
		t.Fatalf("the first turn carries no signature of a1's account: %s", answer.Content)
	}
	next := thinkingConversation(`{"role":"user","content":"Hi"}`, `{"role":"assistant","content":`+string(answer.Content)+`}`,
		`{"role":"user","content":"And then?"}`)

	// a1 goes out for the whole fleet
	nodes[0].post(t, "/relay/channels/a1/disable")
	nodes[0].post(t, "/relay/channels/probe/disable")
	for _, ch := range []string{"a1", "probe"} {
		within(t, ch+" disabled on node 2", 2*time.Second, func() bool { return nodes[1].channel(t, ch)["state"] == "disabled" })
	}

	// node 2 learns who signed the turn, from node 1 (it never saw the
	// answer): the probe, the same conversation through a group of org-b
	// alone, is refused as one org-b cannot verify
	var probeStatus int
	var probeBody string
	took := within(t, "node 2 learns the signature", 2*time.Second, func() bool {
		probeStatus, probeBody, _ = nodes[1].attemptBody(probeKey, next)
		return strings.Contains(probeBody, "capability_not_available")
	})
	t.Logf("node 2 knew the signer after %v", took)
	if probeStatus != 503 || !strings.Contains(probeBody, "thinking_signature") || strings.Contains(probeBody, "org-a") || probe.Hits() != 0 {
		t.Fatalf("node 2's probe: %d %s; the probe's upstream hit %d times", probeStatus, probeBody, probe.Hits())
	}

	// the next turn, on node 2: a1 is out, and b, the better tier, is of
	// another account; it goes to a2, which takes a1's signature
	status, body, err = nodes[1].attemptBody(fleetKey, next)
	if err != nil || status != 200 || !strings.Contains(body, "from a2") || b.Hits() != 0 || a2.Hits() != 1 {
		t.Fatalf("node 2, next turn: %d %s %v; b hit %d times, a2 %d", status, body, err, b.Hits(), a2.Hits())
	}
	if got := string(a2.Last(t).Body); !strings.Contains(got, signature) {
		t.Errorf("a2 was not sent the signed turn: %s", got)
	}

	// a signature neither node learned routes as any request (to b, by
	// priority, whose account would refuse it): the probe tells the two
	// apart
	unknown := strings.ReplaceAll(next, signature, fakeupstream.Signature(secretA, "never answered"))
	if status, body, _ = nodes[1].attemptBody(probeKey, unknown); status != 503 || !strings.Contains(body, "no_healthy_channel") || probe.Hits() != 0 {
		t.Errorf("node 2's probe, an unknown signature: %d %s; the probe's upstream hit %d times", status, body, probe.Hits())
	}
}
