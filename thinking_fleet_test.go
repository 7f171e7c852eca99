package relay

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddy-relay/relay/internal/signatures"
)

// TestSignaturesTravelTheFleet: what one node learns the others learn,
// through Redis's pub/sub, and a malformed line teaches nothing (the
// messages' rules are internal/signatures' tests).
func TestSignaturesTravelTheFleet(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	r, _ := fleetRelay(t, srv.Addr, "sig:", "fleet-sig")
	ctx := context.Background()
	waitFor(t, "the node subscribes", 2*time.Second, func() bool {
		n, _ := rdb.PubSubNumSub(ctx, "sig:signatures").Result()
		return n["sig:signatures"] == 1
	})

	// another node's
	d := signatures.Digest([]byte(`"sig-from-another-node"`))
	bad := signatures.Digest([]byte(`"sig-of-a-bad-domain"`))
	// the malformed lines come first: once the good one is learnt, they
	// have been read
	msg := "another-node\nnot-hex org-x\n" + strconv.FormatUint(bad, 16) + " bad domain\n" + strconv.FormatUint(d, 16) + " org-far"
	if err := rdb.Publish(ctx, "sig:signatures", msg).Err(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the other node's signature", 2*time.Second, func() bool { return signatures.Learned.DomainOf(d) == "org-far" })
	if got := signatures.Learned.DomainOf(bad); got != "" {
		t.Errorf("a malformed line taught %q", got)
	}

	// this node's: published for the others
	sub := rdb.Subscribe(ctx, "sig:signatures")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	ch := r.groups["fleet-sig-g"].channels[0]
	learnRaw(`"sig-learned-here"`, ch)
	m, err := sub.ReceiveMessage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := "\n" + strconv.FormatUint(signatures.Digest([]byte(`"sig-learned-here"`)), 16) + " " + ch.domain
	if !strings.HasSuffix(m.Payload, want) || strings.Contains(m.Payload, "sig-learned-here") {
		t.Errorf("published %q, want it to end with %q and hold no signature", m.Payload, want)
	}
	node := ch.health.fleet.Load().Node
	if from, _, _ := strings.Cut(m.Payload, "\n"); from != node {
		t.Errorf("published as %q, not as the node %q", from, node)
	}
}
