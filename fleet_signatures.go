package relay

import (
	"context"
	"strconv"
	"strings"
)

// In a fleet, the signatures a node learns (thinking.go) go to the other
// nodes, so that a conversation whose last answer one node passed is
// routed by its signer on any node. They travel by pub/sub only, off the
// request path: a node sends what it learns in batches, and each node
// adds what the others send to its own table, where requests look them
// up without a round trip. A node that was away misses what was sent
// meanwhile, and routes those conversations as unknown until their next
// answer teaches it.

// signedEntry is a signature learned: its digest and the domain that
// signed it.
type signedEntry struct {
	digest uint64
	domain string
}

// signaturesTopic is the pub/sub channel of learned signatures.
func (f *member) signaturesTopic() string { return f.Prefix + "signatures" }

// share queues a signature this node learned for the other nodes; when
// the queue is full it is dropped (the others learn it from the next
// answer of the conversation).
func (f *member) share(e signedEntry) {
	if f.Closed() {
		return
	}
	select {
	case f.signed <- e:
	default:
	}
}

// publishSignatures sends the signatures this node learns, as many in one
// message as have queued, until ctx ends. A message is the node's id, then
// a line "<digest in hex> <domain>" per signature.
func (f *member) publishSignatures(ctx context.Context) {
	var b strings.Builder
	for {
		select {
		case <-ctx.Done():
			return
		case e := <-f.signed:
			b.Reset()
			b.WriteString(f.Node)
			appendSigned(&b, e)
		more:
			for n := 1; n < 256; n++ {
				select {
				case e := <-f.signed:
					appendSigned(&b, e)
				default:
					break more
				}
			}
			msg := b.String()
			_ = f.Background("publish", func(ctx context.Context) error {
				return f.Redis.Publish(ctx, f.signaturesTopic(), msg).Err()
			})
		}
	}
}

func appendSigned(b *strings.Builder, e signedEntry) {
	b.WriteByte('\n')
	b.WriteString(strconv.FormatUint(e.digest, 16))
	b.WriteByte(' ')
	b.WriteString(e.domain)
}

// subscribeSignatures adds the signatures the other nodes publish to this
// node's table, until ctx ends.
func (f *member) subscribeSignatures(ctx context.Context) {
	f.Subscribe(ctx, f.signaturesTopic(), nil, func(payload string) { learnShared(payload, f.Node) })
}

// learnShared adds the signatures of a message another node published; a
// message of this node's own, or a line that is not one, adds nothing.
func learnShared(payload, node string) {
	from, rest, _ := strings.Cut(payload, "\n")
	if from == node {
		return
	}
	for line := range strings.SplitSeq(rest, "\n") {
		hex, domain, ok := strings.Cut(line, " ")
		d, err := strconv.ParseUint(hex, 16, 64)
		if !ok || err != nil || !validDomainName(domain) {
			continue
		}
		signatures.learn(d, strings.Clone(domain))
	}
}
