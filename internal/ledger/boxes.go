package ledger

import "unsafe"

// int64Boxes hands out a batch's int64 values as interfaces that point
// into one buffer, where boxing each (as any(v) does for a value past
// 255) makes an allocation of its own: five or more a row, which cost
// the writer about a tenth of its time in allocation and the collector.
//
// A box stays valid for as long as it is referenced: a full buffer is
// replaced, never grown in place, so the boxes made before still point
// into the old one, which the collector keeps while they do. reset
// reuses the buffer, so the values it boxed must no longer be read: the
// writer resets it only before a statement's values, after the last
// statement that read them ran.
type int64Boxes struct{ vals []int64 }

// eface is the layout of an interface{} value.
type eface struct {
	typ  unsafe.Pointer
	data unsafe.Pointer
}

// int64Type is the runtime's type of int64, as an interface holds it.
var int64Type = func() unsafe.Pointer {
	var v any = int64(1 << 40)
	return (*eface)(unsafe.Pointer(&v)).typ
}()

func (b *int64Boxes) box(v int64) any {
	if v >= 0 && v < 256 {
		return v // the runtime boxes these without allocating
	}
	if len(b.vals) == cap(b.vals) {
		b.vals = make([]int64, 0, max(2*cap(b.vals), 1024))
	}
	b.vals = append(b.vals, v)
	var x any
	e := (*eface)(unsafe.Pointer(&x))
	e.typ, e.data = int64Type, unsafe.Pointer(&b.vals[len(b.vals)-1])
	return x
}

func (b *int64Boxes) reset() { b.vals = b.vals[:0] }
