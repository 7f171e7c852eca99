package signatures

import (
	"context"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/fleet"
)

// In a fleet, the signatures a node learns go to the other nodes, so that
// a conversation whose last answer one node passed is routed by its signer
// on any node. They travel by pub/sub only, off the request path: a node
// sends what it learns in batches, and each node adds what the others
// send to its own table, where requests look them up without a round
// trip. A node that was away misses what was sent meanwhile, and routes
// those conversations as unknown until their next answer teaches it.

// Shared is a table's signatures shared with a fleet, on the fleet's
// client: the worker that publishes what this node learns and the
// subscription that adds what the others learn, both the client's
// background work until it stops.
type Shared struct {
	c      *fleet.Client
	t      *Table     // where the others' signatures go
	signed chan entry // signatures this node learned, to publish
}

// entry is a signature learned: its digest and the domain that signed it.
type entry struct {
	digest uint64
	domain string
}

// NewShared shares the signatures of t through the fleet of c: its
// publisher and its subscription run as c's background work.
func NewShared(c *fleet.Client, t *Table) *Shared {
	s := &Shared{c: c, t: t, signed: make(chan entry, 1024)}
	c.Go(s.publish)
	c.Go(s.subscribe)
	return s
}

// topic is the pub/sub channel of learned signatures.
func (s *Shared) topic() string { return s.c.Prefix + "signatures" }

// share queues a signature this node learned for the other nodes; when
// the queue is full it is dropped (the others learn it from the next
// answer of the conversation).
func (s *Shared) share(e entry) {
	if s.c.Closed() {
		return
	}
	select {
	case s.signed <- e:
	default:
	}
}

// publish sends the signatures this node learns, as many in one message as
// have queued, until ctx ends. A message is the node's id, then a line
// "<digest in hex> <domain>" per signature.
func (s *Shared) publish(ctx context.Context) {
	var b strings.Builder
	for {
		select {
		case <-ctx.Done():
			return
		case e := <-s.signed:
			b.Reset()
			b.WriteString(s.c.Node)
			appendEntry(&b, e)
		more:
			for n := 1; n < 256; n++ {
				select {
				case e := <-s.signed:
					appendEntry(&b, e)
				default:
					break more
				}
			}
			msg := b.String()
			_ = s.c.Background("publish", func(ctx context.Context) error {
				return s.c.Redis.Publish(ctx, s.topic(), msg).Err()
			})
		}
	}
}

func appendEntry(b *strings.Builder, e entry) {
	b.WriteByte('\n')
	b.WriteString(strconv.FormatUint(e.digest, 16))
	b.WriteByte(' ')
	b.WriteString(e.domain)
}

// subscribe adds the signatures the other nodes publish to the table,
// until ctx ends.
func (s *Shared) subscribe(ctx context.Context) {
	s.c.Subscribe(ctx, s.topic(), nil, func(payload string) { s.t.learnShared(payload, s.c.Node) })
}

// learnShared adds the signatures of a message another node published; a
// message of node's own, or a line that is not one, adds nothing.
func (t *Table) learnShared(payload, node string) {
	from, rest, _ := strings.Cut(payload, "\n")
	if from == node {
		return
	}
	for line := range strings.SplitSeq(rest, "\n") {
		hex, domain, ok := strings.Cut(line, " ")
		d, err := strconv.ParseUint(hex, 16, 64)
		if !ok || err != nil || !ValidDomain(domain) {
			continue
		}
		t.learn(d, strings.Clone(domain))
	}
}
