package relay

import (
	"bytes"
	"context"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"golang.org/x/sync/semaphore"
)

// The decode budget. Reading a body's JSON costs a small multiple of its
// size, bar one shape: a body that is mostly one object of very many
// members, whose names a strict decoder keeps until the object ends to
// find one given twice (about 70 bytes a member in the relay's scan,
// about 160 in a Chat Completions translation: up to about 20 times the
// body). Six such bodies of 32 MB decoding at once held 1.5 to 2 GB.
// So every decode of a request body first reserves what it may allocate
// from a budget per node (decode_memory, 256 MiB by default), estimated
// from the body's size and the members of its objects, and gives it back
// when done: a request that finds no room waits, for as long as its
// client does, and one whose decode alone would take more than the whole
// budget is refused with a 413. What the decoded request keeps afterwards
// (its body, a translation's output) is bounded by max_body_size and the
// keys' concurrency, as before.

// defaultDecodeMemory is decode_memory's default.
const defaultDecodeMemory = 256 << 20

// What a decode allocates, at most: a little whatever the body, then per
// byte of the body and per member of its objects, measured with margin by
// TestDecodeCostCoversTheDecode on bodies of every shape. The scan of a
// Messages body (internal/jsonscan) keeps about 50 to 80 bytes a member
// and little else; the translation of a Chat Completions body (jsontext,
// its Messages output scanned after) writes up to about 4 times the body
// and keeps about 200 to 240 bytes a member, and about 6 bytes for each
// byte of a name.
const (
	decodeBase                           = 8 << 10
	scanPerByte, scanPerMember           = 1, 112
	translatePerByte, translatePerMember = 7, 256
)

// decodeBudgets are the nodes' decode budgets, one per value of
// decode_memory, shared by the relay handlers that set it.
var decodeBudgets = caddy.NewUsagePool()

// decodeBudget is the bytes the decodes of request bodies may hold at once.
type decodeBudget struct {
	size int64
	sem  *semaphore.Weighted
}

// Destruct implements caddy.Destructor.
func (*decodeBudget) Destruct() error { return nil }

// takeDecodeBudget takes the budget of r's decode_memory from the pool.
func (r *Relay) takeDecodeBudget() {
	key := strconv.FormatInt(r.DecodeMemory, 10)
	v, _, _ := decodeBudgets.LoadOrNew(key, func() (caddy.Destructor, error) {
		return &decodeBudget{size: r.DecodeMemory, sem: semaphore.NewWeighted(r.DecodeMemory)}, nil
	})
	r.decode = v.(*decodeBudget)
	r.held.addDecode(key)
}

// decodeBody reads the request's body (translating a Chat Completions
// body first) with room reserved in the node's decode budget for what
// that may allocate: it waits for the room while its client does, and
// refuses a body whose decode would take more than the whole budget.
func (r *Relay) decodeBody(ctx context.Context, in *inbound) *relayError {
	cost := decodeCost(in.ask.body, in.ask.chat != nil, r.decode.size/16)
	if cost > r.decode.size {
		return errDecodeTooLarge(cost, r.decode.size)
	}
	if err := r.decode.sem.Acquire(ctx, cost); err != nil {
		return &relayError{status: statusClientClosed, typ: "api_error", msg: "client left while its body waited for room to be decoded"}
	}
	defer r.decode.sem.Release(cost)
	if in.ask.chat != nil {
		if rerr := in.translateChat(); rerr != nil {
			return rerr
		}
	}
	return in.inspect()
}

// decodeCost is what decoding body may allocate, at most: as a Chat
// Completions body to translate when chat is set, else as a body to
// scan. Its members are first counted as the colons of the body, which
// costs little and may count too many (those in strings); a body whose
// cost so counted is above enough has them counted again, outside its
// strings.
func decodeCost(body []byte, chat bool, enough int64) int64 {
	perByte, perMember := int64(scanPerByte), int64(scanPerMember)
	if chat {
		perByte, perMember = translatePerByte, translatePerMember
	}
	n := int64(len(body))
	cost := decodeBase + perByte*n + perMember*int64(bytes.Count(body, colon))
	if cost <= enough {
		return cost
	}
	return decodeBase + perByte*n + perMember*int64(objectMembers(body))
}

var colon = []byte{':'}

// objectMembers counts the members of the objects of a JSON document: its
// colons outside strings. Of a document that is not JSON, it counts
// something its decode soon refuses.
func objectMembers(b []byte) int {
	n := 0
	for {
		q := bytes.IndexByte(b, '"')
		if q < 0 {
			return n + bytes.Count(b, colon)
		}
		n += bytes.Count(b[:q], colon)
		b = b[q+1:]
		for { // to the quote that ends the string: one no backslash escapes
			e := bytes.IndexByte(b, '"')
			if e < 0 {
				return n
			}
			backslashes := 0
			for i := e - 1; i >= 0 && b[i] == '\\'; i-- {
				backslashes++
			}
			b = b[e+1:]
			if backslashes%2 == 0 {
				break
			}
		}
	}
}
