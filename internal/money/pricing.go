package money

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Price is what a model costs, in US dollars per million tokens.
type Price struct {
	// Input is the price of uncached input tokens.
	Input float64 `json:"input"`

	// Output is the price of output tokens.
	Output float64 `json:"output"`

	// CacheRead is the price of input tokens read from the prompt cache.
	// Default: 0.1 times Input.
	CacheRead *float64 `json:"cache_read,omitempty"`

	// CacheWrite is the price of input tokens written to the prompt cache
	// with the default 5-minute TTL. Default: 1.25 times Input.
	CacheWrite *float64 `json:"cache_write,omitempty"`

	// CacheWrite1h is the price of input tokens written to the prompt cache
	// with the 1-hour TTL. Default: 2 times Input.
	CacheWrite1h *float64 `json:"cache_write_1h,omitempty"`

	// Batch is the fraction of these prices that the results of Message
	// Batches cost, as Anthropic bills them at half price. Default: 0.5.
	// It halves the tokens only: web searches cost WebSearch in a batch
	// too.
	Batch *float64 `json:"batch,omitempty"`

	// WebSearch is the price of the web searches an answer reports
	// (usage.server_tool_use.web_search_requests), in US dollars per
	// 1,000 searches, beside its tokens. Default: 10, Anthropic's price
	// for every model. Not taken inside long_prompt: a search costs the
	// same whatever the prompt.
	WebSearch *float64 `json:"web_search,omitempty"`

	// LongPrompt, when set, is the price of every token of a request whose
	// prompt (input, cache reads and cache writes together) is larger than
	// LongPrompt.Above tokens, as Anthropic bills long prompts on some
	// models.
	LongPrompt *LongPromptPrice `json:"long_prompt,omitempty"`

	// DisplayName is the name GET /v1/models gives the model, and its dated
	// snapshots and variants, in `display_name`, such as "Sonnet (EU
	// region)". Default: a Claude model's name in Anthropic's style, made
	// from the model name (claude-sonnet-4-5 is "Claude Sonnet 4.5",
	// claude-3-5-haiku is "Claude Haiku 3.5"); any other model's name is
	// the model name itself. A pricing entry replaces the model's whole
	// built-in row, so an entry that renames a listed model gives its
	// prices too. Not taken inside long_prompt.
	DisplayName string `json:"display_name,omitempty"`

	// maxOutput is the most output tokens the model writes in one answer:
	// what a Chat Completions request that sets no limit asks for and
	// holds against its budgets. Built in only; a configured price of a
	// listed model keeps the listed model's.
	maxOutput int64
}

// Validate checks a row of `pricing`.
func (p Price) Validate() error {
	for _, v := range []*float64{&p.Input, &p.Output, p.CacheRead, p.CacheWrite, p.CacheWrite1h, p.WebSearch} {
		if v != nil && *v < 0 {
			return fmt.Errorf("prices must not be negative")
		}
	}
	if l := p.LongPrompt; l != nil {
		if l.Above <= 0 {
			return fmt.Errorf("long_prompt: above must be a positive number of tokens")
		}
		if l.LongPrompt != nil {
			return fmt.Errorf("long_prompt: takes no long_prompt of its own")
		}
		if l.DisplayName != "" {
			return fmt.Errorf("long_prompt: display_name is the model's, outside long_prompt")
		}
		if l.WebSearch != nil {
			return fmt.Errorf("long_prompt: web_search is the model's, outside long_prompt")
		}
		return l.Price.Validate()
	}
	return nil
}

// LongPromptPrice is the price tier of requests with long prompts.
type LongPromptPrice struct {
	// Above is the prompt size, in tokens, past which this tier applies.
	Above int64 `json:"above"`

	Price
}

// defaultBatchFactor is the part of the list price that Message Batches
// cost.
const defaultBatchFactor = 0.5

// defaultWebSearch is Anthropic's price of web searches, in USD per 1,000,
// the same for every model.
const defaultWebSearch = 10

// Rates is a Price with every default filled in, per token.
type Rates struct {
	input, output, cacheRead, cacheWrite, cacheWrite1h float64
	batch                                              float64 // the fraction of the prices a batch's results cost
	webSearch                                          float64 // USD per web search
	above                                              int64
	long                                               *Rates
	maxOutput                                          int64 // tokens; 0: not known
	// name is the model's display_name for GET /v1/models; "":
	// the id the client asked for
	name string
}

func (p Price) rates() *Rates {
	or := func(v *float64, def float64) float64 {
		if v != nil {
			return *v
		}
		return def
	}
	const perToken = 1e-6
	r := &Rates{
		input:        p.Input * perToken,
		output:       p.Output * perToken,
		cacheRead:    or(p.CacheRead, p.Input*0.1) * perToken,
		cacheWrite:   or(p.CacheWrite, p.Input*1.25) * perToken,
		cacheWrite1h: or(p.CacheWrite1h, p.Input*2) * perToken,
		batch:        or(p.Batch, defaultBatchFactor),
		webSearch:    or(p.WebSearch, defaultWebSearch) / 1000,
		maxOutput:    p.maxOutput,
	}
	if p.LongPrompt != nil {
		r.above = p.LongPrompt.Above
		r.long = p.LongPrompt.Price.rates()
	}
	return r
}

// WebSearch is the price of one web search, in USD.
func (r *Rates) WebSearch() float64 { return r.webSearch }

// Batch is the fraction of the prices of tokens that a batch's results
// cost.
func (r *Rates) Batch() float64 { return r.batch }

// Name is the model's display_name for GET /v1/models; "": the id the
// client asked for.
func (r *Rates) Name() string { return r.name }

// Builtin is the row of model in the built-in price list (nil: none), as
// Lookup finds it.
func Builtin(model string) *Rates { return builtinPrices.Lookup(model) }

// Usage is what an answer used, as its price counts it.
type Usage struct {
	Input        int64 // uncached input tokens
	Output       int64 // output tokens
	CacheRead    int64 // input tokens read from the prompt cache
	CacheWrite   int64 // all cache writes, 1h ones included
	CacheWrite1h int64 // of which written with the 1-hour TTL
	WebSearches  int64 // the web searches the answer made
}

// prompt is every input token of the request, cached or not: what
// Anthropic's long-prompt price tiers are measured on.
func (u Usage) prompt() int64 { return u.Input + u.CacheRead + u.CacheWrite }

// Cost is what u costs at these rates, in US dollars: its tokens and its
// server tools.
func (r *Rates) Cost(u Usage) float64 { return r.tokens(u) + r.ServerTools(u) }

// BatchCost is what u costs as the result of a Message Batch: its tokens
// at the batch price, its server tools at their full price.
func (r *Rates) BatchCost(u Usage) float64 { return r.tokens(u)*r.batch + r.ServerTools(u) }

// ServerTools is what the server tools u reports cost: its web searches.
// (Web fetches cost their tokens only, which the tokens count.)
func (r *Rates) ServerTools(u Usage) float64 { return float64(u.WebSearches) * r.webSearch }

// tokens is what the tokens of u cost at these rates, in US dollars.
func (r *Rates) tokens(u Usage) float64 {
	if r.long != nil && u.prompt() > r.above {
		r = r.long
	}
	write5m := max(u.CacheWrite-u.CacheWrite1h, 0)
	return float64(u.Input)*r.input + float64(u.Output)*r.output + float64(u.CacheRead)*r.cacheRead +
		float64(write5m)*r.cacheWrite + float64(u.CacheWrite1h)*r.cacheWrite1h
}

// Worst is the most a request with a prompt of about prompt tokens and
// maxTokens of output (0 or less: the model's maximum, or the largest the
// list knows) may cost at these rates.
func (r *Rates) Worst(prompt, maxTokens int64) float64 {
	if maxTokens <= 0 {
		maxTokens = r.maxOutput
		if maxTokens <= 0 {
			maxTokens = largestMaxOutput
		}
	}
	in, out := r.ceiling(prompt)
	return float64(prompt)*in + float64(maxTokens)*out
}

// CacheMiss is what the cache writes of u cost beyond reading the same
// tokens from the cache, at these rates (never less than nothing).
func (r *Rates) CacheMiss(u Usage) float64 {
	if r.long != nil && u.prompt() > r.above {
		r = r.long
	}
	write5m := max(u.CacheWrite-u.CacheWrite1h, 0)
	usd := float64(write5m)*(r.cacheWrite-r.cacheRead) + float64(u.CacheWrite1h)*(r.cacheWrite1h-r.cacheRead)
	return max(usd, 0)
}

// InputAt is the input price of a prompt of window tokens: the long-prompt
// tier's, when the window reaches it and it is dearer.
func (r *Rates) InputAt(window int64) float64 {
	price := r.input
	if r.long != nil && window > r.above {
		price = max(price, r.long.input)
	}
	return price
}

// ceiling is the most one token of a prompt of about prompt tokens, and
// one token of output, may cost at these rates: a prompt token costs the
// dearest of input, cache read and both cache writes (a cache write costs
// more than input), and a prompt that may reach the long-prompt tier costs
// the dearer of the two tiers.
func (r *Rates) ceiling(prompt int64) (in, out float64) {
	in, out = max(r.input, r.cacheRead, r.cacheWrite, r.cacheWrite1h), r.output
	if r.long != nil && prompt > r.above {
		lin, lout := r.long.ceiling(0)
		in, out = max(in, lin), max(out, lout)
	}
	return in, out
}

func usd(v float64) *float64 { return &v }

// defaultPricing is Anthropic's list price of the current Claude models, in
// USD per million tokens, as published on
// platform.claude.com/docs/en/about-claude/pricing (read 2026-11-29), and
// each model's maximum output tokens, from its models overview. A
// `pricing` entry overrides a model's row. A model in neither is counted in
// tokens; it costs nothing unless a budget or a spend cap applies to the
// request, which then holds and pays the dearest row of its family
// (estimates).
var defaultPricing = map[string]Price{
	"claude-fable-5-1":  {Input: 10, Output: 50, CacheRead: usd(0.25), CacheWrite: usd(12.5), CacheWrite1h: usd(20), maxOutput: 128000},
	"claude-mythos-5-1": {Input: 10, Output: 50, CacheRead: usd(0.25), CacheWrite: usd(12.5), CacheWrite1h: usd(20), maxOutput: 128000},
	"claude-fable-5":    {Input: 10, Output: 50, CacheRead: usd(1), CacheWrite: usd(12.5), CacheWrite1h: usd(20), maxOutput: 128000},
	"claude-mythos-5":   {Input: 10, Output: 50, CacheRead: usd(1), CacheWrite: usd(12.5), CacheWrite1h: usd(20), maxOutput: 128000},
	"claude-opus-5-5":   {Input: 4, Output: 20, CacheRead: usd(0.2), maxOutput: 128000},
	"claude-opus-5":     {Input: 5, Output: 25, maxOutput: 128000},
	"claude-opus-4-8":   {Input: 5, Output: 25, maxOutput: 128000},
	"claude-opus-4-7":   {Input: 5, Output: 25, maxOutput: 128000},
	"claude-opus-4-6":   {Input: 5, Output: 25, maxOutput: 128000},
	"claude-opus-4-5":   {Input: 5, Output: 25, maxOutput: 64000},
	"claude-opus-4-1":   {Input: 15, Output: 75, maxOutput: 32000},
	"claude-opus-4":     {Input: 15, Output: 75, maxOutput: 32000},
	"claude-sonnet-5-5": {Input: 2, Output: 10, CacheRead: usd(0.1), maxOutput: 64000},
	"claude-sonnet-5":   {Input: 2, Output: 10, maxOutput: 64000},
	"claude-sonnet-4-6": {Input: 3, Output: 15, maxOutput: 64000},
	"claude-sonnet-4-5": {Input: 3, Output: 15, LongPrompt: &LongPromptPrice{Above: 200_000, Price: Price{Input: 6, Output: 22.5}}, maxOutput: 64000},
	"claude-sonnet-4":   {Input: 3, Output: 15, LongPrompt: &LongPromptPrice{Above: 200_000, Price: Price{Input: 6, Output: 22.5}}, maxOutput: 64000},
	"claude-3-7-sonnet": {Input: 3, Output: 15, maxOutput: 64000},
	"claude-haiku-5-5": {Input: 0.1, Output: 0.5, CacheRead: usd(0.01),
		LongPrompt: &LongPromptPrice{Above: 100_000, Price: Price{Input: 0.5, Output: 2.5, CacheRead: usd(0.05)}}, maxOutput: 64000},
	"claude-haiku-4-5": {Input: 1, Output: 5, maxOutput: 64000},
	"claude-3-5-haiku": {Input: 0.8, Output: 4, maxOutput: 8192},
	"claude-3-haiku":   {Input: 0.25, Output: 1.25, CacheRead: usd(0.03), CacheWrite: usd(0.3), CacheWrite1h: usd(0.5), maxOutput: 4096},
}

// Pricebook finds the rates of a model.
type Pricebook map[string]*Rates

// NewPricebook merges the configured prices over the defaults. A
// configured row of a listed model keeps its maximum output. Each row
// carries its display name, made once here rather than per request: a
// configured one, else nameOf the model's id (Anthropic's name for it).
func NewPricebook(configured map[string]Price, nameOf func(id string) string) Pricebook {
	pb := make(Pricebook, len(defaultPricing)+len(configured))
	for m, p := range defaultPricing {
		pb[m] = p.rates()
		pb[m].name = nameOf(m)
	}
	for m, p := range configured {
		r := p.rates()
		if listed := builtinPrices.Lookup(m); listed != nil {
			r.maxOutput = listed.maxOutput
		}
		r.name = cmp.Or(p.DisplayName, nameOf(m))
		pb[m] = r
	}
	return pb
}

// builtinPrices is the built-in list, looked up.
var builtinPrices = func() Pricebook {
	pb := make(Pricebook, len(defaultPricing))
	for m, p := range defaultPricing {
		pb[m] = p.rates()
	}
	return pb
}()

// MaxOutputTokens is the most output tokens model writes in one answer, by
// the built-in list (a dated snapshot takes its model's); 0 when the list
// does not know the model.
func MaxOutputTokens(model string) int64 {
	if r := builtinPrices.Lookup(model); r != nil {
		return r.maxOutput
	}
	return 0
}

// largestMaxOutput is the largest maximum output of the built-in list: the
// output a request to a model the list does not know may ask for, at most.
var largestMaxOutput = func() int64 {
	n := int64(0)
	for _, p := range defaultPricing {
		n = max(n, p.maxOutput)
	}
	return n
}()

// Lookup returns the rates of model: its own row, or the row of the model
// it is a dated snapshot or a variant of (claude-sonnet-4-5-20250929,
// claude-sonnet-4-5@20250929, claude-sonnet-4-5[1m]). A newer version
// (claude-opus-4-9) never takes an older one's price.
//
// Model ids are lower case; an id in upper or mixed case takes the row of
// its lower-case form, as the upstream that serves it means that model.
func (pb Pricebook) Lookup(model string) *Rates {
	if r, ok := pb[model]; ok {
		return r
	}
	best, bestLen := (*Rates)(nil), 0
	for name, r := range pb {
		if len(name) > bestLen && strings.HasPrefix(model, name) && VariantSuffix(model[len(name):]) {
			best, bestLen = r, len(name)
		}
	}
	if best == nil && hasUpper(model) {
		return pb.Lookup(strings.ToLower(model))
	}
	return best
}

func hasUpper(s string) bool {
	for i := range len(s) {
		if 'A' <= s[i] && s[i] <= 'Z' {
			return true
		}
	}
	return false
}

// Estimates are the rows an unpriced model is held and charged at when a
// budget or a spend cap applies to its request: by family (opus, sonnet,
// haiku, as a word of the model id, in any case), the dearest row of the
// price table of that family; for a model of no family, the dearest row of
// all. An unknown model is never free where money is counted, and never
// cheaper than the dearest model it could be.
type Estimates struct {
	byFamily map[string]*Rates
	familyOf func(id string) string
}

// Estimates finds the dearest row of each family in the table, the
// configured rows among them; familyOf is the family a model id names
// ("": none).
func (pb Pricebook) Estimates(familyOf func(id string) string) Estimates {
	e := Estimates{byFamily: map[string]*Rates{}, familyOf: familyOf}
	for _, name := range slices.Sorted(maps.Keys(pb)) { // of two rows alike, the first name's
		r := pb[name]
		for _, f := range [2]string{familyOf(name), ""} {
			if cur := e.byFamily[f]; cur == nil || dearer(r, cur) {
				e.byFamily[f] = r
			}
		}
	}
	return e
}

// dearer reports whether a costs more than b for a long request (a full
// context of prompt, the most output a model writes): the dearer row holds
// more for every request that could be worth a budget's attention.
func dearer(a, b *Rates) bool {
	const prompt, output = 1_000_000, 128_000
	return a.Worst(prompt, output) > b.Worst(prompt, output)
}

// Of is the estimate of the unpriced model.
func (e Estimates) Of(model string) *Rates {
	return e.byFamily[e.familyOf(strings.ToLower(model))]
}

// VariantSuffix reports whether rest, what follows a model name, names a
// snapshot or variant of it rather than another model: -YYYYMMDD, @..., or
// [...].
func VariantSuffix(rest string) bool {
	switch {
	case strings.HasPrefix(rest, "@"), strings.HasPrefix(rest, "["):
		return true
	case len(rest) >= 9 && rest[0] == '-':
		for _, c := range rest[1:9] {
			if c < '0' || c > '9' {
				return false
			}
		}
		return len(rest) == 9 || VariantSuffix(rest[9:])
	}
	return false
}
