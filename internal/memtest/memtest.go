// Package memtest measures what code allocates, for tests that hold
// decoding and translation to memory bounds. It is test support: no
// production code imports it.
package memtest

import (
	"math"
	"runtime"
)

// Allocated is what f allocates, in bytes: the least of two runs, so that
// what other goroutines allocate meanwhile (an earlier test's servers
// winding down) counts as little as it can.
func Allocated(f func()) uint64 {
	least := uint64(math.MaxUint64)
	for range 2 {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		f()
		runtime.ReadMemStats(&after)
		least = min(least, after.TotalAlloc-before.TotalAlloc)
	}
	return least
}

// Repeated is a JSON body of about size bytes: prefix, then elem again and
// again, comma-separated, then suffix.
func Repeated(prefix, elem, suffix string, size int) []byte {
	b := make([]byte, 0, size+len(elem))
	b = append(b, prefix...)
	for n := 0; len(b)+len(elem)+len(suffix) < size; n++ {
		if n > 0 {
			b = append(b, ',')
		}
		b = append(b, elem...)
	}
	return append(b, suffix...)
}

// PerByte is what a body's handling allocated, per byte of the body.
func PerByte(n uint64, body []byte) float64 { return float64(n) / float64(len(body)) }

// BoundedBodies is the size of the bodies that tests of memory bounds
// translate, and a factor for their bounds: under the race detector,
// which is slow and empties sync.Pools at random (so the JSON encoders and
// decoders are made anew), smaller bodies and three times the bound.
func BoundedBodies() (size int, factor float64) {
	if Race {
		return 512 << 10, 3
	}
	return 2 << 20, 1
}

// EmptyMessages is 8 MiB of empty messages: the body that once made the
// translation allocate gigabytes, for a minute, before its 400.
func EmptyMessages() []byte {
	return Repeated(`{"model":"claude-sonnet-5-5","messages":[`, `{}`, `]}`, 8<<20)
}
