package relay

import (
	"maps"
	"slices"
	"strconv"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Typos. An unrecognized Caddyfile option close to a known one (a letter
// missing, added, changed, or two swapped) gets a "did you mean" in its
// error.

// relayOptions are the relay block's own options, besides the tuning ones
// (tuningOptions) that its channels share.
var relayOptions = []string{"max_body_size", "max_response_size", "max_upload_size", "decode_memory", "resource_secret",
	"read_body_timeout", "upstream_ratelimit_headers", "dedup_window", "dedup_grace", "settle_grace", "hold_floor",
	"key", "keys_file", "identity", "user", "channel", "group", "pricing", "ledger", "ledger_retention", "storage"}

// channelOptions are a channel's options that its switch reads, besides its
// Options, the tuning ones and its provider's.
var channelOptions = []string{"provider", "tokens", "price_factor", "model_class", "forward_traceparent", "probe", "transport"}

// groupOptions are a group's options that its switch reads, besides its
// Options.
var groupOptions = []string{"retries", "expose_channel", "retry_budget", "split", "fallback", "cache_affinity", "cache", "budget_degrade", "max_wait"}

// didYouMean is ` (did you mean "x"?)` for the name closest to word, or ""
// when none is close: one edit away, or two for a word of five letters or
// more.
func didYouMean(word string, names ...[]string) string {
	best, bestDist := "", 3
	if len(word) < 5 {
		bestDist = 2
	}
	for _, list := range names {
		for _, n := range list {
			if d := editDistance(word, n); d > 0 && d < bestDist {
				best, bestDist = n, d
			}
		}
	}
	if best == "" {
		return ""
	}
	return " (did you mean " + strconv.Quote(best) + "?)"
}

// editDistance is the optimal string alignment distance between a and b:
// insertions, deletions, substitutions and swaps of neighbours.
func editDistance(a, b string) int {
	prev2, prev, cur := make([]int, len(b)+1), make([]int, len(b)+1), make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}

// optionNames lists the options of o.
func optionNames(o provider.Options) []string {
	var out []string
	out = slices.AppendSeq(out, maps.Keys(o.Strings))
	out = slices.AppendSeq(out, maps.Keys(o.Lists))
	out = slices.AppendSeq(out, maps.Keys(o.Ints))
	out = slices.AppendSeq(out, maps.Keys(o.Durations))
	out = slices.AppendSeq(out, maps.Keys(o.Ratios))
	slices.Sort(out) // the same suggestion for a tie, every time
	return out
}

// tuningNames lists the tuning options of the relay and its channels.
func tuningNames() []string {
	return append(optionNames(tuningOptions(new(Tuning))), "breaker")
}

// providerTakes reports whether a provider module that declares its
// options (provider.OptionsProvider) takes opt.
func providerTakes(opt string) bool {
	for _, m := range caddy.GetModules(provider.Namespace) {
		if p, ok := m.New().(provider.OptionsProvider); ok && p.CaddyfileOptions().Has(opt) {
			return true
		}
	}
	return false
}

// typo answers the first of a channel's lines that no provider declares
// (unknown) with a "did you mean", when the channel's provider declares its
// options (provider.OptionsProvider) and a known option is close to it. A
// provider that reads its own lines (its UnmarshalCaddyfile) may take any
// option, and judges them itself.
func (u *providerLines) typo(unknown []caddyfile.Token, opts provider.Options) error {
	if len(unknown) == 0 {
		return nil
	}
	m, err := caddy.GetModule(provider.Namespace + "." + u.name)
	if err != nil {
		return nil // unmarshal says the provider is unknown
	}
	p, ok := m.New().(provider.OptionsProvider)
	if !ok {
		return nil
	}
	own := optionNames(p.CaddyfileOptions())
	for _, t := range unknown {
		if hint := didYouMean(t.Text, optionNames(opts), channelOptions, tuningNames(), own); hint != "" {
			d := caddyfile.NewDispenser([]caddyfile.Token{t})
			d.Next()
			return d.Errf("unrecognized channel option %q%s", t.Text, hint)
		}
	}
	return nil
}
