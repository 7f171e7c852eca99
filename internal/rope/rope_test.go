package rope

import (
	"bytes"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
)

// TestARopeHoldsWhatWasWrittenInOrder writes pieces of every size, as
// bytes, strings and bytes, and reads them back.
func TestARopeHoldsWhatWasWrittenInOrder(t *testing.T) {
	var r Rope
	var want bytes.Buffer
	rnd := rand.New(rand.NewPCG(1, 2))
	for i := 0; want.Len() < 1<<20; i++ {
		p := strings.Repeat(string(rune('a'+i%26)), rnd.IntN(3*maxChunk/2))
		switch i % 3 {
		case 0:
			_, _ = r.Write([]byte(p))
		case 1:
			r.WriteString(p)
		default:
			_ = r.WriteByte('x')
			p = "x"
		}
		want.WriteString(p)
	}
	var got bytes.Buffer
	if n, err := r.WriteTo(&got); err != nil || n != int64(want.Len()) || r.Len() != want.Len() {
		t.Fatalf("WriteTo: %d, %v; Len %d; want %d", n, err, r.Len(), want.Len())
	}
	if !bytes.Equal(got.Bytes(), want.Bytes()) {
		t.Fatal("the rope does not hold what was written")
	}
	if !bytes.Equal(r.AppendTo(nil), want.Bytes()) {
		t.Fatal("AppendTo differs")
	}
}

// TestARopeAllocatesAboutWhatItHolds: growing a rope never copies what
// it holds, so what it allocated is what it holds and one chunk's spare
// room.
func TestARopeAllocatesAboutWhatItHolds(t *testing.T) {
	piece := []byte(`{"type":"text","text":"a"},`)
	for _, size := range []int{100, 10 << 10, 8 << 20} {
		// TotalAlloc counts the whole process's allocations, the test
		// framework's and the race detector's too: a small rope is built
		// many times, so that what others allocate meanwhile is a small
		// share of each
		runs := min(max(1, (1<<20)/size), 1000)
		var before, after runtime.MemStats
		var held int
		runtime.ReadMemStats(&before)
		for range runs {
			var r Rope
			for r.Len() < size {
				_, _ = r.Write(piece)
			}
			held = r.Len()
		}
		runtime.ReadMemStats(&after)
		n := (after.TotalAlloc - before.TotalAlloc) / uint64(runs)
		if bound := uint64(held + min(max(held, minChunk), maxChunk) + 4<<10); n > bound {
			t.Errorf("holding %d bytes allocated %d, want at most %d", held, n, bound)
		}
	}
}

// TestCutTakesOutWhatFollowsAMark puts something before what was written
// since a mark, across chunks and within one.
func TestCutTakesOutWhatFollowsAMark(t *testing.T) {
	for _, tail := range []int{0, 10, maxChunk + 10} {
		var r Rope
		r.WriteString(strings.Repeat("a", 1000))
		m := r.Mark()
		r.WriteString(strings.Repeat("b", tail))
		held := r.Cut(m, []byte("held:"))
		if string(held) != "held:"+strings.Repeat("b", tail) || r.Len() != 1000 {
			t.Fatalf("tail %d: held %d bytes, the rope %d", tail, len(held), r.Len())
		}
		r.WriteString("c")
		_, _ = r.Write(held[len("held:"):])
		r.WriteString("d")
		if got, want := string(r.AppendTo(nil)), strings.Repeat("a", 1000)+"c"+strings.Repeat("b", tail)+"d"; got != want || r.Len() != len(want) {
			t.Errorf("tail %d: %d bytes, want %d", tail, len(got), len(want))
		}
	}
}

// TestAppendAndResetMoveAndEmpty: Append moves a rope's chunks to the end
// of another; Reset empties a rope for reuse.
func TestAppendAndResetMoveAndEmpty(t *testing.T) {
	var a, b Rope
	a.WriteString("first,")
	b.WriteString(strings.Repeat("b", 3*maxChunk))
	a.Append(&b)
	a.WriteString(",last")
	if got := string(a.AppendTo(nil)); got != "first,"+strings.Repeat("b", 3*maxChunk)+",last" || a.Len() != len(got) || b.Len() != 0 {
		t.Fatalf("append: %d bytes, b %d", len(got), b.Len())
	}
	a.Reset()
	a.WriteString("again")
	if got := string(a.AppendTo(nil)); got != "again" || a.Len() != 5 {
		t.Errorf("after Reset: %q", got)
	}
}
