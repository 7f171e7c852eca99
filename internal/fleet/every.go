package fleet

import (
	"context"
	"time"
)

// Every runs fn every period, and each time wake receives (a nil wake
// never does), until ctx ends: the loop of the fleet's background work.
func Every(ctx context.Context, period time.Duration, wake <-chan struct{}, fn func()) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-wake:
		}
		fn()
	}
}
