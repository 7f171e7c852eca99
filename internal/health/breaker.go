package health

import (
	"errors"
	"time"

	"github.com/sony/gobreaker/v2"
)

// BreakerSettings are a channel's resolved breaker options.
type BreakerSettings struct {
	Window      time.Duration // the sliding window the failure ratio is of
	Ratio       float64       // the share of failed attempts that opens the breaker
	MinRequests uint32        // the fewest judged attempts in the window that may open it
	OpenFor     time.Duration // how long it stays open before it turns half-open
	Probes      uint32        // the attempts a half-open breaker lets through
}

// DefaultBreaker is the breaker of a channel whose config sets none of
// its options.
var DefaultBreaker = BreakerSettings{Window: 10 * time.Second, Ratio: 0.6, MinRequests: 5, OpenFor: 30 * time.Second, Probes: 1}

// Configure gives the (possibly surviving) state a config's breaker
// settings. gobreaker cannot change its settings, so new settings start a
// new breaker; unchanged settings keep the breaker and its counts.
func (h *Channel) Configure(s BreakerSettings) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.breaker.Load() == nil || s != h.settings {
		h.settings = s
		h.resetBreaker()
	}
}

// FailureRatio is the share of failed attempts in the breaker's window.
func (h *Channel) FailureRatio() float64 {
	c := h.breaker.Load().Counts()
	if judged := c.TotalSuccesses + c.TotalFailures; judged > 0 {
		return float64(c.TotalFailures) / float64(judged)
	}
	return 0
}

// resetBreaker starts a closed breaker with the current settings. h.mu is
// held.
func (h *Channel) resetBreaker() {
	s := h.settings
	h.openUntil.Store(0)
	h.breaker.Store(gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		MaxRequests:  s.Probes,
		Interval:     s.Window,
		BucketPeriod: s.Window / 10,
		Timeout:      s.OpenFor,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if h.forcing.Load() {
				return true
			}
			judged := c.TotalSuccesses + c.TotalFailures
			return judged >= s.MinRequests && float64(c.TotalFailures)/float64(judged) >= s.Ratio-1e-9
		},
		IsExcluded: func(err error) bool { return err == errBreakerExcluded },
		// gobreaker keeps its own time (time.Now): the end of an open
		// state is reckoned on the same clock as its own switch to
		// half-open. (Tests run it in a testing/synctest bubble.)
		OnStateChange: func(_ string, from, to gobreaker.State) {
			if to == gobreaker.StateOpen {
				h.openUntil.Store(time.Now().Add(s.OpenFor).UnixNano())
			}
			if h.forcing.Load() {
				return
			}
			switch {
			case to == gobreaker.StateOpen:
				h.announce(change{Kind: changeOpen, Open: s.OpenFor.Milliseconds()})
			case to == gobreaker.StateClosed && from == gobreaker.StateHalfOpen:
				h.announce(change{Kind: changeClosed})
			}
		},
	}))
}

// forceOpen opens the breaker because another node's opened: it fails
// one attempt on a breaker made to trip at once. A breaker already open or
// half-open stays as it is.
func (h *Channel) forceOpen() {
	h.mu.Lock()
	defer h.mu.Unlock()
	b := h.breaker.Load()
	if b.State() != gobreaker.StateClosed {
		return
	}
	h.forcing.Store(true)
	defer h.forcing.Store(false)
	if done, err := b.Allow(); err == nil {
		done(errBreakerFailure)
	}
}

// closeBreaker closes the breaker because another node's closed after its
// probes succeeded.
func (h *Channel) closeBreaker() {
	h.steered.Add(1)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.breaker.Load().State() != gobreaker.StateClosed {
		h.resetBreaker()
	}
}

// What an attempt reports to the breaker: nil is a success.
var (
	errBreakerFailure  = errors.New("transient failure")
	errBreakerExcluded = errors.New("not the channel's health")
)
