package limits

import (
	"sync"
	"time"
)

// tokenBucket is a token bucket that can go into debt: a request is
// charged an estimate when admitted and corrected with its real usage when
// it ends, so a request larger than what was left passes and the debt holds
// the next ones back until the bucket refills. (golang.org/x/time/rate,
// used for request rates, cannot give tokens back or take them after the
// fact.)
type tokenBucket struct {
	mu     sync.Mutex
	perSec float64
	burst  float64
	level  float64
	last   time.Time
}

func newTokenBucket(s Rate, now time.Time) *tokenBucket {
	return &tokenBucket{perSec: s.PerSecond(), burst: s.N, level: s.N, last: now}
}

func (b *tokenBucket) refill(now time.Time) {
	if now.After(b.last) {
		b.level = min(b.burst, b.level+now.Sub(b.last).Seconds()*b.perSec)
		b.last = now
	}
}

// wait is how long until the bucket holds a token again; zero when it does.
func (b *tokenBucket) wait(now time.Time) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now)
	if b.level >= 1 {
		return 0
	}
	return time.Duration((1 - b.level) / b.perSec * float64(time.Second))
}

// levelAt is what the bucket holds at now, without taking anything.
func (b *tokenBucket) levelAt(now time.Time) float64 {
	level, _, _ := b.state(now)
	return level
}

// state is the bucket's level at now, and its rate and size.
func (b *tokenBucket) state(now time.Time) (level, perSec, burst float64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now)
	return b.level, b.perSec, b.burst
}

// full reports whether the bucket has refilled completely.
func (b *tokenBucket) full(now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now)
	return b.level >= b.burst
}

// charge takes n tokens (gives them back when negative).
func (b *tokenBucket) charge(now time.Time, n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now)
	b.level = min(b.burst, b.level-float64(n))
}

func (b *tokenBucket) configure(s Rate, now time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.refill(now)
	b.perSec, b.burst = s.PerSecond(), s.N
	b.level = min(b.level, b.burst)
}
