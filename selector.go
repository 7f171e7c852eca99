package relay

import (
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/cespare/xxhash/v2"
)

// randIntN is the selector's source of randomness; tests replace it on the
// Relay to make picks deterministic.
type randIntN func(n int) int

var defaultRand randIntN = rand.IntN

// selection is one request's view of the candidates: what it asks for and
// what it already tried.
type selection struct {
	model   string
	session string         // for sticky picks and canary splits: the session, else the key
	needs   features.Needs // the features the request carries
	tried   []*channel
	skipped []*channel // picked, but their half-open breaker had no slot left
	capped  []*channel // picked, but their spend cap could not take the request's hold
	// capBusy: a channel in capped could take the hold once holds in
	// flight on its cap settle (or its group's share frees): the request
	// waits for it rather than being refused (holds.go)
	capBusy bool
	// wants is the cap the request waits for room on, which counts its
	// group among those that share it (holds.go); nil: none
	wants     *money.Account
	avoidHost string // after a 529: prefer a channel on another upstream host
	// signer is the signature domain of the thinking blocks the request
	// carries, when known: its channels come first, and with crossSigner
	// (thinking_failover strip) the others may serve it, else none of
	// them (thinking.go)
	signer      string
	crossSigner bool
	cheaper     bool // budget_degrade cheaper: the lowest price_factor of the live tier
	// accept, when set, chooses the candidates instead of the model (a
	// resource's create, whose candidates no one model names): it says
	// whether a channel serves the request and does not refuse it. Its
	// candidates hold no channel's spend cap: a create is not priced when
	// it is made (a batch holds the caps itself, holdCaps).
	accept func(ch *channel, now time.Time) bool
	now    time.Time
	rand   randIntN
	prefix *cachePrefix // its prompt's cached prefixes, for prompt-cache affinity; nil: none
}

// halfOpenRetry is the wait suggested for a channel whose half-open breaker
// is busy with its probes.
const halfOpenRetry = time.Second

// maxChannelsPerPick bounds the stack buffer used for filtering; groups
// larger than that still work, with one allocation per pick.
const maxChannelsPerPick = 16

// pickReason is what a pick came to: a channel, or why there was none.
type pickReason uint8

const (
	picked        pickReason = iota // a channel
	exhausted                       // the request tried every channel it could use
	noModel                         // no channel of the group serves the model
	modelRefused                    // every channel that serves it refused the model (403) lately
	cooling                         // every channel that serves it is cooling down (itself, or for the model's class), open or disabled
	upstreamReset                   // every channel that serves it is out only until its upstream's reset (429, spent quota; the channel's or the model class's)
	noCapability                    // no channel of the group supports every feature the request needs
	allBusy                         // every candidate is at one of its limits
)

// pickResult is a pick's channel, or why there is none and until when
// that holds: the first recovery (cooling, zero when only a person can
// bring a channel back), the first refusal's end (modelRefused), or when a
// busy channel should free (allBusy, zero when only a finishing attempt can
// tell).
type pickResult struct {
	ch       *channel
	reason   pickReason
	until    time.Time
	missing  []string // noCapability: the features no channel supports
	together bool     // noCapability: each has a channel, but none has them all
	capped   *channel // cooling: a channel out because of its spend cap
	// cooling: every channel is out because its upstream answered 529
	// (the channel's cooldown or its model class's)
	overloaded bool
}

// err is the relay's answer to a request that found no channel for this
// reason at the start (a request that already tried channels answers with
// its last attempt instead).
func (p pickResult) err(s *selection, g *group) *relayError {
	switch p.reason {
	case noModel:
		return errModelNotFound(s.model, g)
	case modelRefused:
		return errModelRefused(s.model, g.name, p.until)
	case noCapability:
		if len(p.missing) == 1 && p.missing[0] == featThinkingSignature {
			return errThinkingSignature(g.name)
		}
		return errCapability(p.missing, p.together, g.name)
	case upstreamReset:
		return errRateLimitedUpstream(s.model, untilFrom(p.until, s.now))
	case allBusy:
		return errQueue("every channel of group "+strconv.Quote(g.name)+" is at its limit", untilFrom(p.until, s.now))
	case cooling:
		if p.capped != nil {
			return errChannelsCapped(s.model, p.capped, s.now, untilFrom(p.until, s.now))
		}
		if p.overloaded {
			return errOverloadedUpstream(s.model, untilFrom(p.until, s.now))
		}
	}
	return errNoHealthyChannel(s.model, untilFrom(p.until, s.now))
}

// untilFrom is the time from now until t; zero for a zero t.
func untilFrom(t, now time.Time) time.Duration {
	if t.IsZero() {
		return 0
	}
	return t.Sub(now)
}

// pick chooses the channel for the next attempt of a request in group g:
// model filter (or the selection's accept), then capability, then untried, then health, then limits,
// then the channels that serve the request whole over those that would
// strip a feature from it, then the best priority tier, then weighted
// random.
func (g *group) pick(s *selection) pickResult {
	var buf [maxChannelsPerPick]*channel
	cands := buf[:0]
	var refusedUntil time.Time // the first end of a refusal, when every channel refused
	for _, ch := range g.channels {
		if s.accept != nil {
			if s.accept(ch, s.now) {
				cands = append(cands, ch)
			}
			continue
		}
		if !ch.serves(s.model) {
			continue
		}
		if refused, until := ch.health.Refuses(s.model, s.now); refused {
			if refusedUntil.IsZero() || until.Before(refusedUntil) {
				refusedUntil = until
			}
			continue
		}
		cands = append(cands, ch)
	}
	none := func(why pickReason, until time.Time) pickResult {
		if len(s.tried) > 0 {
			return pickResult{reason: exhausted}
		}
		return pickResult{reason: why, until: until}
	}
	if len(cands) == 0 {
		if !refusedUntil.IsZero() {
			return none(modelRefused, refusedUntil)
		}
		return pickResult{reason: noModel}
	}

	needsSome := !s.needs.Empty()
	if needsSome {
		model := cands // intact when nothing is kept: filter writes only what it keeps
		cands = filter(cands, func(ch *channel) bool { ok, _ := ch.takes(s.needs, s.now); return ok })
		if len(cands) == 0 {
			if len(s.tried) > 0 {
				return pickResult{reason: exhausted}
			}
			missing, together := missingFeatures(model, s.needs, s.now)
			return pickResult{reason: noCapability, missing: missing, together: together}
		}
	}

	if s.signer != "" && !s.crossSigner {
		if cands = filter(cands, s.signedBy); len(cands) == 0 {
			return none(noCapability, time.Time{}).signature()
		}
	}

	cands = filter(cands, func(ch *channel) bool { return !contains(s.tried, ch) })
	if len(cands) == 0 {
		return pickResult{reason: exhausted}
	}

	// out until an upstream's reset (a 429's wait, a spent quota), the
	// earliest; and whether any is out for another reason
	var reset time.Time
	earliest := func(t *time.Time, at time.Time) {
		if !at.IsZero() && (t.IsZero() || at.Before(*t)) {
			*t = at
		}
	}
	var recovery time.Time
	otherOut, overloaded := false, false
	var capped *channel
	cands = filter(cands, func(ch *channel) bool {
		ok, until := ch.health.Available(s.now)
		by := health.OutOther
		if !ok {
			by = ch.health.OutBy(s.now)
		}
		if ok && s.accept == nil { // the class of the request's model may cool on it
			ok, until, by = ch.classAvailable(s.model, s.now)
		}
		if ok && contains(s.skipped, ch) {
			ok, until = false, s.now.Add(halfOpenRetry)
		}
		if ok && ch.spend != nil && s.accept == nil {
			if spent, end := ch.spend.Capped(s.now); spent || contains(s.capped, ch) {
				if !spent {
					end = s.now.Add(holdRetryAfter) // holds in flight on its cap may settle
				}
				ok, until, capped = false, end, ch
			}
		}
		if !ok {
			earliest(&recovery, until)
			switch by {
			case health.OutReset:
				earliest(&reset, until)
			case health.OutOverload:
				overloaded = true
			default:
				otherOut = true
			}
		}
		return ok
	})
	if len(cands) == 0 {
		if !otherOut && !overloaded {
			return none(upstreamReset, reset)
		}
		p := none(cooling, recovery)
		p.capped = capped
		// every one is out because its upstream said it is overloaded
		p.overloaded = !otherOut && reset.IsZero()
		return p
	}

	// a busy channel (at a limit, or out of upstream quota) is skipped but
	// not cooled; when all are busy the request may queue
	var freeAt time.Time
	known, relayBusy := true, false
	notBusy := filter(cands, func(ch *channel) bool {
		busy, at, upstream := ch.health.busy(s.now)
		switch {
		case !busy:
		case upstream:
			earliest(&reset, at)
		case at.IsZero():
			known, relayBusy = false, true
		default:
			relayBusy = true
			earliest(&freeAt, at)
		}
		return !busy
	})
	if len(notBusy) == 0 {
		if !relayBusy && !otherOut {
			return none(upstreamReset, reset)
		}
		earliest(&freeAt, reset)
		if !known {
			freeAt = time.Time{} // a slot may free before the earliest known time
		}
		return none(allBusy, freeAt)
	}
	cands = notBusy

	if needsSome {
		if whole := filter(cands, func(ch *channel) bool { _, strips := ch.takes(s.needs, s.now); return !strips }); len(whole) > 0 {
			cands = whole
		}
	}
	if s.signer != "" {
		if own := filter(cands, s.signedBy); len(own) > 0 {
			cands = own
		}
	}
	if s.avoidHost != "" {
		if other := filter(cands, func(ch *channel) bool { return ch.host != s.avoidHost }); len(other) > 0 {
			cands = other
		}
	}
	if len(g.splits) > 0 {
		cands = g.split(cands, s.session)
	}

	tier := bestTier(cands)
	if s.cheaper {
		tier = cheapest(tier)
	}
	if ch := s.prefix.route(tier, s); ch != nil { // where its prompt is warm
		return pickResult{ch: ch, reason: picked}
	}
	var ch *channel
	switch g.policy {
	case policyAdaptive:
		ch = adaptive(tier, s.rand, s.now)
	case policySticky:
		ch = rendezvous(tier, s.session)
	default:
		ch = weighted(tier, s.rand)
	}
	return pickResult{ch: ch, reason: picked}
}

// anotherTakes reports whether a channel of g other than ch, and not yet
// tried, serves the selection's model and supports every feature it needs
// (by config and what it learned; healthy or not), and knows it supports
// the betas among lacked: the feature table or its config names them. (A
// beta nobody names is most likely a client's typo, which every channel
// refuses alike: its 400 goes to the client at once.)
func (g *group) anotherTakes(s *selection, ch *channel, lacked []string) bool {
	if s.needs.Empty() {
		return false
	}
	for _, c := range g.channels {
		if c == ch || contains(s.tried, c) || !c.serves(s.model) {
			continue
		}
		if refused, _ := c.health.Refuses(s.model, s.now); refused {
			continue
		}
		if ok, _ := c.takes(s.needs, s.now); ok && c.features.Named(lacked) && s.signerAllows(c) {
			return true
		}
	}
	return false
}

// groupSplit is a canary: a share of sessions that goes to one channel.
type groupSplit struct {
	ch    *channel
	share float64
}

// split applies the group's canaries: a session whose hash falls in a
// canary's share goes to it, whatever its priority, while it is live; the
// other sessions do not reach a canary while any other channel is live.
func (g *group) split(cands []*channel, session string) []*channel {
	for _, sp := range g.splits {
		if unitHash("split", sp.ch.name, session) >= sp.share {
			continue
		}
		for i, ch := range cands {
			if ch == sp.ch {
				cands[0], cands[i] = cands[i], cands[0]
				return cands[:1]
			}
		}
	}
	canary := func(ch *channel) bool {
		for _, sp := range g.splits {
			if sp.ch == ch {
				return true
			}
		}
		return false
	}
	for _, ch := range cands {
		if !canary(ch) {
			return filter(cands, func(ch *channel) bool { return !canary(ch) })
		}
	}
	return cands // only canaries are live: better them than nothing
}

// unitHash maps (tag, a, b) to [0, 1), the same on every host and run.
func unitHash(tag, a, b string) float64 {
	var d xxhash.Digest
	d.Reset()
	_, _ = d.WriteString(tag)
	_, _ = d.WriteString("\x00")
	_, _ = d.WriteString(a)
	_, _ = d.WriteString("\x00")
	_, _ = d.WriteString(b)
	return float64(d.Sum64()>>11) / (1 << 53)
}

// rendezvous picks the channel of a session by weighted rendezvous
// hashing: each channel scores weight / -ln(h), h the session's hash with
// the channel's name, and the highest score wins. A channel that leaves the
// tier (cooling, removed) takes only its own sessions elsewhere, and they
// come back when it does; a new channel takes only its share.
func rendezvous(chs []*channel, session string) *channel {
	var best *channel
	bestScore := -1.0
	for _, ch := range chs {
		u := unitHash("sticky", ch.name, session)
		score := float64(ch.weight) / -math.Log(u+1.0/(1<<54)) // u > 0
		if score > bestScore {
			best, bestScore = ch, score
		}
	}
	return best
}

// adaptive picks at random by effective weight (see effectiveWeights).
func adaptive(chs []*channel, rnd randIntN, now time.Time) *channel {
	if len(chs) == 1 {
		return chs[0]
	}
	var buf [maxChannelsPerPick]float64
	w := effectiveWeights(chs, now, buf[:0])
	total := 0.0
	for _, x := range w {
		total += x
	}
	r := float64(rnd(1<<53)) / (1 << 53) * total
	for i, x := range w {
		r -= x
		if r < 0 {
			return chs[i]
		}
	}
	return chs[len(chs)-1]
}

// minFactor keeps a healthy channel's effective weight above zero, so a
// degraded channel keeps a trickle of traffic to show it recovered.
const minFactor = 0.05

// Latency is compared with a dead band: first-byte latencies within
// latencyBand, or within latencyBandRatio of the best, are the same speed,
// so the noise between equally fast channels moves no traffic. A latency
// measured latencyMemory ago no longer counts, fading out linearly: a
// channel that was slow and got little traffic since comes back on its
// own, and its new samples then say how fast it is.
const (
	latencyBand      = 20 // ms
	latencyBandRatio = 0.25
	latencyMemory    = 30 * time.Second
)

// effectiveWeights is the adaptive policy's formula: for each channel,
//
//	weight × load × health × speed
//
// load   = 1 − inflight/concurrency with a concurrency limit, else
//
//	1/(1 + inflight): in-flight requests push new ones elsewhere;
//
// health = 1 − the failure ratio of the breaker's sliding window;
// speed  = 1 within the latency dead band of the tier's best first-byte
//
//	latency (EWMA), else (best + band) / the channel's latency, where a
//	latency's excess over the best fades out over latencyMemory;
//
// each factor clamped to [0.05, 1].
func effectiveWeights(chs []*channel, now time.Time, out []float64) []float64 {
	best := math.Inf(1)
	for _, ch := range chs {
		if l := ch.health.Latency(); l > 0 && l < best {
			best = l
		}
	}
	band := max(latencyBand, latencyBandRatio*best)
	for _, ch := range chs {
		h := ch.health
		inflight := float64(h.limits.Inflight())
		load := 1 / (1 + inflight)
		if c := h.limits.MaxConcurrency(); c > 0 {
			load = 1 - inflight/float64(c)
		}
		health := 1 - h.FailureRatio()
		speed := 1.0
		if l := h.Latency(); l > 0 && !math.IsInf(best, 1) {
			age := now.Sub(h.LatencyAt())
			trust := max(0, 1-float64(age)/float64(latencyMemory))
			if l = best + (l-best)*trust; l > best+band {
				speed = (best + band) / l
			}
		}
		out = append(out, float64(ch.weight)*clampFactor(load)*clampFactor(health)*clampFactor(speed))
	}
	return out
}

func clampFactor(f float64) float64 { return min(max(f, minFactor), 1) }

// filter keeps the channels for which keep is true, in place.
func filter(chs []*channel, keep func(*channel) bool) []*channel {
	out := chs[:0]
	for _, ch := range chs {
		if keep(ch) {
			out = append(out, ch)
		}
	}
	return out
}

func contains(chs []*channel, ch *channel) bool {
	for _, c := range chs {
		if c == ch {
			return true
		}
	}
	return false
}

// bestTier keeps the channels of the lowest priority number (1 is preferred).
func bestTier(chs []*channel) []*channel {
	best := chs[0].priority
	for _, ch := range chs[1:] {
		if ch.priority < best {
			best = ch.priority
		}
	}
	return filter(chs, func(ch *channel) bool { return ch.priority == best })
}

// weighted picks one channel with probability proportional to its weight.
func weighted(chs []*channel, rnd randIntN) *channel {
	if len(chs) == 1 {
		return chs[0]
	}
	total := 0
	for _, ch := range chs {
		total += ch.weight
	}
	n := rnd(total)
	for _, ch := range chs {
		n -= ch.weight
		if n < 0 {
			return ch
		}
	}
	return chs[len(chs)-1]
}
