package provider

import (
	"slices"
	"strings"
)

// Support is what an upstream wire does with a feature: a top-level body
// field, a server tool, a prompt longer than the standard context window
// (long_context), or an anthropic-beta value. The relay sends a request
// only to channels whose wire supports every feature it carries.
type Support uint8

const (
	// Unsupported: the wire refuses a request that carries it (or would
	// serve something else).
	Unsupported Support = iota
	// Supported: the wire takes it as the client sent it.
	Supported
	// OptIn: the wire takes it, but only some accounts may use it (or it
	// costs more): a channel takes it when its config says `supports`.
	OptIn
	// Strip: the channel takes the request without it: the relay removes
	// it before sending. Only a channel's config says so, never a wire.
	Strip
)

var supportNames = [...]string{"no", "yes", "opt-in", "strip"}

// String is the Support's name in the feature table of the docs: no, yes,
// opt-in or strip.
func (s Support) String() string { return supportNames[s] }

// FeatureSupport is implemented by a provider that knows which features
// its wire supports: its column of the relay's feature table. A provider
// without it is taken to support every feature, and its upstream's
// refusals teach the relay what it lacks.
type FeatureSupport interface {
	// Supports says what the wire does with the feature named name: a
	// name of the feature table (service_tier, web_search, long_context,
	// a beta it lists...), or an anthropic-beta value the table does not
	// list (IsBeta tells them apart).
	Supports(name string) Support
}

// Column is a wire's column of the feature table, for a provider's
// Supports: what it does by default, and the features on which it differs.
type Column struct {
	// Default is what the wire does with a feature Features does not
	// name, betas the table does not list included.
	Default Support
	// Features lists what the wire does with the features on which it
	// differs from Default, by name.
	Features map[string]Support
	// Betas, when set, replaces what the column says of every beta: the
	// wire takes the betas it lists (`*`: every one) and refuses the
	// others. A cloud channel's `betas` option sets it.
	Betas []string
	// Strip lists features the channel strips whatever the wire does (a
	// cloud channel's `strip_fields`).
	Strip []string
}

// AnthropicWire is the column of Anthropic's own API: it takes every
// feature as sent, but the opt-in fields (service_tier, inference_geo,
// speed), which a channel takes only when its config says it supports
// them. A provider that speaks Anthropic's wire (Anthropic, a reseller
// that passes it through, an in-process imitation) answers with it.
var AnthropicWire = Column{
	Default: Supported,
	Features: map[string]Support{
		"service_tier":  OptIn,
		"inference_geo": OptIn,
		"speed":         OptIn,
	},
}

// Supports implements FeatureSupport.
func (c *Column) Supports(name string) Support {
	if slices.Contains(c.Strip, name) {
		return Strip
	}
	if len(c.Betas) > 0 && IsBeta(name) {
		if slices.Contains(c.Betas, "*") || slices.Contains(c.Betas, name) {
			return Supported
		}
		return Unsupported
	}
	if s, ok := c.Features[name]; ok {
		return s
	}
	return c.Default
}

// IsBeta reports whether a feature's name is an anthropic-beta value: the
// table's fields, tools and context are snake_case, betas have hyphens.
func IsBeta(name string) bool { return strings.Contains(name, "-") }

// RefusalReader is implemented by a provider whose upstream refuses a
// feature it does not support in words other than Anthropic's API's. The
// relay reads Anthropic's words itself ("<field>: Extra inputs are not
// permitted", "Unexpected value(s) `<beta>` for the `anthropic-beta`
// header", "tools.<i>: Input tag '<type>' ..."), and a provider without a
// RefusalReader is taken to use them.
type RefusalReader interface {
	// ReadRefusal reads the message of a 400 answer (its error.message,
	// after Response): what it says the wire does not support. Only the
	// start of a message may count: upstreams echo the client's values
	// later in theirs, and a client must not be able to write its way
	// into a channel's lacks. The zero Refusal says nothing of the kind.
	ReadRefusal(message string) Refusal
}

// Refusal is what a 400's message says a wire does not support. The relay
// learns only the features among them that the request carried.
type Refusal struct {
	// Fields are top-level body fields the message names.
	Fields []string
	// Tools are the types of server tools the message names.
	Tools []string
	// Betas are anthropic-beta values the message names.
	Betas []string
	// SomeBeta says that the message refuses one of the request's betas
	// without saying which.
	SomeBeta bool
}
