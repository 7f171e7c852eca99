// Package loop runs the relay's background work: a function called on a
// ticker, and whenever someone asks for it sooner, until its context ends.
package loop

import (
	"context"
	"time"
)

// Every runs fn every period, and each time wake receives (a nil wake
// never does), until ctx ends: the loop of the relay's background work.
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
