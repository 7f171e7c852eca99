package relay

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// channelStates holds the health of every channel by name, process-wide, so
// that a config reload which keeps a channel keeps its cooldown: the new
// config takes a reference before the old one releases its own.
var channelStates = caddy.NewUsagePool()

// cooldownPolicy is what a channel's config says about cooling it down.
type cooldownPolicy struct {
	base time.Duration // after a transient failure; doubles while they repeat
	max  time.Duration // cap for every cooldown but auth
	auth time.Duration // after the credential or account was refused
}

// defaultRateLimitWait is the cooldown after a 429 that gave no hint.
const defaultRateLimitWait = 5 * time.Second

// channelHealth is the health of one channel. It outlives config reloads
// (see channelStates) and is shared by every group that lists the channel.
type channelHealth struct {
	// until is the end of the current cooldown in Unix nanoseconds; read
	// without the lock on every selection.
	until atomic.Int64

	mu          sync.Mutex
	consecutive int     // transient failures in a row, for the exponential cooldown
	last        outcome // outcome of the last finished attempt
}

// Destruct implements caddy.Destructor.
func (*channelHealth) Destruct() error { return nil }

// available reports whether the channel may take a request at now, and if
// not, when it may again.
func (h *channelHealth) available(now time.Time) (bool, time.Time) {
	u := h.until.Load()
	if u <= now.UnixNano() {
		return true, time.Time{}
	}
	return false, time.Unix(0, u)
}

// record takes the verdict of a finished attempt and returns the cooldown it
// started (zero when none).
func (h *channelHealth) record(v verdict, p cooldownPolicy, now time.Time) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.last = v.outcome
	var d time.Duration
	switch v.outcome {
	case outcomeSuccess, outcomeClientError:
		h.consecutive = 0
		return 0
	case outcomeCanceled:
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
	h.extend(now.Add(d))
	return d
}

// extend moves the end of the cooldown to t unless it already ends later.
func (h *channelHealth) extend(t time.Time) {
	n := t.UnixNano()
	if n > h.until.Load() {
		h.until.Store(n)
	}
}

// backoff is base doubled for every consecutive failure after the first.
func backoff(base time.Duration, consecutive int) time.Duration {
	d := base
	for i := 1; i < consecutive && d < 24*time.Hour; i++ {
		d *= 2
	}
	return d
}
