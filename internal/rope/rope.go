// Package rope is a write buffer that grows by chunks instead of by copying
// what it holds into a larger array. A bytes.Buffer that grows to n bytes
// by doubling has allocated between 2n and 4n along the way; a Rope has
// allocated n and the spare room of its last chunk: no more than it holds
// (or 64 bytes), and 64 KiB. It suits output that is written once, in
// order, and read once: a request body being translated.
package rope

import "io"

// maxChunk is the size a rope's chunks grow to; a write larger than that
// gets a chunk of its own size.
const maxChunk = 64 << 10

// minChunk is the size of a rope's first chunk.
const minChunk = 64

// Rope is a write buffer made of chunks. The zero value is empty and ready
// to use.
type Rope struct {
	chunks [][]byte // the last one is being filled
	n      int
}

// Mark is a place in a rope: where the next byte written goes, at the time
// Mark was called.
type Mark struct{ chunk, off int }

// Len returns the number of bytes the rope holds.
func (r *Rope) Len() int { return r.n }

// Write appends p. It never fails.
func (r *Rope) Write(p []byte) (int, error) {
	write(r, p)
	return len(p), nil
}

// WriteString appends s.
func (r *Rope) WriteString(s string) { write(r, s) }

// WriteByte appends c. It never fails.
func (r *Rope) WriteByte(c byte) error {
	last := r.room(1)
	r.chunks[last] = append(r.chunks[last], c)
	r.n++
	return nil
}

func write[T string | []byte](r *Rope, p T) {
	r.n += len(p)
	for len(p) > 0 {
		last := r.room(len(p))
		c := r.chunks[last]
		k := min(len(p), cap(c)-len(c))
		r.chunks[last] = append(c, p[:k]...)
		p = p[k:]
	}
}

// room returns the index of the chunk to write to, with room for a byte
// at least; a new chunk, sized like what the rope holds (within minChunk
// and maxChunk) or to hold want bytes, when the last one is full.
func (r *Rope) room(want int) int {
	last := len(r.chunks) - 1
	if last >= 0 && len(r.chunks[last]) < cap(r.chunks[last]) {
		return last
	}
	size := min(max(r.n, minChunk), maxChunk)
	if want > maxChunk {
		size = want
	}
	r.chunks = append(r.chunks, make([]byte, 0, size))
	return last + 1
}

// Reset empties the rope, keeping its first chunk for what is written
// next: for a rope whose content was copied out (WriteTo), not moved
// (Append).
func (r *Rope) Reset() {
	if len(r.chunks) > 0 {
		r.chunks = append(r.chunks[:0], r.chunks[0][:0])
	}
	r.n = 0
}

// Mark returns where the next byte written goes.
func (r *Rope) Mark() Mark {
	last := r.room(1)
	return Mark{chunk: last, off: len(r.chunks[last])}
}

// Cut appends to b what was written since Mark returned m, and takes it
// out of the rope: what is written next goes at m again. Only the most
// recent mark may be used, once.
func (r *Rope) Cut(m Mark, b []byte) []byte {
	start := len(b)
	b = append(b, r.chunks[m.chunk][m.off:]...)
	for _, c := range r.chunks[m.chunk+1:] {
		b = append(b, c...)
	}
	r.chunks[m.chunk] = r.chunks[m.chunk][:m.off]
	clear(r.chunks[m.chunk+1:])
	r.chunks = r.chunks[:m.chunk+1]
	r.n -= len(b) - start
	return b
}

// Append moves what o holds to the end of r, without copying it; o is
// left empty. The spare room of r's last chunk is not used again.
func (r *Rope) Append(o *Rope) {
	r.chunks = append(r.chunks, o.chunks...)
	r.n += o.n
	*o = Rope{}
}

// WriteTo writes what the rope holds to w, in order.
func (r *Rope) WriteTo(w io.Writer) (int64, error) {
	var n int64
	for _, c := range r.chunks {
		k, err := w.Write(c)
		n += int64(k)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// AppendTo appends what the rope holds to b.
func (r *Rope) AppendTo(b []byte) []byte {
	for _, c := range r.chunks {
		b = append(b, c...)
	}
	return b
}
