package relay

import "github.com/caddy-relay/relay/internal/money"

// Price is what a model costs, in US dollars per million tokens: a row
// of `pricing` (internal/money keeps the price table).
type Price = money.Price

// LongPromptPrice is the price tier of requests with long prompts.
type LongPromptPrice = money.LongPromptPrice

// priced is what u counts for its price.
func (u usage) priced() money.Usage {
	return money.Usage{Input: u.input, Output: u.output, CacheRead: u.cacheRead, CacheWrite: u.cacheWrite,
		CacheWrite1h: u.cacheWrite1h, WebSearches: int64(u.webSearches)}
}
