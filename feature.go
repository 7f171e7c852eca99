package relay

import (
	"net/http"
	"strings"
)

// A feature is something a request can use that not every upstream wire
// supports: a top-level body field, a server tool, a prompt longer than
// the standard context window, or an anthropic-beta value. A request needs
// every feature it carries, and goes only to channels that support them
// all (or that are configured to strip one): no field or beta a client
// sent is ever dropped silently.

// featureKind is what in a request carries a feature.
type featureKind uint8

const (
	kindField   featureKind = iota + 1 // a top-level body field with a non-null value
	kindTool                           // a server tool, by the prefix of its `type`
	kindContext                        // an estimated prompt above the standard context window
	kindBeta                           // an anthropic-beta header value
)

var kindNames = [...]string{kindField: "field", kindTool: "server tool", kindContext: "context", kindBeta: "beta"}

func (k featureKind) String() string { return kindNames[k] }

// featureRow is one row of the feature table: a feature the relay knows.
// What each wire does with it is its provider's to say
// (provider.FeatureSupport): each built-in provider holds its column.
// docs/providers.md holds the table with every built-in provider's column
// and the source of each row; a test keeps the two equal.
type featureRow struct {
	name   string
	kind   featureKind
	prefix string // kindTool: the prefix of the tool's type
}

// featureTable lists the features the relay knows. Fields, tools and the
// long context are the known, bit-numbered features (in this order); the
// betas are named by their header value, and a provider says what its wire
// does with a beta the table does not list.
var featureTable = []featureRow{
	{name: "service_tier", kind: kindField},
	{name: "inference_geo", kind: kindField},
	{name: "speed", kind: kindField},
	{name: "mcp_servers", kind: kindField},
	{name: "container", kind: kindField},
	{name: "context_management", kind: kindField},
	{name: "cache_control", kind: kindField},
	{name: "output_config", kind: kindField},
	{name: "web_search", kind: kindTool, prefix: "web_search_"},
	{name: "web_fetch", kind: kindTool, prefix: "web_fetch_"},
	{name: "code_execution", kind: kindTool, prefix: "code_execution_"},
	{name: "tool_search", kind: kindTool, prefix: "tool_search_tool_"},
	{name: "long_context", kind: kindContext},

	{name: "advanced-tool-use-2025-11-20", kind: kindBeta},
	{name: "claude-code-20250219", kind: kindBeta},
	{name: "code-execution-2025-05-22", kind: kindBeta},
	{name: "code-execution-2025-08-25", kind: kindBeta},
	{name: "compact-2026-01-12", kind: kindBeta},
	{name: "computer-use-2024-10-22", kind: kindBeta},
	{name: "computer-use-2025-01-24", kind: kindBeta},
	{name: "context-1m-2025-08-07", kind: kindBeta},
	{name: "context-management-2025-06-27", kind: kindBeta},
	{name: "dev-full-thinking-2025-05-14", kind: kindBeta},
	{name: "effort-2025-11-24", kind: kindBeta},
	{name: "extended-cache-ttl-2025-04-11", kind: kindBeta},
	{name: "fast-mode-2026-02-01", kind: kindBeta},
	{name: "files-api-2025-04-14", kind: kindBeta},
	{name: "fine-grained-tool-streaming-2025-05-14", kind: kindBeta},
	{name: "interleaved-thinking-2025-05-14", kind: kindBeta},
	{name: "mcp-client-2025-04-04", kind: kindBeta},
	{name: "mcp-client-2025-11-20", kind: kindBeta},
	{name: "memory-2025-08-18", kind: kindBeta},
	{name: "model-context-window-exceeded-2025-08-26", kind: kindBeta},
	{name: "oauth-2025-04-20", kind: kindBeta},
	{name: "output-128k-2025-02-19", kind: kindBeta},
	{name: "pdfs-2024-09-25", kind: kindBeta},
	{name: "prompt-caching-2024-07-31", kind: kindBeta},
	{name: "prompt-caching-scope-2026-01-05", kind: kindBeta},
	{name: "search-results-2025-06-09", kind: kindBeta},
	{name: "skills-2025-10-02", kind: kindBeta},
	{name: "structured-outputs-2025-11-13", kind: kindBeta},
	{name: "token-counting-2024-11-01", kind: kindBeta},
	{name: "token-efficient-tools-2025-02-19", kind: kindBeta},
	{name: "tool-search-tool-2025-10-19", kind: kindBeta},
	{name: "web-fetch-2025-09-10", kind: kindBeta},
	{name: "web-search-2025-03-05", kind: kindBeta},
}

// featureSet is a set of the known, bit-numbered features: the table's
// rows that are not betas, bit i for row i.
type featureSet uint32

// numKnown is how many features have a bit.
var numKnown = func() int {
	n := 0
	for n < len(featureTable) && featureTable[n].kind != kindBeta {
		n++
	}
	return n
}()

// featureByName indexes the table.
var featureByName = func() map[string]int {
	m := make(map[string]int, len(featureTable))
	for i, r := range featureTable {
		m[r.name] = i
	}
	return m
}()

// bitOf returns the bit of a known feature, or 0 (a beta, or no feature).
func bitOf(name string) featureSet {
	if i, ok := featureByName[name]; ok && i < numKnown {
		return 1 << i
	}
	return 0
}

// Bits of the features the inspection sets by hand.
var (
	featLongContext = bitOf("long_context")
)

// names lists the features of s, in table order.
func (s featureSet) names() []string {
	var out []string
	for s != 0 {
		i := lowBit(s)
		out = append(out, featureTable[i].name)
		s &^= 1 << i
	}
	return out
}

// fieldFeature is the feature a top-level body field carries, or 0. It is
// a switch, not a map lookup: it runs for every field of every request.
func fieldFeature(name string) featureSet {
	switch name {
	case "service_tier", "inference_geo", "speed", "mcp_servers", "container",
		"context_management", "cache_control", "output_config":
		return bitOf(name)
	}
	return 0
}

// toolFeature is the server tool a tool's type names, or 0.
func toolFeature(typ string) featureSet {
	for i := range numKnown {
		if r := &featureTable[i]; r.kind == kindTool && strings.HasPrefix(typ, r.prefix) {
			return 1 << i
		}
	}
	return 0
}

// longContextTokens is the standard context window: a prompt estimated
// above it needs a long context (a 1M window).
const longContextTokens = 200_000

// maxBetas bounds the distinct anthropic-beta values a request may carry.
const maxBetas = 64

// maxBetaName bounds a beta's name, in the config and among what a channel
// learns it lacks.
const maxBetaName = 128

// needs is what a request needs of a channel.
type needs struct {
	set   featureSet
	betas []string // distinct anthropic-beta values, as the client sent them
}

func (n *needs) empty() bool { return n.set == 0 && len(n.betas) == 0 }

// names lists every needed feature: the known ones in table order, then
// the betas.
func (n *needs) names() []string { return append(n.set.names(), n.betas...) }

// readBetas adds the request's anthropic-beta values (comma-separated,
// possibly repeated headers) to n, each once. The strings share the
// header's memory. It reports false when there are more than maxBetas.
func (n *needs) readBetas(h http.Header) bool {
	for _, v := range h["Anthropic-Beta"] {
		for v != "" {
			var flag string
			flag, v, _ = strings.Cut(v, ",")
			if flag = strings.TrimSpace(flag); flag == "" || n.hasBeta(flag) {
				continue
			}
			if len(n.betas) == maxBetas {
				return false
			}
			n.betas = append(n.betas, flag)
		}
	}
	return true
}

func (n *needs) hasBeta(flag string) bool {
	for _, b := range n.betas {
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
	if name == "" || len(name) > maxBetaName || !strings.Contains(name, "-") {
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

// featureLabel is the value of the feature label of a metric: a name from
// the table, or "other", so that clients cannot grow the label's values.
func featureLabel(name string) string {
	if _, ok := featureByName[name]; ok {
		return name
	}
	return "other"
}
