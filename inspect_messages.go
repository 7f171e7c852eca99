package relay

import (
	"github.com/caddy-relay/relay/internal/affinity"
	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/caddy-relay/relay/internal/signatures"
)

// The one walk of a Messages request's `messages`, in inspect's strict
// pass. Three features read the conversation, and each reads it here, in
// the same walk, never in a pass of its own:
//
//   - prompt-cache affinity (affinity.go): the breakpoints, a block marked
//     with cache_control, where they end in the body, and where the
//     messages lie;
//   - thinking signatures (thinking.go): each content block's type and
//     signature (or a redacted block's data), for the domain that signed
//     them;
//   - the loop guard (session_loop.go): what the last two messages say of
//     tool use, as slices of the body.
//
// A request that needs none of them (no breakpoint, no loop guard, and no
// signature learned yet, so no signer could be known) skips its messages
// as any other value. The walk keeps slices of the body and allocates
// nothing unless a field name is written with escapes.

// walksMessages reports whether a feature reads the request's
// conversation.
func (in *inbound) walksMessages() bool {
	return in.route == routeMessages && (in.ask.prefix != nil || in.wantsLoop() || signatures.Learned.Some())
}

// messageWalk is what the walk notes, for the features that asked.
type messageWalk struct {
	prefix *cachePrefix // nil: no breakpoint in the body, or no affinity
	loop   bool         // a loop guard applies: keep the tool turns
	turns  [2]toolTurn  // the last two messages' tool use (loop)
	turn   int          // the index in turns of the message being read
}

// scanMessages reads a `messages` array (the scanner before its '[').
func (in *inbound) scanMessages(sc *jsonscan.Scanner) error {
	w := messageWalk{prefix: in.ask.prefix, loop: in.wantsLoop()}
	start := sc.ValueOffset()
	if err := sc.ReadArrayStart(); err != nil {
		return err
	}
	for {
		more, err := sc.NextElement()
		if err != nil {
			return err
		}
		if !more {
			break
		}
		w.turn ^= 1
		w.turns[w.turn] = toolTurn{}
		if err := w.message(sc, in); err != nil {
			return err
		}
	}
	if w.prefix != nil {
		w.prefix.NoteSpan(affinity.SectMessages, start, sc.InputOffset())
	}
	if w.loop {
		in.ask.loop = loopDigest(&w.turns[w.turn^1], &w.turns[w.turn])
	}
	return nil
}

// message reads one message: its role, and its content's blocks.
func (w *messageWalk) message(sc *jsonscan.Scanner, in *inbound) error {
	if sc.PeekKind() != '{' {
		_, err := sc.ReadValue()
		return err
	}
	if err := sc.ReadObjectStart(); err != nil {
		return err
	}
	marked, long := false, false
	for {
		name, err := sc.NextName()
		if err != nil {
			return err
		}
		if name == nil {
			break
		}
		field := unquoteJSON(name)
		if field == "content" && sc.PeekKind() == '[' {
			if err := w.blocks(sc, in, 1); err != nil {
				return err
			}
			continue
		}
		v, err := sc.ReadValue()
		if err != nil {
			return err
		}
		switch field {
		case "role":
			switch string(v) {
			case `"assistant"`:
				w.turns[w.turn].role = 'a'
			case `"user"`:
				w.turns[w.turn].role = 'u'
			}
		case "cache_control":
			marked, long = isBreakpoint(v)
		}
	}
	if marked && w.prefix != nil {
		w.prefix.Mark(affinity.SectMessages, sc.InputOffset(), long)
	}
	return nil
}

// blocks reads an array of content blocks: a message's (depth 1), or a
// tool result's content (depth 2), whose blocks only the prompt cache
// reads (they may be marked).
func (w *messageWalk) blocks(sc *jsonscan.Scanner, in *inbound, depth int) error {
	if err := sc.ReadArrayStart(); err != nil {
		return err
	}
	for {
		more, err := sc.NextElement()
		if err != nil || !more {
			return err
		}
		if sc.PeekKind() != '{' {
			if _, err := sc.ReadValue(); err != nil {
				return err
			}
			continue
		}
		if err := sc.ReadObjectStart(); err != nil {
			return err
		}
		var typ, sig, data, name, input, content, isError []byte
		marked, long := false, false
		for {
			n, err := sc.NextName()
			if err != nil {
				return err
			}
			if n == nil {
				break
			}
			field := unquoteJSON(n)
			if field == "content" && depth == 1 && sc.PeekKind() == '[' {
				at := sc.ValueOffset()
				if err := w.blocks(sc, in, depth+1); err != nil {
					return err
				}
				content = in.ask.body[at:sc.InputOffset()]
				continue
			}
			v, err := sc.ReadValue()
			if err != nil {
				return err
			}
			switch field {
			case "type":
				typ = v
			case "signature":
				sig = v
			case "data":
				data = v
			case "name":
				name = v
			case "input":
				input = v
			case "content":
				content = v
			case "is_error":
				isError = v
			case "cache_control":
				marked, long = isBreakpoint(v)
			}
		}
		if marked && w.prefix != nil {
			w.prefix.Mark(affinity.SectMessages, sc.InputOffset(), long)
		}
		if depth != 1 {
			continue
		}
		in.ask.thinking.block(typ, sig, data)
		if w.loop {
			switch string(typ) {
			case `"tool_use"`:
				w.turns[w.turn].add(name, input)
			case `"tool_result"`:
				w.turns[w.turn].add(content, isError)
			}
		}
	}
}
