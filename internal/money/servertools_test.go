package money

import (
	"math"
	"testing"

	"github.com/tidwall/gjson"
)

// A web search costs its model's web_search price per 1,000 ($10 unless
// configured), beside the tokens at either prompt tier, and in full in a
// batch, whose price halves the tokens only.
func TestTheCostOfWebSearches(t *testing.T) {
	pb := NewPricebook(map[string]Price{"m-cheap": {Input: 1, Output: 1, WebSearch: usd(5)}, "m-plain": {Input: 1, Output: 1, Batch: usd(0.25)}}, noName)
	u := Usage{Input: 1000, Output: 1000, WebSearches: 50}
	long := Usage{Input: 250_000, Output: 1000, WebSearches: 50} // past claude-sonnet-4-5's 200,000
	for _, tc := range []struct {
		model        string
		u            Usage
		cost, batch  float64
		serverTools  float64
		tokensInCost float64
	}{
		{"m-cheap", u, 0.252, 0.251, 0.25, 0.002},
		{"m-plain", u, 0.502, 0.5005, 0.5, 0.002},
		{"claude-sonnet-4-5", u, 0.518, 0.509, 0.5, 0.018},
		{"claude-sonnet-4-5", long, 1.5 + 0.0225 + 0.5, (1.5+0.0225)*0.5 + 0.5, 0.5, 1.5225},
	} {
		r := pb.Lookup(tc.model)
		for what, got := range map[string][2]float64{
			"cost": {r.Cost(tc.u), tc.cost}, "batch cost": {r.BatchCost(tc.u), tc.batch},
			"server tools": {r.ServerTools(tc.u), tc.serverTools}, "tokens": {r.tokens(tc.u), tc.tokensInCost},
		} {
			if math.Abs(got[0]-got[1]) > 1e-12 {
				t.Errorf("%s, %d input tokens: %s %v, want %v", tc.model, tc.u.Input, what, got[0], got[1])
			}
		}
	}
}

// What a web search tool may search: its max_uses rounded up, else
// DefaultWebSearches; a batch's requests' tools add up.
func TestWebSearchUses(t *testing.T) {
	for maxUses, want := range map[string]int64{"": 10, "3": 3, "2.1": 3, "0": 0, "1e3": 1000, "-1": 10, "1e400": 10, "1e300": MaxWebSearches} {
		if got := WebSearchUses(maxUses); got != want {
			t.Errorf("max_uses %q: %d, want %d", maxUses, got, want)
		}
	}
	tools := `[{"type":"web_search_20250305","max_uses":3},{"name":"f","input_schema":{}},{"type":"web_fetch_20250910","max_uses":9},{"type":"web_search_20260209"},{"type":"web_search_20250305","max_uses":"7"}]`
	if got := WebSearchesOf(gjson.Parse(tools)); got != 3+10+10 {
		t.Errorf("the tools may search %d times, want 23", got)
	}
}
