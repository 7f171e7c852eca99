package relay

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
// its tokens; one without max_uses holds defaultWebSearches, the
// iterations Anthropic's server-side loop runs before it pauses the turn.

// defaultWebSearches is what a web search tool without max_uses holds.
const defaultWebSearches = 10

// maxWebSearches bounds what a max_uses may hold: more than any budget.
const maxWebSearches = 1 << 40

// webSearchTool is the prefix of a web search tool's type.
const webSearchTool = "web_search_"

// webSearchUses is the searches a web search tool whose max_uses is the
// JSON number maxUses ("": none) may make: max_uses rounded up, or
// defaultWebSearches without one.
func webSearchUses(maxUses string) int64 {
	if maxUses == "" {
		return defaultWebSearches
	}
	f, err := strconv.ParseFloat(maxUses, 64)
	if err != nil || !(f >= 0) {
		return defaultWebSearches
	}
	return int64(math.Ceil(min(f, maxWebSearches)))
}

// webSearchesOf is the searches the web search tools of tools (a request's
// `tools`, as gjson reads it) may make, all together.
func webSearchesOf(tools gjson.Result) int64 {
	n := int64(0)
	tools.ForEach(func(_, tool gjson.Result) bool {
		if strings.HasPrefix(tool.Get("type").Str, webSearchTool) {
			maxUses := ""
			if m := tool.Get("max_uses"); m.Type == gjson.Number {
				maxUses = m.Raw
			}
			n += webSearchUses(maxUses)
		}
		return true
	})
	return n
}
