package relay

import (
	"net/http"
	"slices"
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

// Support is what an upstream wire does with a feature.
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
	// it before sending. Only a channel's config says so, never a default.
	Strip
)

var supportNames = [...]string{"no", "yes", "opt-in", "strip"}

func (s Support) String() string { return supportNames[s] }

// FeatureSupport is implemented by a provider that knows which features
// its wire supports; the built-in providers answer from the feature
// table. A provider without it is taken to support every feature, and its
// upstream's refusals teach the relay what it lacks.
type FeatureSupport interface {
	// Supports says what the wire does with the feature named name: a
	// name of the feature table, or an anthropic-beta value it does not
	// list.
	Supports(name string) Support
}

// featureRow is one row of the feature table: a feature and what each
// built-in provider's wire does with it. The mock provider imitates
// Anthropic's API and answers as anthropic does. docs/providers.md holds
// the same table with the source of each row; a test keeps the two equal.
type featureRow struct {
	name                       string
	kind                       featureKind
	anthropic, bedrock, vertex Support
	prefix                     string // kindTool: the prefix of the tool's type
}

// Shorthands for the table.
const (
	yes   = Supported
	no    = Unsupported
	optIn = OptIn
)

// featureTable lists the features the relay knows. Fields, tools and the
// long context are the known, bit-numbered features (in this order); the
// betas are named by their header value, and a beta the table does not
// list takes its provider's default (otherBetas).
var featureTable = []featureRow{
	{name: "service_tier", kind: kindField, anthropic: optIn, bedrock: no, vertex: no},
	{name: "inference_geo", kind: kindField, anthropic: optIn, bedrock: no, vertex: no},
	{name: "speed", kind: kindField, anthropic: optIn, bedrock: no, vertex: no},
	{name: "mcp_servers", kind: kindField, anthropic: yes, bedrock: no, vertex: no},
	{name: "container", kind: kindField, anthropic: yes, bedrock: no, vertex: no},
	{name: "context_management", kind: kindField, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "cache_control", kind: kindField, anthropic: yes, bedrock: no, vertex: yes},
	{name: "output_config", kind: kindField, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "web_search", kind: kindTool, prefix: "web_search_", anthropic: yes, bedrock: no, vertex: yes},
	{name: "web_fetch", kind: kindTool, prefix: "web_fetch_", anthropic: yes, bedrock: no, vertex: no},
	{name: "code_execution", kind: kindTool, prefix: "code_execution_", anthropic: yes, bedrock: no, vertex: no},
	{name: "tool_search", kind: kindTool, prefix: "tool_search_tool_", anthropic: yes, bedrock: yes, vertex: yes},
	{name: "long_context", kind: kindContext, anthropic: yes, bedrock: yes, vertex: yes},

	{name: "advanced-tool-use-2025-11-20", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "claude-code-20250219", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "code-execution-2025-05-22", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "code-execution-2025-08-25", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "compact-2026-01-12", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "computer-use-2024-10-22", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "computer-use-2025-01-24", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "context-1m-2025-08-07", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "context-management-2025-06-27", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "dev-full-thinking-2025-05-14", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "effort-2025-11-24", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: no},
	{name: "extended-cache-ttl-2025-04-11", kind: kindBeta, anthropic: yes, bedrock: no, vertex: yes},
	{name: "fast-mode-2026-02-01", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "files-api-2025-04-14", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "fine-grained-tool-streaming-2025-05-14", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: no},
	{name: "interleaved-thinking-2025-05-14", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "mcp-client-2025-04-04", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: no},
	{name: "mcp-client-2025-11-20", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: no},
	{name: "memory-2025-08-18", kind: kindBeta, anthropic: yes, bedrock: no, vertex: yes},
	{name: "model-context-window-exceeded-2025-08-26", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "oauth-2025-04-20", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "output-128k-2025-02-19", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: no},
	{name: "pdfs-2024-09-25", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "prompt-caching-2024-07-31", kind: kindBeta, anthropic: yes, bedrock: no, vertex: yes},
	{name: "prompt-caching-scope-2026-01-05", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "search-results-2025-06-09", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "skills-2025-10-02", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "structured-outputs-2025-11-13", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "token-counting-2024-11-01", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "token-efficient-tools-2025-02-19", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: no},
	{name: "tool-search-tool-2025-10-19", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
	{name: "web-fetch-2025-09-10", kind: kindBeta, anthropic: yes, bedrock: no, vertex: no},
	{name: "web-search-2025-03-05", kind: kindBeta, anthropic: yes, bedrock: yes, vertex: yes},
}

// otherBetas is what each provider's wire does with a beta the table does
// not list: Anthropic's takes every beta it knows; Bedrock refuses a whole
// request for a flag it does not know; Vertex gets the flag and its answer
// decides (a refusal teaches the relay).
var otherBetas = struct{ anthropic, bedrock, vertex Support }{anthropic: yes, bedrock: no, vertex: yes}

// column is one provider's view of the table.
type column func(featureRow) Support

var (
	anthropicColumn column = func(r featureRow) Support { return r.anthropic }
	bedrockColumn   column = func(r featureRow) Support { return r.bedrock }
	vertexColumn    column = func(r featureRow) Support { return r.vertex }
)

// lookup answers Supports for a built-in provider: the table's row, else
// other (Supports is asked about the table's names and about betas).
func (c column) lookup(name string, other Support) Support {
	if r, ok := featureByName[name]; ok {
		return c(featureTable[r])
	}
	return other
}

// wireSupport answers Supports for a cloud provider: its column of the
// table, unless its own betas list (`*`: every flag) or strip_fields say
// otherwise.
func wireSupport(name string, col column, other Support, betas, stripFields []string) Support {
	if slices.Contains(stripFields, name) {
		return Strip
	}
	if len(betas) > 0 && bitOf(name) == 0 { // a beta
		if slices.Contains(betas, "*") || slices.Contains(betas, name) {
			return Supported
		}
		return Unsupported
	}
	return col.lookup(name, other)
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
