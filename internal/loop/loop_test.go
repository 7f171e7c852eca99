package loop

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

// Every calls its function at each tick and at each wake, and returns once
// its context ends.
func TestEvery(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		wake := make(chan struct{})
		calls := 0
		done := make(chan struct{})
		go func() {
			defer close(done)
			Every(ctx, time.Minute, wake, func() { calls++ })
		}()
		time.Sleep(time.Minute + time.Second)
		synctest.Wait()
		if calls != 1 {
			t.Fatalf("after a tick: %d calls, want 1", calls)
		}
		wake <- struct{}{}
		synctest.Wait()
		if calls != 2 {
			t.Fatalf("after a wake: %d calls, want 2", calls)
		}
		cancel()
		<-done
		if calls != 2 {
			t.Errorf("after the end: %d calls, want 2", calls)
		}
	})
}
