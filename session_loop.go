package relay

import (
	"encoding/binary"

	"github.com/cespare/xxhash/v2"
)

// The loop guard's reading of a conversation. When a loop guard applies to
// a request, the body scan (inspect.go) walks its messages instead of
// skipping them, in the same strict pass, and keeps of the last two what
// they say of tool use: the name and input of each tool_use block of an
// assistant turn, the content and is_error of each tool_result block of a
// user turn, as slices of the body (nothing is copied or allocated). A
// conversation that ends with an assistant's tool calls and the user's
// results of them ends with a (tool call, tool result) pair: its digest is
// what the session compares with the pair its last request ended with
// (sessions.go). Ids (tool_use_id, the tool_use's id) are left out: each
// call has a new one, a loop is the same call getting the same answer.

// maxTurnParts bounds the parts of a turn kept as slices; more are folded
// into the turn's digest as they come.
const maxTurnParts = 8

// toolTurn is what one message says of tool use.
type toolTurn struct {
	role  byte // 'a': assistant, 'u': user, 0: another, or none said
	n     int  // parts
	parts [maxTurnParts][2][]byte
	over  uint64 // the digest of the parts past maxTurnParts; 0: none
}

// wantsLoop reports whether the request's conversation is to be read for
// the loop guard: a message whose key (or its group) has one.
func (in *inbound) wantsLoop() bool {
	k := in.who.key
	return k != nil && k.sessions != nil && k.sessions.loopGuard > 0 && in.route == routeMessages
}

// add keeps one part: two raw values.
func (t *toolTurn) add(a, b []byte) {
	if t.n < maxTurnParts {
		t.parts[t.n] = [2][]byte{a, b}
	} else {
		var buf [24]byte // chained: the digest so far, then each value's
		binary.LittleEndian.PutUint64(buf[0:], t.over)
		binary.LittleEndian.PutUint64(buf[8:], xxhash.Sum64(a))
		binary.LittleEndian.PutUint64(buf[16:], xxhash.Sum64(b))
		t.over = max(xxhash.Sum64(buf[:]), 1) // 0 says none
	}
	t.n++
}

// loopDigest is the digest of the pair a conversation ends with: the
// assistant's tool calls (prev) and the user's results (last); 0 when it
// does not end with one.
func loopDigest(prev, last *toolTurn) uint64 {
	if prev.role != 'a' || last.role != 'u' || prev.n == 0 || last.n == 0 {
		return 0
	}
	var d xxhash.Digest // on the stack: digesting allocates nothing
	d.Reset()
	sep := [1]byte{0xff} // no byte of valid JSON text is 0xff
	for _, t := range [2]*toolTurn{prev, last} {
		for i := range min(t.n, maxTurnParts) {
			_, _ = d.Write(t.parts[i][0])
			_, _ = d.Write(sep[:])
			_, _ = d.Write(t.parts[i][1])
			_, _ = d.Write(sep[:])
		}
		var end [9]byte // the turn's end, and its parts past maxTurnParts
		binary.LittleEndian.PutUint64(end[:], t.over)
		end[8] = 0xfe
		_, _ = d.Write(end[:])
	}
	h := d.Sum64()
	return max(h, 1) // 0 says none
}
