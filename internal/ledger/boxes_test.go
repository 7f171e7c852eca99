package ledger

import (
	"database/sql/driver"
	"runtime"
	"testing"

	"github.com/jackc/pgx/v5/pgtype"
)

// TestInt64BoxesKeepTheirValues: a box reads as the int64 it was made
// of, as each way to a database reads it (the SQLite writer's binding,
// database/sql's converter, pgx), and keeps it past the buffer being
// replaced and a collection; a small value is an int64 as it is.
func TestInt64BoxesKeepTheirValues(t *testing.T) {
	var b int64Boxes
	var boxes []any
	for i := range int64(5000) { // several buffers
		boxes = append(boxes, b.box(i*1_000_003-7))
	}
	runtime.GC()
	for i, x := range boxes {
		want := int64(i)*1_000_003 - 7
		box, ok := x.(*int64Box)
		if !ok || box.v != want {
			t.Fatalf("box %d = %#v, want a box of %d", i, x, want)
		}
		if v, err := driver.DefaultParameterConverter.ConvertValue(x); err != nil || v != any(want) {
			t.Fatalf("box %d converts to %#v (%v), want int64 %d", i, v, err, want)
		}
		if v, err := x.(pgtype.Int64Valuer).Int64Value(); err != nil || v != (pgtype.Int8{Int64: want, Valid: true}) {
			t.Fatalf("box %d is %#v (%v) to pgx, want %d", i, v, err, want)
		}
	}
	if x := b.box(200); x != any(int64(200)) {
		t.Errorf("a small value is boxed as %#v, want int64 200", x)
	}
	b.reset()
	if x := b.box(1 << 50); x.(*int64Box).v != 1<<50 {
		t.Errorf("after reset: %#v", x)
	}
	if allocs := testing.AllocsPerRun(100, func() { b.reset(); _ = b.box(12345) }); allocs != 0 {
		t.Errorf("a box allocated %v times", allocs)
	}
}
