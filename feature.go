package relay

import (
	"slices"
	"time"

	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/provider"
)

// A channel's features as selection reads them: what the feature table and
// its config say it does with each (ch.features, internal/features), and
// what its upstream's refusals taught it that it lacks (its health's
// lacks, for capability_ttl).

// takes reports whether ch can serve a request with needs n, by its
// config and what its upstream taught it, and whether it would strip
// something to do so.
func (ch *channel) takes(n features.Needs, now time.Time) (ok, strips bool) {
	f := &ch.features
	if n.Set&^(f.Takes()|f.Strips()) != 0 {
		return false, false
	}
	strips = n.Set&f.Strips() != 0
	for _, b := range n.Betas {
		switch f.Beta(b) {
		case provider.Unsupported:
			return false, false
		case provider.Strip:
			strips = true
		}
	}
	if m := ch.health.Lacking(); m != nil {
		at := now.UnixNano()
		learned := func(name string) bool { until, ok := m[name]; return ok && until > at }
		for s := n.Set &^ f.Strips(); s != 0; s &= s - 1 {
			if learned(s.First()) {
				return false, false
			}
		}
		for _, b := range n.Betas {
			if f.Beta(b) != provider.Strip && learned(b) {
				if !f.StripsOtherBetas() {
					return false, false
				}
				strips = true
			}
		}
	}
	return true, strips
}

// stripFor is what ch removes from a request with needs n: known
// features, and betas.
func (ch *channel) stripFor(n features.Needs, now time.Time) (features.Set, []string) {
	f := &ch.features
	set := n.Set & f.Strips()
	var betas []string
	m := ch.health.Lacking()
	for _, b := range n.Betas {
		s := f.Beta(b)
		if s == provider.Supported && f.StripsOtherBetas() && m != nil {
			if until, ok := m[b]; ok && until > now.UnixNano() {
				s = provider.Strip
			}
		}
		if s == provider.Strip {
			betas = append(betas, b)
		}
	}
	return set, betas
}

// missingFeatures lists the needed features that no channel of chans
// takes by itself, or, when each has a taker but none takes them all, all
// of them (together).
func missingFeatures(chans []*channel, n features.Needs, now time.Time) (missing []string, together bool) {
	for _, name := range n.Names() {
		one := features.Needs{Set: features.Bit(name)}
		if one.Set == 0 {
			one.Betas = []string{name}
		}
		if !slices.ContainsFunc(chans, func(ch *channel) bool { ok, _ := ch.takes(one, now); return ok }) {
			missing = append(missing, name)
		}
	}
	if len(missing) == 0 {
		return n.Names(), true
	}
	return missing, false
}
