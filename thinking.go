package relay

import (
	"bytes"
	"slices"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/caddy-relay/relay/internal/signatures"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
)

// Claude signs the thinking blocks of its answers (a `thinking` block's
// `signature`, a `redacted_thinking` block's encrypted `data`) for the
// account that made them, and an upstream of another account refuses a
// conversation that sends them back: 400 "Invalid `signature` in
// `thinking` block". A channel's signature domain names the accounts whose
// signatures its upstream accepts (Channel.SignatureDomain).
//
// A signature does not say who made it, so the relay learns it: each
// signature of an answer it passes to a client is remembered with the
// domain of the channel that answered, in a bounded table
// (internal/signatures). A request whose thinking blocks the table knows
// goes to channels of their domain; a channel of another domain is a
// candidate only in a group with `thinking_failover strip`, which sends it
// the body without the thinking blocks it did not sign. A signer the table
// does not know (a garbage signature, or one from before a restart) routes
// as any request: the relay prefers nothing, removes nothing, and an
// upstream that refuses it answers the client with its own 400, which cools
// nothing.

// thinkingFailoverStrip is the group's `thinking_failover` that lets a
// signed conversation cross domains, its foreign thinking removed.
const thinkingFailoverStrip = "strip"

// featThinkingSignature names what a signed conversation needs in a
// capability_not_available answer: a channel that can verify its
// signatures.
const featThinkingSignature = "thinking_signature"

// missingSignature is the pick's missing features when no channel of the
// signer's domain is left (shared: nothing writes it).
var missingSignature = []string{featThinkingSignature}

// signatureDomain is a channel's signature domain: its config's, else its
// provider's name with its credential's account (provider.AccountNamer),
// else a domain of its own.
func signatureDomain(cfg *Channel, ch *channel) string {
	if cfg.SignatureDomain != "" {
		return cfg.SignatureDomain
	}
	if a, ok := ch.provider.(provider.AccountNamer); ok {
		if acc := a.Account(); acc != "" {
			return ch.providerName() + ":" + acc
		}
	}
	return ch.providerName() + ":channel:" + cfg.Name
}

// thinkingAsk is what a request's body says of thinking: whether it asks
// for it (its answer may carry signatures to learn), and who signed the
// thinking blocks it carries.
type thinkingAsk struct {
	on     bool   // a `thinking` object that does not disable it
	signed int32  // its signed thinking blocks
	signer string // the domain of the last signed block the relay knows; "": none known
	mixed  bool   // a known block of another domain than signer comes before it
}

// block notes a content block of the body's messages: its type and its
// signature (a thinking block's) or data (a redacted one's), raw.
func (t *thinkingAsk) block(typ, sig, data []byte) {
	raw := signedPart(typ, sig, data)
	if raw == nil {
		return
	}
	t.signed++
	if d := signatures.Learned.DomainOf(signatures.Digest(raw)); d != "" {
		if t.signer != "" && t.signer != d {
			t.mixed = true
		}
		t.signer = d
	}
}

// signedPart is the raw JSON string that identifies a block's signer: a
// thinking block's non-empty signature, a redacted thinking block's data;
// nil for any other block.
func signedPart(typ, sig, data []byte) []byte {
	switch {
	case typ == nil || jsonscan.KindOf(typ) != '"':
		return nil
	case unquoteJSON(typ) == "thinking":
		if len(sig) > 2 && jsonscan.KindOf(sig) == '"' {
			return sig
		}
	case unquoteJSON(typ) == "redacted_thinking":
		if len(data) > 2 && jsonscan.KindOf(data) == '"' {
			return data
		}
	}
	return nil
}

// thinkingOn reports whether a raw `thinking` value asks for thinking: an
// object whose type is not disabled.
func thinkingOn(v []byte) bool {
	return jsonscan.KindOf(v) == '{' && gjson.Get(jsonscan.String(v), "type").Str != "disabled"
}

// signerFor sets what the selection knows of the request's signer: the
// domain whose channels come first, and whether others may serve it
// stripped.
func (in *inbound) signerFor(s *selection, g *group) {
	if in.route == routeMessages && in.ask.thinking.signer != "" {
		s.signer, s.crossSigner = in.ask.thinking.signer, g.stripThinking
	}
}

// signedBy reports whether ch is of the domain that signed the request's
// thinking.
func (s *selection) signedBy(ch *channel) bool { return ch.domain == s.signer }

// signerAllows reports whether ch may serve the request at all: it is of
// its signer's domain, or its group lets it cross (stripped), or no signer
// is known.
func (s *selection) signerAllows(ch *channel) bool {
	return s.signer == "" || s.crossSigner || ch.domain == s.signer
}

// thinkingFor is the signature domain whose thinking blocks alone the
// attempt on ch keeps ("": the body goes as it is): ch's, when its group
// lets the request cross domains and it carries a known block of another
// domain. It counts the stripped attempt.
func (in *inbound) thinkingFor(ch *channel) string {
	s := &in.grant.sel
	if s.signer == "" || !s.crossSigner || (ch.domain == s.signer && !in.ask.thinking.mixed) {
		return ""
	}
	metricThinkingStripped.WithLabelValues(in.group().name).Inc()
	return ch.domain
}

// learnMessage remembers the signatures of a whole (non-streamed) answer
// ch gave: the thinking blocks of its content.
func learnMessage(body []byte, ch *channel) {
	if !bytes.Contains(body, []byte(`"signature"`)) && !bytes.Contains(body, []byte(`"redacted_thinking"`)) {
		return
	}
	gjson.GetBytes(body, "content").ForEach(func(_, b gjson.Result) bool {
		switch b.Get("type").Str {
		case "thinking":
			learnRaw(b.Get("signature").Raw, ch)
		case "redacted_thinking":
			learnRaw(b.Get("data").Raw, ch)
		}
		return true
	})
}

// learnEvent remembers the signature an event of a stream ch answered
// carries: a thinking block's signature_delta, a redacted thinking block's
// data in its content_block_start.
func learnEvent(name, data []byte, ch *channel) {
	s := jsonscan.String(data)
	switch string(name) {
	case "content_block_delta":
		if !strings.Contains(s, `"signature_delta"`) {
			return
		}
		if d := gjson.Get(s, "delta"); d.Get("type").Str == "signature_delta" {
			learnRaw(d.Get("signature").Raw, ch)
		}
	case "content_block_start":
		if !strings.Contains(s, `"redacted_thinking"`) {
			return
		}
		if b := gjson.Get(s, "content_block"); b.Get("type").Str == "redacted_thinking" {
			learnRaw(b.Get("data").Raw, ch)
		}
	}
}

// learnRaw remembers a raw JSON string signature, when it is one, and
// shares it with the fleet the channel's health is shared with.
func learnRaw(raw string, ch *channel) {
	if len(raw) <= 2 || raw[0] != '"' {
		return
	}
	var shared *signatures.Shared
	if f := ch.health.fleet.Load(); f != nil {
		shared = f.signed
	}
	signatures.Learned.Learn(signatures.Digest([]byte(raw)), ch.domain, shared)
}

// errThinkingSignature answers a request whose thinking blocks were signed
// by a domain none of whose channels the group has, in a group that does
// not let it cross (the domain's name is not said: a default one names a
// credential's digest).
func errThinkingSignature(group string) *relayError {
	e := errCapability(missingSignature, false, group)
	e.msg = "this request carries thinking blocks signed by an account no channel of group " + strconv.Quote(group) +
		" can verify (" + featThinkingSignature + "): its upstreams would refuse their signatures. " +
		"Send the conversation without its thinking blocks, or have the group's operator set thinking_failover strip"
	return e
}

// span is a range of a body, [start, end).
type span struct{ start, end int }

// element is one element of a JSON array (or member of an object: start
// at its name) and whether it goes.
type element struct {
	span
	drop bool
}

// dropSpans are the ranges that remove the dropped elements of an array
// (or members of an object) with their commas, leaving valid JSON and
// every other byte as it was: an element followed by another goes up to
// the next one's start; the last goes from the end of the last one kept
// before it.
func dropSpans(out []span, els []element) []span {
	for i, e := range els {
		if !e.drop {
			continue
		}
		if i+1 < len(els) {
			out = append(out, span{e.start, els[i+1].start})
			continue
		}
		from := e.start
		for j := i - 1; j >= 0; j-- {
			if !els[j].drop {
				from = els[j].end
				break
			}
		}
		out = append(out, span{from, e.end})
	}
	return out
}

// stripThinking returns body without the thinking and redacted thinking
// blocks of its messages that domain is not known to have signed. A
// message left with no content goes whole. When the last assistant message
// loses a block and has a tool_use (the request continues a tool loop),
// the body's `thinking` goes too: the API wants that message to start with
// a thinking block while thinking is on, and the only one it had is one
// the new account cannot verify, so that step is answered without
// thinking. Every other byte is the body's. ok is false when nothing was
// removed (or the body is not what inspect accepted).
func stripThinking(body []byte, domain string) (_ []byte, ok bool) {
	sc := scanners.Get().(*jsonscan.Scanner)
	defer func() {
		sc.Reset(nil)
		scanners.Put(sc)
	}()
	sc.Reset(body)
	st := stripper{sc: sc, body: body, domain: domain}
	spans, err := st.object()
	if err != nil || len(spans) == 0 {
		return body, false
	}
	slices.SortFunc(spans, func(a, b span) int { return a.start - b.start })
	out := make([]byte, 0, len(body))
	at := 0
	for _, s := range spans {
		if s.start < at { // it starts in a range removed already
			at = max(at, s.end)
			continue
		}
		out = append(out, body[at:s.start]...)
		at = s.end
	}
	return append(out, body[at:]...), true
}

// stripper is stripThinking's walk of a body.
type stripper struct {
	sc     *jsonscan.Scanner
	body   []byte
	domain string
	spans  []span
	// the last assistant message: whether it lost a block, and whether it
	// has a tool_use
	lastLost, lastTool bool
}

// offset is where raw, a slice of the body, starts in it.
func (st *stripper) offset(raw []byte) int { return cap(st.body) - cap(raw) }

// object walks the top-level object: its messages, and its `thinking`
// member, which goes when the last assistant message's must.
func (st *stripper) object() ([]span, error) {
	sc := st.sc
	if err := sc.ReadObjectStart(); err != nil {
		return nil, err
	}
	var members []element
	thinking := -1
	for {
		name, err := sc.NextName()
		if err != nil {
			return nil, err
		}
		if name == nil {
			break
		}
		start := st.offset(name)
		switch field := unquoteJSON(name); {
		case field == "messages" && sc.PeekKind() == '[':
			if err := st.messages(); err != nil {
				return nil, err
			}
		default:
			if field == "thinking" {
				thinking = len(members)
			}
			if _, err := sc.ReadValue(); err != nil {
				return nil, err
			}
		}
		members = append(members, element{span: span{start, sc.InputOffset()}})
	}
	if len(st.spans) > 0 && st.lastLost && st.lastTool && thinking >= 0 {
		members[thinking].drop = true
		st.spans = dropSpans(st.spans, members)
	}
	return st.spans, nil
}

// messages walks the messages array.
func (st *stripper) messages() error {
	sc := st.sc
	if err := sc.ReadArrayStart(); err != nil {
		return err
	}
	var msgs []element
	for {
		more, err := sc.NextElement()
		if err != nil {
			return err
		}
		if !more {
			break
		}
		if sc.PeekKind() != '{' {
			v, err := sc.ReadValue()
			if err != nil {
				return err
			}
			msgs = append(msgs, element{span: span{st.offset(v), sc.InputOffset()}})
			continue
		}
		if err := sc.ReadObjectStart(); err != nil {
			return err
		}
		start := sc.InputOffset() - 1
		var blocks []element
		var role []byte
		tool := false
		for {
			name, err := sc.NextName()
			if err != nil {
				return err
			}
			if name == nil {
				break
			}
			switch field := unquoteJSON(name); {
			case field == "content" && sc.PeekKind() == '[':
				if blocks, tool, err = st.content(); err != nil {
					return err
				}
			default:
				v, err := sc.ReadValue()
				if err != nil {
					return err
				}
				if field == "role" {
					role = v
				}
			}
		}
		m := element{span: span{start, sc.InputOffset()}}
		lost := slices.ContainsFunc(blocks, func(b element) bool { return b.drop })
		switch {
		case !bytes.Equal(role, []byte(`"assistant"`)):
			// only assistant messages carry thinking the API checks
		case lost && !slices.ContainsFunc(blocks, func(b element) bool { return !b.drop }):
			m.drop = true // nothing would be left of it
			st.lastLost, st.lastTool = true, false
		default:
			if lost {
				st.spans = dropSpans(st.spans, blocks)
			}
			st.lastLost, st.lastTool = lost, tool
		}
		msgs = append(msgs, m)
	}
	st.spans = dropSpans(st.spans, msgs)
	return nil
}

// content walks a message's content blocks: which go (the signed ones
// domain is not known to have signed), and whether one is a tool_use.
func (st *stripper) content() (blocks []element, tool bool, err error) {
	sc := st.sc
	if err := sc.ReadArrayStart(); err != nil {
		return nil, false, err
	}
	for {
		more, err := sc.NextElement()
		if err != nil {
			return nil, false, err
		}
		if !more {
			return blocks, tool, nil
		}
		if sc.PeekKind() != '{' {
			v, err := sc.ReadValue()
			if err != nil {
				return nil, false, err
			}
			blocks = append(blocks, element{span: span{st.offset(v), sc.InputOffset()}})
			continue
		}
		if err := sc.ReadObjectStart(); err != nil {
			return nil, false, err
		}
		start := sc.InputOffset() - 1
		var typ, sig, data []byte
		for {
			name, err := sc.NextName()
			if err != nil {
				return nil, false, err
			}
			if name == nil {
				break
			}
			v, err := sc.ReadValue()
			if err != nil {
				return nil, false, err
			}
			switch unquoteJSON(name) {
			case "type":
				typ = v
			case "signature":
				sig = v
			case "data":
				data = v
			}
		}
		b := element{span: span{start, sc.InputOffset()}}
		if raw := signedPart(typ, sig, data); raw != nil {
			b.drop = signatures.Learned.DomainOf(signatures.Digest(raw)) != st.domain
		} else if jsonscan.KindOf(typ) == '"' && unquoteJSON(typ) == "thinking" {
			b.drop = true // an unsigned thinking block: no upstream verifies it
		}
		tool = tool || jsonscan.KindOf(typ) == '"' && unquoteJSON(typ) == "tool_use"
		blocks = append(blocks, b)
	}
}

// signature turns a pick without a capable channel into one without a
// channel of the signer's domain.
func (p pickResult) signature() pickResult {
	if p.reason == noCapability {
		p.missing = missingSignature
	}
	return p
}
