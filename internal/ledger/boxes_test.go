package ledger

import (
	"runtime"
	"testing"
)

// TestInt64BoxesKeepTheirValues: a box reads as the int64 it was made
// of, through a type switch and ==, and keeps it past the buffer being
// replaced and a collection.
func TestInt64BoxesKeepTheirValues(t *testing.T) {
	var b int64Boxes
	var boxes []any
	for i := range int64(5000) { // several buffers
		boxes = append(boxes, b.box(i*1_000_003-7))
	}
	runtime.GC()
	for i, x := range boxes {
		want := int64(i)*1_000_003 - 7
		v, ok := x.(int64)
		if !ok || v != want || x != any(want) {
			t.Fatalf("box %d = %#v, want int64 %d", i, x, want)
		}
	}
	b.reset()
	if x := b.box(1 << 50); x != any(int64(1<<50)) {
		t.Errorf("after reset: %#v", x)
	}
	if allocs := testing.AllocsPerRun(100, func() { b.reset(); _ = b.box(12345) }); allocs != 0 {
		t.Errorf("a box allocated %v times", allocs)
	}
}
