package relay

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
		if t.over == 0 {
			t.over = fnvOffset
		}
		t.over = fnvAdd(fnvAdd(t.over, a), b)
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
	h := uint64(fnvOffset)
	for _, t := range [2]*toolTurn{prev, last} {
		for i := range min(t.n, maxTurnParts) {
			h = fnvAdd(fnvAdd(h, t.parts[i][0]), t.parts[i][1])
		}
		h = (h ^ t.over ^ 0xfe) * fnvPrime // the turn's end, and its parts past maxTurnParts
	}
	return max(h, 1) // 0 says none
}

// FNV-1a, 64 bits, written out so that digesting allocates nothing: a loop
// that a collision made up would refuse only the session's own request.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

// fnvAdd adds b, and a separator, to the digest h.
func fnvAdd(h uint64, b []byte) uint64 {
	for _, c := range b {
		h = (h ^ uint64(c)) * fnvPrime
	}
	return (h ^ 0xff) * fnvPrime // the separator: no byte of valid JSON text is 0xff
}
