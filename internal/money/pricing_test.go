package money

import (
	"math"
	"testing"
)

// noName names a model by its id.
func noName(id string) string { return id }

func TestPriceLookup(t *testing.T) {
	pb := NewPricebook(map[string]Price{"my-model": {Input: 1, Output: 2}, "claude-haiku-4-5": {Input: 7, Output: 8}}, noName)
	tests := []struct {
		model string
		input float64 // per million
	}{
		{"claude-sonnet-4-5", 3},
		{"claude-sonnet-4-5-20250929", 3},
		{"claude-sonnet-4-5@20250929", 3},
		{"claude-sonnet-4-5[1m]", 3},
		{"claude-opus-4-1-20250805", 15},
		{"claude-opus-4-20250514", 15},
		{"claude-opus-4-6", 5},
		{"claude-haiku-4-5", 7}, // configured over the default
		{"my-model", 1},
		{"claude-opus-4-9", 0}, // a newer version never takes an older price
		{"claude-sonnet-4-55", 0},
		{"gpt-4", 0},
	}
	for _, tt := range tests {
		r := pb.Lookup(tt.model)
		got := 0.0
		if r != nil {
			got = math.Round(r.input*1e6*1000) / 1000
		}
		if got != tt.input {
			t.Errorf("%s: input price %v, want %v", tt.model, got, tt.input)
		}
	}
}

func TestCost(t *testing.T) {
	pb := NewPricebook(nil, noName)
	approx := func(a, b float64) bool { return math.Abs(a-b) < 1e-12 }

	u := Usage{Input: 1000, Output: 500, CacheRead: 2000, CacheWrite: 100, CacheWrite1h: 40}
	want := (1000*3 + 500*15 + 2000*0.3 + 60*3.75 + 40*6) / 1e6
	if got := pb.Lookup("claude-sonnet-4-5").Cost(u); !approx(got, want) {
		t.Errorf("sonnet-4-5 cost = %v, want %v", got, want)
	}
	// past 200k prompt tokens, sonnet-4-5 bills every token at the long rates
	long := Usage{Input: 150_000, CacheRead: 60_000, Output: 1000}
	want = (150_000*6 + 60_000*0.6 + 1000*22.5) / 1e6
	if got := pb.Lookup("claude-sonnet-4-5").Cost(long); !approx(got, want) {
		t.Errorf("long sonnet-4-5 cost = %v, want %v", got, want)
	}
	// haiku-5-5's tier starts past 100k, with its own cache read price
	h := Usage{Input: 90_000, CacheRead: 20_000, Output: 100}
	want = (90_000*0.5 + 20_000*0.05 + 100*2.5) / 1e6
	if got := pb.Lookup("claude-haiku-5-5").Cost(h); !approx(got, want) {
		t.Errorf("long haiku-5-5 cost = %v, want %v", got, want)
	}
	h = Usage{Input: 90_000, CacheRead: 10_000, Output: 100}
	want = (90_000*0.1 + 10_000*0.01 + 100*0.5) / 1e6
	if got := pb.Lookup("claude-haiku-5-5").Cost(h); !approx(got, want) {
		t.Errorf("haiku-5-5 at exactly 100k cost = %v, want %v", got, want)
	}
}
