package limits

import (
	"math"
	"time"
)

// Headroom is what a limiter's request rate and token limit have left, and
// when each is full again.
type Headroom struct {
	Known        bool      // from the fleet's store; else unknown, read the limiter
	Requests     int64     // requests the rate has left
	RequestsFull time.Time // when the rate is full again
	Tokens       int64     // tokens the token limit has left
	TokensFull   time.Time // when the token limit is full again
}

// charge takes n more tokens off what a token limit of spec has left.
func (h *Headroom) charge(spec Rate, n int64) {
	if !h.Known || spec.N == 0 {
		return
	}
	h.Tokens = max(0, h.Tokens-n)
	h.TokensFull = h.TokensFull.Add(seconds(float64(n) / spec.PerSecond()))
}

// maxFull bounds how long a limit says it takes to be full again, as the
// relay bounds an upstream's wait hint: a day.
const maxFull = 24 * time.Hour

// seconds is a duration of s seconds, at most maxFull (a limit of one
// token a year in debt would overflow a Duration).
func seconds(s float64) time.Duration {
	return time.Duration(min(s, maxFull.Seconds()) * float64(time.Second))
}

// Left is what the limiter has left at now, as far as a request that holds
// g knows (the fleet store's answer to it, or this relay's own limits),
// and the limits it has.
func (l *Limiter) Left(now time.Time, g Grant) (Spec, Headroom) {
	l.mu.Lock()
	spec, requests, tokens := l.spec, l.requests, l.tokens
	l.mu.Unlock()
	if g.Left.Known {
		return spec, g.Left
	}
	h := Headroom{RequestsFull: now, TokensFull: now}
	if requests != nil {
		left, burst := requests.TokensAt(now), float64(requests.Burst())
		h.Requests = int64(max(0, math.Floor(left)))
		if left < burst {
			h.RequestsFull = now.Add(seconds((burst - left) / float64(requests.Limit())))
		}
	}
	if tokens != nil {
		level, perSec, burst := tokens.state(now)
		h.Tokens = int64(max(0, math.Floor(level)))
		if level < burst {
			h.TokensFull = now.Add(seconds((burst - level) / perSec))
		}
	}
	return spec, h
}
