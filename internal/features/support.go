package features

import (
	"fmt"
	"math/bits"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// stripOtherBetas is the `strip` value that drops, instead of refusing,
// the betas a channel lacks.
const stripOtherBetas = "unsupported_betas"

// Channel is what a channel does with each feature: its provider's
// wire says (the feature table, or the provider's own answer), then the
// channel's `supports`, `lacks` and `strip` lines, which win.
//
// The table's betas are answered by their row, found through the table's
// own index, not from a map of each channel's: a map per channel held the
// same answers a thousand times over in a config of a thousand channels
// (1.8 KB a channel, and a quarter of its provisioning time).
type Channel struct {
	takes  Set // known features it takes as sent
	strips Set // known features it removes
	// tableBetas is what it does with each beta of the feature table, by
	// the beta's row (the rows of the known features are unused):
	// provider.Supported, provider.Unsupported or provider.Strip
	tableBetas []provider.Support
	// configBetas is what it does with the betas its config names that
	// the table does not; nil when there are none
	configBetas map[string]provider.Support
	// wire answers for the betas nothing names; nil: every one is
	// supported
	wire            provider.FeatureSupport
	stripOtherBetas bool // `strip unsupported_betas`
	// refusals reads its provider's refusals of a feature; nil: they are
	// in Anthropic's words (see Lacked)
	refusals provider.RefusalReader
}

// NewChannel resolves a channel's features from its provider and
// its lines (validated already).
func NewChannel(p provider.Provider, supports, lacks, strip []string) Channel {
	f := Channel{tableBetas: make([]provider.Support, len(table))}
	f.refusals, _ = p.(provider.RefusalReader)
	fs, _ := p.(provider.FeatureSupport)
	f.wire = fs
	wire := func(name string) provider.Support {
		if fs == nil {
			return provider.Supported
		}
		return fs.Supports(name)
	}
	for i, r := range table {
		s := wire(r.name)
		if s == provider.OptIn {
			s = provider.Unsupported
		}
		if r.kind == KindBeta {
			f.tableBetas[i] = s
			continue
		}
		switch s {
		case provider.Supported:
			f.takes |= 1 << i
		case provider.Strip:
			f.strips |= 1 << i
		}
	}
	set := func(names []string, s provider.Support) {
		for _, name := range names {
			if name == stripOtherBetas {
				f.stripOtherBetas = true
				continue
			}
			if b := Bit(name); b != 0 {
				f.takes &^= b
				f.strips &^= b
				switch s {
				case provider.Supported:
					f.takes |= b
				case provider.Strip:
					f.strips |= b
				}
				continue
			}
			if i, ok := tableBeta(name); ok {
				f.tableBetas[i] = s
				continue
			}
			if f.configBetas == nil {
				f.configBetas = map[string]provider.Support{}
			}
			f.configBetas[name] = s
		}
	}
	set(supports, provider.Supported)
	set(lacks, provider.Unsupported)
	set(strip, provider.Strip)
	return f
}

// Takes is the known features the channel takes as sent.
func (f *Channel) Takes() Set { return f.takes }

// Strips is the known features the channel removes.
func (f *Channel) Strips() Set { return f.strips }

// StripsOtherBetas says the channel drops, instead of refusing, the betas
// it lacks (`strip unsupported_betas`).
func (f *Channel) StripsOtherBetas() bool { return f.stripOtherBetas }

// Refusals reads the refusals of a feature by the channel's provider; nil:
// they are in Anthropic's words (see Lacked).
func (f *Channel) Refusals() provider.RefusalReader { return f.refusals }

// Beta is what the channel's config and wire do with an anthropic-beta
// value.
func (f *Channel) Beta(flag string) provider.Support {
	s, ok := f.lookup(flag)
	if !ok {
		s = provider.Supported
		if f.wire != nil {
			if s = f.wire.Supports(flag); s == provider.OptIn {
				s = provider.Unsupported
			}
		}
	}
	if s == provider.Unsupported && f.stripOtherBetas {
		return provider.Strip
	}
	return s
}

// Named reports whether the table or the channel's config names each beta
// among features (the other features are all in the table) as one the
// channel takes.
func (f *Channel) Named(features []string) bool {
	for _, name := range features {
		if Bit(name) != 0 {
			continue
		}
		if s, ok := f.lookup(name); !ok || s == provider.Unsupported {
			return false
		}
	}
	return true
}

// lookup is what the channel does with the beta flag when the table or its
// config names it.
func (f *Channel) lookup(flag string) (provider.Support, bool) {
	if i, ok := tableBeta(flag); ok {
		return f.tableBetas[i], true
	}
	s, ok := f.configBetas[flag]
	return s, ok
}

// tableBeta is the row of the feature table that lists the beta flag.
func tableBeta(flag string) (int, bool) {
	i, ok := byName[flag]
	return i, ok && table[i].kind == KindBeta
}

// CheckNames validates the names of a `supports`, `lacks` or
// `strip` line (the option's name is opt).
func CheckNames(opt string, names []string) error {
	for _, name := range names {
		switch {
		case name == stripOtherBetas && opt == "strip":
		case Bit(name) == LongContext && opt == "strip":
			return fmt.Errorf("strip: long_context cannot be stripped: a long prompt stays long")
		case Bit(name) != 0, datedBeta(name):
		default:
			return fmt.Errorf("%s: unknown feature %q: a body field, server tool or context of the feature table (%s), or an anthropic-beta value, which ends with its date (context-1m-2025-08-07)", opt, name, strings.Join(knownNames(), ", "))
		}
	}
	return nil
}

// knownNames lists the bit-numbered features.
func knownNames() []string { return (Set(1)<<numKnown - 1).Names() }

// lowBit is the index of the lowest bit of a non-empty set.
func lowBit(s Set) int { return bits.TrailingZeros32(uint32(s)) }

// StripBody removes the known features of set from a Messages body: top-level
// fields, and server tools from `tools` (which goes when none is left).
func StripBody(body []byte, set Set) ([]byte, error) {
	out := body
	var err error
	for s := set; s != 0; s &= s - 1 {
		r := &table[lowBit(s)]
		switch r.kind {
		case KindField:
			if out, err = sjson.DeleteBytes(out, r.name); err != nil {
				return nil, err
			}
		case KindTool:
			if out, err = stripTools(out, r.prefix); err != nil {
				return nil, err
			}
		}
	}
	return out, nil
}

// stripTools removes the tools whose type starts with prefix.
func stripTools(body []byte, prefix string) ([]byte, error) {
	tools := gjson.GetBytes(body, "tools")
	if !tools.IsArray() {
		return body, nil
	}
	kept := make([]byte, 0, len(tools.Raw))
	kept = append(kept, '[')
	n := 0
	tools.ForEach(func(_, t gjson.Result) bool {
		if !strings.HasPrefix(t.Get("type").String(), prefix) {
			if n > 0 {
				kept = append(kept, ',')
			}
			kept = append(kept, t.Raw...)
			n++
		}
		return true
	})
	if n == 0 {
		return sjson.DeleteBytes(body, "tools")
	}
	return sjson.SetRawBytes(body, "tools", append(kept, ']'))
}

// StripBetas returns a copy of h whose anthropic-beta values leave out
// drop.
func StripBetas(h http.Header, drop []string) http.Header {
	out := h.Clone()
	var keep []string
	for _, v := range h.Values("Anthropic-Beta") {
		for flag := range strings.SplitSeq(v, ",") {
			if flag = strings.TrimSpace(flag); flag != "" && !slices.Contains(drop, flag) && !slices.Contains(keep, flag) {
				keep = append(keep, flag)
			}
		}
	}
	out.Del("Anthropic-Beta")
	if len(keep) > 0 {
		out.Set("Anthropic-Beta", strings.Join(keep, ","))
	}
	return out
}

// The starts of the messages with which Anthropic's API refuses a feature
// it does not support; the rest of the message names it. Only the start
// counts, and only a feature the request carried is learned: a client
// cannot write its way into another channel's list. A provider whose wire
// words its refusals otherwise reads them itself (provider.RefusalReader).
const (
	wordExtraInput = ": Extra inputs are not permitted" // "<field>: Extra inputs are not permitted"
	wordUnexpected = "Unexpected value(s) "             // "Unexpected value(s) `a`, `b` for the `anthropic-beta` header..."
	wordBetaHeader = " for the `anthropic-beta` header" //
	wordToolTag    = ": Input tag '"                    // "tools.<i>: Input tag '<type>' found using 'type' does not match..."
)

// The sentences with which Anthropic's API refuses a request for long
// context that the account is not entitled to (a subscription without
// extra usage): a 429 rate_limit_error, though nothing is busy, or a 400.
// The message must start with one of them: an upstream's message that
// quotes a client's words elsewhere is not a refusal of long context.
var longContextRefusals = [...]string{
	"Extra usage is required for long context requests",
	"Usage credits are required for long context requests",
	"The long context beta is not yet available for this subscription",
}

// LongContextBetaPrefix starts the anthropic-beta values that ask for a
// long context (context-1m-2025-08-07).
const LongContextBetaPrefix = "context-1m-"

// LongContextRefused reports whether an upstream's error answer of status
// refuses long context to the channel's account.
func LongContextRefused(status int, body []byte) bool {
	switch status {
	case http.StatusBadRequest, http.StatusForbidden, http.StatusTooManyRequests:
	default:
		return false
	}
	msg := gjson.GetBytes(body, "error.message").String()
	for _, s := range longContextRefusals {
		if strings.HasPrefix(msg, s) {
			return true
		}
	}
	return false
}

// anthropicRefusal reads a refusal in Anthropic's words.
func anthropicRefusal(msg string) provider.Refusal {
	if name, _, ok := strings.Cut(msg, wordExtraInput); ok {
		return provider.Refusal{Fields: []string{name}} // the message starts with the field's name
	}
	if rest, ok := strings.CutPrefix(msg, wordUnexpected); ok {
		values, _, found := strings.Cut(rest, wordBetaHeader)
		if !found {
			return provider.Refusal{}
		}
		var r provider.Refusal
		for v := range strings.SplitSeq(values, ",") {
			r.Betas = append(r.Betas, strings.Trim(strings.TrimSpace(v), "`"))
		}
		return r
	}
	if at, rest, ok := strings.Cut(msg, wordToolTag); ok && strings.HasPrefix(at, "tools.") {
		if _, err := strconv.Atoi(at[len("tools."):]); err != nil {
			return provider.Refusal{}
		}
		if typ, _, found := strings.Cut(rest, "'"); found {
			return provider.Refusal{Tools: []string{typ}}
		}
	}
	return provider.Refusal{}
}

// Lacked returns the features that a 400 error body from a
// channel says, in its provider's words (read by reader; nil: Anthropic's),
// its wire does not support, among the features n carries; none when the
// message is anything else. The names it returns share no memory with the
// body or the request (they are kept for capability_ttl), and a beta's is
// at most MaxBetaName bytes. certain says that the message names them;
// when it does not (one of the betas, unnamed), they are the candidates
// among which one is refused.
func Lacked(reader provider.RefusalReader, body []byte, n Needs) (lacked []string, certain bool) {
	msg := gjson.GetBytes(body, "error.message").String()
	var r provider.Refusal
	if reader != nil {
		r = reader.ReadRefusal(msg)
	} else {
		r = anthropicRefusal(msg)
	}
	for _, name := range r.Fields {
		if b := Bit(name); b != 0 && table[lowBit(b)].kind == KindField && n.Set&b != 0 && !slices.Contains(lacked, name) {
			lacked = append(lacked, table[lowBit(b)].name)
		}
	}
	for _, typ := range r.Tools {
		if b := OfTool(typ); b != 0 && n.Set&b != 0 && !slices.Contains(lacked, table[lowBit(b)].name) {
			lacked = append(lacked, table[lowBit(b)].name)
		}
	}
	beta := func(flag string) {
		if len(flag) <= MaxBetaName && n.HasBeta(flag) && !slices.Contains(lacked, flag) {
			lacked = append(lacked, strings.Clone(flag))
		}
	}
	for _, flag := range r.Betas {
		beta(flag)
	}
	if len(lacked) > 0 {
		return lacked, true
	}
	if r.SomeBeta {
		// the wire does not say which flag: one of those the request
		// carried, certain only when it carried one
		for _, b := range n.Betas {
			beta(b)
		}
		return lacked, len(lacked) == 1
	}
	return nil, false
}
