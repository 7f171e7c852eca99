package limits

import (
	"testing"
	"time"
)

func TestRetryBudget(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	t.Run("ratio of requests over the window", func(t *testing.T) {
		var b RetryBudget
		for i := 0; i < 100; i++ {
			b.Request(t0)
		}
		allowed := 0
		for i := 0; i < 100; i++ {
			if b.AllowRetry(t0.Add(time.Second), 0.2, 0) {
				allowed++
			}
		}
		if allowed != 20 {
			t.Errorf("allowed %d retries for 100 requests at 20%%, want 20", allowed)
		}
	})
	t.Run("floor per second over the window", func(t *testing.T) {
		var b RetryBudget
		allowed := 0
		for i := 0; i < 100; i++ {
			if b.AllowRetry(t0, 0.2, 3) {
				allowed++
			}
		}
		if allowed != 30 {
			t.Errorf("allowed %d retries with no requests and a floor of 3/s, want 30 (10s window)", allowed)
		}
	})
	t.Run("old seconds leave the window", func(t *testing.T) {
		var b RetryBudget
		for i := 0; i < 10; i++ {
			b.Request(t0)
		}
		if !b.AllowRetry(t0, 0.1, 0) || b.AllowRetry(t0, 0.1, 0) {
			t.Fatal("10 requests at 10% allow exactly one retry")
		}
		later := t0.Add(budgetBuckets * time.Second)
		for i := 0; i < 10; i++ {
			b.Request(later)
		}
		if !b.AllowRetry(later, 0.1, 0) {
			t.Errorf("after the window slid past the old retry, a new one fits")
		}
	})
}
