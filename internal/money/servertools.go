package money

import (
	"math"
	"strconv"
	"strings"

	"github.com/tidwall/gjson"
)

// Server tools run at Anthropic, inside one request, and some cost more
// than their tokens. A web search costs the model's `web_search` price
// (pricing.go: $10 per 1,000 by default) for each search the answer
// reports in usage.server_tool_use.web_search_requests; a web fetch costs
// the tokens of what it fetched, which the tokens count already. Code
// execution is billed by Anthropic per container hour across an
// organisation, which no answer reports, and is not priced.
//
// A request that declares a web search tool may make as many searches as
// its max_uses says, and holds them against its budgets (hold.go) beside
// its tokens; one without max_uses holds DefaultWebSearches, the
// iterations Anthropic's server-side loop runs before it pauses the turn.

// DefaultWebSearches is what a web search tool without max_uses holds.
const DefaultWebSearches = 10

// MaxWebSearches bounds what a max_uses may hold: more than any budget.
const MaxWebSearches = 1 << 40

// WebSearchTool is the prefix of a web search tool's type.
const WebSearchTool = "web_search_"

// WebSearchUses is the searches a web search tool whose max_uses is the
// JSON number maxUses ("": none) may make: max_uses rounded up, or
// DefaultWebSearches without one.
func WebSearchUses(maxUses string) int64 {
	if maxUses == "" {
		return DefaultWebSearches
	}
	f, err := strconv.ParseFloat(maxUses, 64)
	if err != nil || !(f >= 0) {
		return DefaultWebSearches
	}
	return int64(math.Ceil(min(f, MaxWebSearches)))
}

// WebSearchesOf is the searches the web search tools of tools (a request's
// `tools`, as gjson reads it) may make, all together.
func WebSearchesOf(tools gjson.Result) int64 {
	n := int64(0)
	tools.ForEach(func(_, tool gjson.Result) bool {
		if strings.HasPrefix(tool.Get("type").Str, WebSearchTool) {
			maxUses := ""
			if m := tool.Get("max_uses"); m.Type == gjson.Number {
				maxUses = m.Raw
			}
			n += WebSearchUses(maxUses)
		}
		return true
	})
	return n
}
