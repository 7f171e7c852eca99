package relay

import (
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
)

// cooldownPolicy is what a channel's config says about cooling it down.
type cooldownPolicy struct {
	base time.Duration // after a transient failure; doubles while they repeat
	max  time.Duration // cap for every cooldown but auth
	auth time.Duration // after the credential or account was refused
	// how long a model the upstream refused stays set aside on the channel
	capability time.Duration
}

// defaultRateLimitWait is the cooldown after a 429 that gave no hint.
const defaultRateLimitWait = 5 * time.Second

// busy reports whether the channel is at one of its limits, or its
// upstream said a quota is spent (upstream), and when that should lift
// (zero when only a finishing attempt can tell). A busy channel is skipped,
// not cooled.
func (h *channelHealth) busy(now time.Time) (busy bool, until time.Time, upstream bool) {
	if q := h.quotaUntil.Load(); q > now.UnixNano() {
		return true, time.Unix(0, q), true
	}
	busy, until = h.limits.Busy(now)
	return busy, until, false
}

// outBy says what keeps a channel (or a model class on it) out: what its
// upstream said, whose words the relay's refusal then speaks, or anything
// else.
type outBy uint8

const (
	outOther    outBy = iota // a failure of the channel, its breaker, a person, a spend cap
	outReset                 // an upstream's 429 with a time to come back, or a spent anthropic-ratelimit-* quota
	outOverload              // an upstream's 529: overloaded
)

// outBy says what keeps the channel out at now when it is not available:
// only its upstream's 429 wait (its cooldown is that wait), only its
// upstream's 529, or anything else (a breaker open, a person, failures).
func (h *channelHealth) outBy(now time.Time) outBy {
	n := now.UnixNano()
	u := h.until.Load()
	switch {
	case h.disabled.Load() || u <= n || h.openUntil.Load() > n:
		return outOther
	case u <= h.limitedUntil.Load():
		return outReset
	case u <= h.overloadedUntil.Load():
		return outOverload
	}
	return outOther
}

// observeQuota reads the anthropic-ratelimit-* headers of an upstream's
// answer to a request for model: a limit whose remaining count is 0 cools
// the model's class on the channel until its reset, so the relay stops
// before the upstream's 429. Like a 429's wait, it is capped by the
// channel's max_cooldown. The class is resolved only when a limit is spent.
func (ch *channel) observeQuota(hdr http.Header, now time.Time, model string) {
	if t, reason := spentQuota(hdr, now, ch.cooldown.max); !t.IsZero() {
		ch.health.quotaSpent(ch.classOf(model), t, reason, now)
	}
}

// quotaReasons word a spent limit, as the reason of a class's cooldown.
var quotaReasons = func() (out [len(rateLimitHeaders)]string) {
	for i, names := range rateLimitHeaders {
		out[i] = strings.ToLower(names.remaining) + ": 0"
	}
	return out
}()

// spentQuota is the latest reset, at most limit from now, of the
// anthropic-ratelimit-* limits whose remaining count is 0, and the header
// that said so; zero when none is spent.
func spentQuota(hdr http.Header, now time.Time, limit time.Duration) (until time.Time, reason string) {
	for i, names := range rateLimitHeaders {
		// the names are canonical: read the map without Get's
		// canonicalizing, on every answer
		if v := hdr[names.remaining]; len(v) == 0 || v[0] != "0" {
			continue
		}
		t, err := time.Parse(time.RFC3339, hdr.Get(names.reset))
		if err != nil || !t.After(now) {
			continue
		}
		if lim := now.Add(limit); t.After(lim) {
			t = lim
		}
		if t.After(until) {
			until, reason = t, quotaReasons[i]
		}
	}
	return until, reason
}

// quotaSpent records that the upstream said a quota of class is spent
// until until: the class cools until then, its whole cooldown an
// upstream's reset. (A channel's own quotaUntil is set only by what the
// fleet stored or published before quotas were kept per class.)
func (h *channelHealth) quotaSpent(class string, until time.Time, reason string, now time.Time) {
	ms := until.Sub(now).Milliseconds()
	h.mu.Lock()
	moved := h.coolClass(class, until.UnixNano(), until.UnixNano(), 0, reason, now)
	h.mu.Unlock()
	if moved {
		h.announce(healthChange{Kind: changeCool, Class: class, Until: ms, Limited: ms, Reason: reason})
	}
}

// maxSetAside bounds the models remembered as refused, and the features
// as lacking, per channel: clients choose the names.
const maxSetAside = 256

// refuses reports whether the upstream refused model on this channel, and
// until when it stays set aside.
func (h *channelHealth) refuses(model string, now time.Time) (bool, time.Time) {
	m := h.refused.Load()
	if m == nil {
		return false, time.Time{}
	}
	if until, ok := (*m)[model]; ok && until > now.UnixNano() {
		return true, time.Unix(0, until)
	}
	return false, time.Time{}
}

// setAside adds name to the map m (refused models, lacking features)
// until until. Expired entries go; when the map is full, the entry that
// ends first makes room. h.mu is held.
func setAside(m *atomic.Pointer[map[string]int64], name string, now, until time.Time) {
	next := map[string]int64{}
	if cur := m.Load(); cur != nil {
		for k, v := range *cur {
			if v > now.UnixNano() {
				next[k] = v
			}
		}
	}
	if _, ok := next[name]; !ok && len(next) >= maxSetAside {
		first := ""
		for k, v := range next {
			if first == "" || v < next[first] {
				first = k
			}
		}
		delete(next, first)
	}
	next[name] = until.UnixNano()
	m.Store(&next)
}

// ewmaWeight is the weight of the newest sample in the latency average.
const ewmaWeight = 0.2

// record updates the cooldown and the last error with a verdict and returns
// the cooldown it started (zero when none).
func (h *channelHealth) record(v verdict, p cooldownPolicy, now time.Time, firstByte time.Duration) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if firstByte > 0 {
		ms, cur := float64(firstByte)/float64(time.Millisecond), h.latency()
		if cur != 0 {
			ms = cur + ewmaWeight*(ms-cur)
		}
		h.ewmaMs.Store(math.Float64bits(ms))
		h.ewmaAt.Store(now.UnixNano())
	}
	var d time.Duration
	switch v.outcome {
	case outcomeSuccess, outcomeClientError:
		h.consecutive = 0
		return 0
	case outcomeCanceled:
		return 0
	case outcomeModelRefused:
		// the request chose the model: only that model is set aside, and
		// the channel stays as healthy as it was
		setAside(&h.refused, v.model, now, now.Add(p.capability))
		h.lastError, h.lastReason, h.lastErrorAt = v.outcome, v.reason+": "+v.model, now
		return 0
	case outcomeLacksFeature:
		// the request carried the feature: the channel stays as healthy
		// as it was, and requests without it still come
		for _, f := range v.features {
			setAside(&h.lacks, f, now, now.Add(p.capability))
		}
		h.lastError, h.lastReason, h.lastErrorAt = v.outcome, v.reason, now
		return 0
	case outcomeAuth:
		d = p.auth
	case outcomeRateLimited:
		d = v.wait
		if d <= 0 {
			d = defaultRateLimitWait
		}
	case outcomeOverloaded:
		d = p.base
	case outcomeTransient:
		h.consecutive++
		d = backoff(p.base, h.consecutive)
	}
	if v.outcome != outcomeAuth && d > p.max {
		d = p.max
	}
	if v.class != "" && v.outcome.byClass() {
		return h.recordClass(v, d, now)
	}
	h.lastError, h.lastReason, h.lastErrorAt = v.outcome, v.reason, now
	h.extend(now.Add(d))
	c := healthChange{Kind: changeCool, Until: d.Milliseconds(), Error: v.outcome.String(), Reason: v.reason}
	switch v.outcome {
	case outcomeRateLimited:
		raiseTo(&h.limitedUntil, now.Add(d).UnixNano())
		c.Limited = c.Until
	case outcomeOverloaded:
		raiseTo(&h.overloadedUntil, now.Add(d).UnixNano())
	}
	h.announce(c)
	return d
}

// recordClass cools v's model class on the channel for d (a 429's wait,
// a 529's cooldown), not the channel, and returns d. h.mu is held.
func (h *channelHealth) recordClass(v verdict, d time.Duration, now time.Time) time.Duration {
	h.lastError, h.lastReason, h.lastErrorAt = v.outcome, v.reason+" (class "+v.class+")", now
	until, limited, overloaded := now.Add(d).UnixNano(), int64(0), int64(0)
	c := healthChange{Kind: changeCool, Class: v.class, Until: d.Milliseconds(), Error: v.outcome.String(), Reason: v.reason}
	switch v.outcome {
	case outcomeRateLimited:
		limited, c.Limited = until, c.Until
	case outcomeOverloaded:
		overloaded = until
	}
	h.coolClass(v.class, until, limited, overloaded, v.reason, now)
	h.announce(c)
	return d
}

// extend moves the end of the cooldown to t unless it already ends later.
func (h *channelHealth) extend(t time.Time) { raiseTo(&h.until, t.UnixNano()) }

// raiseTo stores n in a unless a already holds as much, and reports
// whether it did.
func raiseTo(a *atomic.Int64, n int64) bool {
	for {
		cur := a.Load()
		if n <= cur {
			return false
		}
		if a.CompareAndSwap(cur, n) {
			return true
		}
	}
}

// reset clears the cooldown, the model classes' cooldowns, the spent
// quota, the refused models, the failure streak and the breaker: the
// channel is healthy again (unless disabled).
func (h *channelHealth) reset() {
	h.steered.Add(1)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.until.Store(0)
	h.quotaUntil.Store(0)
	h.limitedUntil.Store(0)
	h.overloadedUntil.Store(0)
	h.refused.Store(nil)
	h.lacks.Store(nil)
	h.classes.Store(nil)
	h.consecutive = 0
	h.resetAt = time.Now()
	h.resetBreaker()
}

// backoff is base doubled for every consecutive failure after the first.
func backoff(base time.Duration, consecutive int) time.Duration {
	d := base
	for i := 1; i < consecutive && d < 24*time.Hour; i++ {
		d *= 2
	}
	return d
}
