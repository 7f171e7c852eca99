package limits

import (
	"sync"
	"time"
)

// Retry budget defaults.
const (
	DefaultRetryBudget      = 0.2
	DefaultRetryBudgetFloor = 10 // retries per second
	budgetBuckets           = 10 // one per second: a 10s sliding window
)

// RetryBudget counts a group's requests and retries over a sliding window
// of budgetBuckets seconds.
type RetryBudget struct {
	mu      sync.Mutex
	buckets [budgetBuckets]budgetBucket
}

// budgetBucket counts one second.
type budgetBucket struct {
	sec               int64
	requests, retries int
}

// bucket returns the bucket of now's second, emptied if it held an older
// second.
func (b *RetryBudget) bucket(now time.Time) *budgetBucket {
	sec := now.Unix()
	bk := &b.buckets[sec%budgetBuckets]
	if bk.sec != sec {
		bk.sec, bk.requests, bk.retries = sec, 0, 0
	}
	return bk
}

// Request counts a request of the group.
func (b *RetryBudget) Request(now time.Time) {
	b.mu.Lock()
	b.bucket(now).requests++
	b.mu.Unlock()
}

// Retries counts the retries over every second the budget remembers.
func (b *RetryBudget) Retries() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, bk := range b.buckets {
		n += bk.retries
	}
	return n
}

// AllowRetry reports whether one more retry fits the budget: retries over
// the window may reach ratio times the requests over the window, and never
// less than floor per second. An allowed retry is counted.
func (b *RetryBudget) AllowRetry(now time.Time, ratio, floor float64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	cur := b.bucket(now)
	requests, retries := 0, 0
	oldest := now.Unix() - budgetBuckets + 1
	for i := range b.buckets {
		if bk := &b.buckets[i]; bk.sec >= oldest {
			requests += bk.requests
			retries += bk.retries
		}
	}
	if float64(retries+1) > max(ratio*float64(requests), floor*budgetBuckets) {
		return false
	}
	cur.retries++
	return true
}
