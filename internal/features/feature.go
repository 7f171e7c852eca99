// Package features is the feature table: what a request can use that not
// every upstream wire supports, what a request needs, what a channel does
// with each feature by its provider's column and its config, and the
// upstreams' refusals of a feature.
//
// A feature is something a request can use that not every upstream wire
// supports: a top-level body field, a server tool, a prompt longer than
// the standard context window, or an anthropic-beta value. A request needs
// every feature it carries, and goes only to channels that support them
// all (or that are configured to strip one): no field or beta a client
// sent is ever dropped silently. Which channels those are is the relay's
// to choose, with what each channel learned it lacks.
package features

import (
	"net/http"
	"strings"
)

// Kind is what in a request carries a feature.
type Kind uint8

// The kinds of features.
const (
	KindField   Kind = iota + 1 // a top-level body field with a non-null value
	KindTool                    // a server tool, by the prefix of its `type`
	KindContext                 // an estimated prompt above the standard context window
	KindBeta                    // an anthropic-beta header value
)

var kindNames = [...]string{KindField: "field", KindTool: "server tool", KindContext: "context", KindBeta: "beta"}

// String is the kind's name in the feature table of the docs.
func (k Kind) String() string { return kindNames[k] }

// row is one row of the feature table: a feature the relay knows.
// What each wire does with it is its provider's to say
// (provider.FeatureSupport): each built-in provider holds its column.
// docs/providers.md holds the table with every built-in provider's column
// and the source of each row; a test keeps the two equal.
type row struct {
	name   string
	kind   Kind
	prefix string // KindTool: the prefix of the tool's type
}

// table lists the features the relay knows. Fields, tools and the
// long context are the known, bit-numbered features (in this order); the
// betas are named by their header value, and a provider says what its wire
// does with a beta the table does not list.
var table = []row{
	{name: "service_tier", kind: KindField},
	{name: "inference_geo", kind: KindField},
	{name: "speed", kind: KindField},
	{name: "mcp_servers", kind: KindField},
	{name: "container", kind: KindField},
	{name: "context_management", kind: KindField},
	{name: "cache_control", kind: KindField},
	{name: "output_config", kind: KindField},
	{name: "web_search", kind: KindTool, prefix: "web_search_"},
	{name: "web_fetch", kind: KindTool, prefix: "web_fetch_"},
	{name: "code_execution", kind: KindTool, prefix: "code_execution_"},
	{name: "tool_search", kind: KindTool, prefix: "tool_search_tool_"},
	{name: "long_context", kind: KindContext},

	{name: "advanced-tool-use-2025-11-20", kind: KindBeta},
	{name: "claude-code-20250219", kind: KindBeta},
	{name: "code-execution-2025-05-22", kind: KindBeta},
	{name: "code-execution-2025-08-25", kind: KindBeta},
	{name: "compact-2026-01-12", kind: KindBeta},
	{name: "computer-use-2024-10-22", kind: KindBeta},
	{name: "computer-use-2025-01-24", kind: KindBeta},
	{name: "context-1m-2025-08-07", kind: KindBeta},
	{name: "context-management-2025-06-27", kind: KindBeta},
	{name: "dev-full-thinking-2025-05-14", kind: KindBeta},
	{name: "effort-2025-11-24", kind: KindBeta},
	{name: "extended-cache-ttl-2025-04-11", kind: KindBeta},
	{name: "fast-mode-2026-02-01", kind: KindBeta},
	{name: "files-api-2025-04-14", kind: KindBeta},
	{name: "fine-grained-tool-streaming-2025-05-14", kind: KindBeta},
	{name: "interleaved-thinking-2025-05-14", kind: KindBeta},
	{name: "mcp-client-2025-04-04", kind: KindBeta},
	{name: "mcp-client-2025-11-20", kind: KindBeta},
	{name: "memory-2025-08-18", kind: KindBeta},
	{name: "model-context-window-exceeded-2025-08-26", kind: KindBeta},
	{name: "oauth-2025-04-20", kind: KindBeta},
	{name: "output-128k-2025-02-19", kind: KindBeta},
	{name: "pdfs-2024-09-25", kind: KindBeta},
	{name: "prompt-caching-2024-07-31", kind: KindBeta},
	{name: "prompt-caching-scope-2026-01-05", kind: KindBeta},
	{name: "search-results-2025-06-09", kind: KindBeta},
	{name: "skills-2025-10-02", kind: KindBeta},
	{name: "structured-outputs-2025-11-13", kind: KindBeta},
	{name: "token-counting-2024-11-01", kind: KindBeta},
	{name: "token-efficient-tools-2025-02-19", kind: KindBeta},
	{name: "tool-search-tool-2025-10-19", kind: KindBeta},
	{name: "web-fetch-2025-09-10", kind: KindBeta},
	{name: "web-search-2025-03-05", kind: KindBeta},
}

// Set is a set of the known, bit-numbered features: the table's
// rows that are not betas, bit i for row i.
type Set uint32

// Names lists every feature of the table, in table order.
func Names() []string {
	out := make([]string, len(table))
	for i, r := range table {
		out[i] = r.name
	}
	return out
}

// KindOf is what carries the feature of the table named name; 0 for a name
// the table does not list.
func KindOf(name string) Kind {
	if i, ok := byName[name]; ok {
		return table[i].kind
	}
	return 0
}

// numKnown is how many features have a bit.
var numKnown = func() int {
	n := 0
	for n < len(table) && table[n].kind != KindBeta {
		n++
	}
	return n
}()

// byName indexes the table.
var byName = func() map[string]int {
	m := make(map[string]int, len(table))
	for i, r := range table {
		m[r.name] = i
	}
	return m
}()

// Bit returns the bit of a known feature, or 0 (a beta, or no feature).
func Bit(name string) Set {
	if i, ok := byName[name]; ok && i < numKnown {
		return 1 << i
	}
	return 0
}

// Bits of the features the inspection sets by hand.
var (
	LongContext = Bit("long_context")
)

// Names lists the features of s, in table order.
func (s Set) Names() []string {
	var out []string
	for s != 0 {
		i := lowBit(s)
		out = append(out, table[i].name)
		s &^= 1 << i
	}
	return out
}

// First is the name of the first feature of a non-empty set, in table
// order.
func (s Set) First() string { return table[lowBit(s)].name }

// OfField is the feature a top-level body field carries, or 0. It is
// a switch, not a map lookup: it runs for every field of every request.
func OfField(name string) Set {
	switch name {
	case "service_tier", "inference_geo", "speed", "mcp_servers", "container",
		"context_management", "cache_control", "output_config":
		return Bit(name)
	}
	return 0
}

// OfTool is the server tool a tool's type names, or 0.
func OfTool(typ string) Set {
	for i := range numKnown {
		if r := &table[i]; r.kind == KindTool && strings.HasPrefix(typ, r.prefix) {
			return 1 << i
		}
	}
	return 0
}

// LongContextTokens is the standard context window: a prompt estimated
// above it needs a long context (a 1M window).
const LongContextTokens = 200_000

// MaxBetas bounds the distinct anthropic-beta values a request may carry.
const MaxBetas = 64

// MaxBetaName bounds a beta's name, in the config and among what a channel
// learns it lacks.
const MaxBetaName = 128

// Needs is what a request needs of a channel.
type Needs struct {
	Set   Set      // the known features it carries
	Betas []string // distinct anthropic-beta values, as the client sent them
}

// Empty reports whether the request needs no feature.
func (n Needs) Empty() bool { return n.Set == 0 && len(n.Betas) == 0 }

// Names lists every needed feature: the known ones in table order, then
// the betas.
func (n Needs) Names() []string { return append(n.Set.Names(), n.Betas...) }

// ReadBetas adds the request's anthropic-beta values (comma-separated,
// possibly repeated headers) to n, each once. The strings share the
// header's memory. It reports false when there are more than MaxBetas.
func (n *Needs) ReadBetas(h http.Header) bool {
	for _, v := range h["Anthropic-Beta"] {
		for v != "" {
			var flag string
			flag, v, _ = strings.Cut(v, ",")
			if flag = strings.TrimSpace(flag); flag == "" || n.HasBeta(flag) {
				continue
			}
			if len(n.Betas) == MaxBetas {
				return false
			}
			n.Betas = append(n.Betas, flag)
		}
	}
	return true
}

// HasBeta reports whether the request carries the beta flag.
func (n Needs) HasBeta(flag string) bool {
	for _, b := range n.Betas {
		if b == flag {
			return true
		}
	}
	return false
}

// isBetaName reports whether name has the shape of an anthropic-beta
// value: lower-case letters, digits and hyphens, with at least one hyphen
// (the table's other features are snake_case).
func isBetaName(name string) bool {
	if name == "" || len(name) > MaxBetaName || !strings.Contains(name, "-") {
		return false
	}
	for _, c := range []byte(name) {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

// datedBeta reports whether name has the shape of an anthropic-beta value
// and ends with its date (-2025-08-07, or -20250219): the config takes only
// those, so that a misspelt field (mcp-servers) is an error, not a beta.
func datedBeta(name string) bool {
	if !isBetaName(name) {
		return false
	}
	digits := func(s string) bool {
		for _, c := range []byte(s) {
			if c < '0' || c > '9' {
				return false
			}
		}
		return s != ""
	}
	if n := len(name); n > 11 && name[n-11] == '-' && name[n-6] == '-' && name[n-3] == '-' &&
		digits(name[n-10:n-6]) && digits(name[n-5:n-3]) && digits(name[n-2:]) {
		return true
	}
	i := strings.LastIndexByte(name, '-')
	return len(name)-i-1 == 8 && digits(name[i+1:])
}

// Label is the value of the feature label of a metric: a name from
// the table, or "other", so that clients cannot grow the label's values.
func Label(name string) string {
	if _, ok := byName[name]; ok {
		return name
	}
	return "other"
}
