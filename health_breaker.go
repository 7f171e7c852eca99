package relay

import (
	"errors"
	"time"

	"github.com/sony/gobreaker/v2"
)

// breakerSettings are a channel's resolved breaker options.
type breakerSettings struct {
	window      time.Duration
	ratio       float64
	minRequests uint32
	openFor     time.Duration
	probes      uint32
}

// Breaker defaults.
var defaultBreaker = breakerSettings{window: 10 * time.Second, ratio: 0.6, minRequests: 5, openFor: 30 * time.Second, probes: 1}

// failureRatio is the share of failed attempts in the breaker's window.
func (h *channelHealth) failureRatio() float64 {
	c := h.breaker.Load().Counts()
	if judged := c.TotalSuccesses + c.TotalFailures; judged > 0 {
		return float64(c.TotalFailures) / float64(judged)
	}
	return 0
}

// resetBreaker starts a closed breaker with the current settings. h.mu is
// held.
func (h *channelHealth) resetBreaker() {
	s := h.settings
	h.openUntil.Store(0)
	h.breaker.Store(gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		MaxRequests:  s.probes,
		Interval:     s.window,
		BucketPeriod: s.window / 10,
		Timeout:      s.openFor,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if h.forcing.Load() {
				return true
			}
			judged := c.TotalSuccesses + c.TotalFailures
			return judged >= s.minRequests && float64(c.TotalFailures)/float64(judged) >= s.ratio-1e-9
		},
		IsExcluded: func(err error) bool { return err == errBreakerExcluded },
		// gobreaker keeps its own time (time.Now): the end of an open
		// state is reckoned on the same clock as its own switch to
		// half-open. (Tests run it in a testing/synctest bubble.)
		OnStateChange: func(_ string, from, to gobreaker.State) {
			if to == gobreaker.StateOpen {
				h.openUntil.Store(time.Now().Add(s.openFor).UnixNano())
			}
			if h.forcing.Load() {
				return
			}
			switch {
			case to == gobreaker.StateOpen:
				h.announce(healthChange{Kind: changeOpen, Open: s.openFor.Milliseconds()})
			case to == gobreaker.StateClosed && from == gobreaker.StateHalfOpen:
				h.announce(healthChange{Kind: changeClosed})
			}
		},
	}))
}

// forceOpen opens the breaker because another node's opened: it fails
// one attempt on a breaker made to trip at once. A breaker already open or
// half-open stays as it is.
func (h *channelHealth) forceOpen() {
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
func (h *channelHealth) closeBreaker() {
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
