package health

import (
	"math"
	"sync/atomic"
	"time"
)

// CooldownPolicy is what a channel's config says about cooling it down.
type CooldownPolicy struct {
	Base time.Duration // after a transient failure; doubles while they repeat
	Max  time.Duration // cap for every cooldown but auth
	Auth time.Duration // after the credential or account was refused
	// Capability is how long a model the upstream refused, or a feature it
	// said it lacks, stays set aside on the channel
	Capability time.Duration
}

// defaultRateLimitWait is the cooldown after a 429 that gave no hint.
const defaultRateLimitWait = 5 * time.Second

// Quota reports whether the channel's upstream said a quota is spent at
// now (as the fleet stored or published it before quotas were kept per
// class), and until when.
func (h *Channel) Quota(now time.Time) (bool, time.Time) {
	if q := h.quotaUntil.Load(); q > now.UnixNano() {
		return true, time.Unix(0, q)
	}
	return false, time.Time{}
}

// OutBy says what keeps a channel (or a model class on it) out: what its
// upstream said, whose words the relay's refusal then speaks, or anything
// else.
type OutBy uint8

// What keeps a channel out.
const (
	OutOther    OutBy = iota // a failure of the channel, its breaker, a person, a spend cap
	OutReset                 // an upstream's 429 with a time to come back, or a spent anthropic-ratelimit-* quota
	OutOverload              // an upstream's 529: overloaded
)

// OutBy says what keeps the channel out at now when it is not available:
// only its upstream's 429 wait (its cooldown is that wait), only its
// upstream's 529, or anything else (a breaker open, a person, failures).
func (h *Channel) OutBy(now time.Time) OutBy {
	n := now.UnixNano()
	u := h.until.Load()
	switch {
	case h.disabled.Load() || u <= n || h.openUntil.Load() > n:
		return OutOther
	case u <= h.limitedUntil.Load():
		return OutReset
	case u <= h.overloadedUntil.Load():
		return OutOverload
	}
	return OutOther
}

// QuotaSpent records that the upstream said a quota of class is spent
// until until (reason: the header that said so): the class cools until
// then, its whole cooldown an upstream's reset. (A channel's own quota is
// set only by what the fleet stored or published before quotas were kept
// per class.)
func (h *Channel) QuotaSpent(class string, until time.Time, reason string, now time.Time) {
	ms := until.Sub(now).Milliseconds()
	h.mu.Lock()
	moved := h.coolClass(class, until.UnixNano(), until.UnixNano(), 0, reason, now)
	h.mu.Unlock()
	if moved {
		h.announce(change{Kind: changeCool, Class: class, Until: ms, Limited: ms, Reason: reason})
	}
}

// maxSetAside bounds the models remembered as refused, and the features
// as lacking, per channel: clients choose the names.
const maxSetAside = 256

// Refuses reports whether the upstream refused model on this channel, and
// until when it stays set aside.
func (h *Channel) Refuses(model string, now time.Time) (bool, time.Time) {
	m := h.refused.Load()
	if m == nil {
		return false, time.Time{}
	}
	if until, ok := (*m)[model]; ok && until > now.UnixNano() {
		return true, time.Unix(0, until)
	}
	return false, time.Time{}
}

// Refused is the models the upstream refused on the channel, each until
// when it stays set aside, in Unix nanoseconds (ended ones included); nil
// when none. It is read only.
func (h *Channel) Refused() map[string]int64 { return loadSetAside(&h.refused) }

// Lacking is the features the upstream said the channel lacks, each until
// when it stays set aside, in Unix nanoseconds (ended ones included); nil
// when none. It is read only, and read without a lock or an allocation.
func (h *Channel) Lacking() map[string]int64 { return loadSetAside(&h.lacks) }

// loadSetAside is the map m points to, nil when none.
func loadSetAside(m *atomic.Pointer[map[string]int64]) map[string]int64 {
	if cur := m.Load(); cur != nil {
		return *cur
	}
	return nil
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

// Record updates the cooldown, the latency and the last error with a
// verdict (firstByte: the attempt's first-byte time, 0 when none) and
// returns the cooldown it started (zero when none): the part of an
// attempt's verdict Finish records after the breaker's and the counters'.
func (h *Channel) Record(v Verdict, p CooldownPolicy, now time.Time, firstByte time.Duration) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if firstByte > 0 {
		ms, cur := float64(firstByte)/float64(time.Millisecond), h.Latency()
		if cur != 0 {
			ms = cur + ewmaWeight*(ms-cur)
		}
		h.ewmaMs.Store(math.Float64bits(ms))
		h.ewmaAt.Store(now.UnixNano())
	}
	var d time.Duration
	switch v.Outcome {
	case Success, ClientError:
		h.consecutive = 0
		return 0
	case Canceled:
		return 0
	case ModelRefused:
		// the request chose the model: only that model is set aside, and
		// the channel stays as healthy as it was
		setAside(&h.refused, v.Model, now, now.Add(p.Capability))
		h.lastError, h.lastReason, h.lastErrorAt = v.Outcome, v.Reason+": "+v.Model, now
		return 0
	case LacksFeature:
		// the request carried the feature: the channel stays as healthy
		// as it was, and requests without it still come
		for _, f := range v.Features {
			setAside(&h.lacks, f, now, now.Add(p.Capability))
		}
		h.lastError, h.lastReason, h.lastErrorAt = v.Outcome, v.Reason, now
		return 0
	case Auth:
		d = p.Auth
	case RateLimited:
		d = v.Wait
		if d <= 0 {
			d = defaultRateLimitWait
		}
	case Overloaded:
		d = p.Base
	case Transient:
		h.consecutive++
		d = backoff(p.Base, h.consecutive)
	}
	if v.Outcome != Auth && d > p.Max {
		d = p.Max
	}
	if v.Class != "" && v.Outcome.ByClass() {
		return h.recordClass(v, d, now)
	}
	h.lastError, h.lastReason, h.lastErrorAt = v.Outcome, v.Reason, now
	h.extend(now.Add(d))
	c := change{Kind: changeCool, Until: d.Milliseconds(), Error: v.Outcome.String(), Reason: v.Reason}
	switch v.Outcome {
	case RateLimited:
		raiseTo(&h.limitedUntil, now.Add(d).UnixNano())
		c.Limited = c.Until
	case Overloaded:
		raiseTo(&h.overloadedUntil, now.Add(d).UnixNano())
	}
	h.announce(c)
	return d
}

// recordClass cools v's model class on the channel for d (a 429's wait,
// a 529's cooldown), not the channel, and returns d. h.mu is held.
func (h *Channel) recordClass(v Verdict, d time.Duration, now time.Time) time.Duration {
	h.lastError, h.lastReason, h.lastErrorAt = v.Outcome, v.Reason+" (class "+v.Class+")", now
	until, limited, overloaded := now.Add(d).UnixNano(), int64(0), int64(0)
	c := change{Kind: changeCool, Class: v.Class, Until: d.Milliseconds(), Error: v.Outcome.String(), Reason: v.Reason}
	switch v.Outcome {
	case RateLimited:
		limited, c.Limited = until, c.Until
	case Overloaded:
		overloaded = until
	}
	h.coolClass(v.Class, until, limited, overloaded, v.Reason, now)
	h.announce(c)
	return d
}

// extend moves the end of the cooldown to t unless it already ends later.
func (h *Channel) extend(t time.Time) { raiseTo(&h.until, t.UnixNano()) }

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

// Reset clears the cooldown, the model classes' cooldowns, the spent
// quota, the refused models, the failure streak and the breaker: the
// channel is healthy again (unless disabled). A shared channel is reset
// on every relay of the fleet.
func (h *Channel) Reset() {
	h.reset()
	h.announce(change{Kind: changeReset})
}

// Disable takes the channel out until Enable: attempts in flight finish,
// new requests skip it. A shared channel is disabled on every relay of
// the fleet.
func (h *Channel) Disable() {
	h.steered.Add(1)
	h.disabled.Store(true)
	h.announce(change{Kind: changeDisable})
}

// Enable puts a disabled channel back; on every relay of the fleet when
// it is shared.
func (h *Channel) Enable() {
	h.steered.Add(1)
	h.disabled.Store(false)
	h.announce(change{Kind: changeEnable})
}

// reset is Reset on this relay alone.
func (h *Channel) reset() {
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
