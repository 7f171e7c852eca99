package jsonscan

import (
	"bytes"
	"hash/maphash"
	"slices"
)

// linearMax is how many names an object may have before its names are
// looked up in the index rather than compared one by one.
const linearMax = 16

// Bounds on what a pooled Scanner keeps of the buffers a large document
// grew: more is left to the garbage collector at Reset.
const (
	keepNames   = 1 << 10
	keepScratch = 16 << 10
	keepIndex   = 1 << 12
)

// seed keys the hash of the index: random per process, so that no body can
// be made of names that all collide.
var seed = maphash.MakeSeed()

// name is a member name of an open object: its unescaped bytes, at
// buf[off:end] or, when it had escapes, in scratch, at the same offsets
// less len(buf). Each open object starts with a frame entry, which keeps
// instead the base of the object around it (in off) and the length of
// scratch before it (in end).
type name struct{ off, end int }

// nameSet holds the names of every open object, to find a name given twice
// in one of them. An object's names follow its frame entry in names, the
// innermost object's last. Up to linearMax names an object is searched one
// by one; from there on its names are in index too: open addressing with
// linear probing, keyed by a seeded hash of the unescaped name, shared by
// every open object (an entry belongs to the innermost object when it
// points at or after base). Hashes are not kept: the rare removal and
// growth compute them again, so a large object costs about 32 bytes a
// member. Nothing is allocated once the buffers have grown to what the
// documents need.
type nameSet struct {
	names   []name
	base    int    // where the innermost open object's names start in names
	scratch []byte // the unescaped bytes of names that had escapes
	index   []uint32
	inIndex int // entries in index
}

// reset empties the set, keeping its buffers unless they grew large.
func (ns *nameSet) reset() {
	if cap(ns.names) > keepNames {
		ns.names = nil
	}
	if cap(ns.scratch) > keepScratch {
		ns.scratch = nil
	}
	if len(ns.index) > keepIndex {
		ns.index = nil
	} else if ns.inIndex > 0 {
		clear(ns.index)
	}
	ns.names, ns.scratch, ns.base, ns.inIndex = ns.names[:0], ns.scratch[:0], 0, 0
}

// push appends n to names, doubling their room when they need more (not
// by a quarter, as append does past a few hundred: a hostile object's
// names would then be copied about five times over).
func (ns *nameSet) push(n name) {
	if len(ns.names) == cap(ns.names) {
		ns.names = slices.Grow(ns.names, max(len(ns.names), 64))
	}
	ns.names = append(ns.names, n)
}

// enter starts the names of a new innermost object.
func (ns *nameSet) enter() {
	ns.push(name{off: ns.base, end: len(ns.scratch)})
	ns.base = len(ns.names)
}

// leave ends the innermost object's names.
func (s *Scanner) leave() {
	ns := &s.nameSet
	if len(ns.names)-ns.base > linearMax {
		for k := len(ns.names) - 1; k >= ns.base; k-- {
			s.remove(k)
		}
	}
	f := ns.names[ns.base-1]
	ns.names, ns.scratch, ns.base = ns.names[:ns.base-1], ns.scratch[:f.end], f.off
}

// bytesOf is the unescaped name n.
func (s *Scanner) bytesOf(n name) []byte {
	if n.off >= len(s.buf) {
		return s.scratch[n.off-len(s.buf) : n.end-len(s.buf)]
	}
	return s.buf[n.off:n.end]
}

// hashOf is the index's hash of names[k].
func (s *Scanner) hashOf(k int) uint64 { return maphash.Bytes(seed, s.bytesOf(s.names[k])) }

// add adds to the innermost object the name whose raw string is
// buf[start:end], with escapes or not, or reports that it has it already.
func (s *Scanner) add(start, end int, esc bool) error {
	ns := &s.nameSet
	n := name{off: start + 1, end: end - 1}
	v := s.buf[n.off:n.end]
	if esc {
		off := len(ns.scratch)
		ns.scratch = AppendUnquote(ns.scratch, s.buf[start:end])
		v = ns.scratch[off:]
		n = name{off: len(s.buf) + off, end: len(s.buf) + len(ns.scratch)}
	}
	have := ns.names[ns.base:]
	if len(have) < linearMax {
		for _, h := range have {
			if h.end-h.off == len(v) && bytes.Equal(s.bytesOf(h), v) {
				return s.errDuplicate(start, v)
			}
		}
		ns.push(n)
		return nil
	}
	if len(have) == linearMax {
		// the object outgrows comparisons one by one: index its names
		for k := ns.base; k < len(ns.names); k++ {
			s.insert(k, s.hashOf(k))
		}
	}
	h := maphash.Bytes(seed, v)
	if s.has(v, h) {
		return s.errDuplicate(start, v)
	}
	ns.push(n)
	s.insert(len(ns.names)-1, h)
	return nil
}

// has reports whether the innermost object has the name v, of hash h, in
// the index.
func (s *Scanner) has(v []byte, h uint64) bool {
	ns := &s.nameSet
	mask := uint64(len(ns.index) - 1)
	for j := h & mask; ns.index[j] != 0; j = (j + 1) & mask {
		k := int(ns.index[j] - 1)
		if k >= ns.base && bytes.Equal(s.bytesOf(ns.names[k]), v) {
			return true
		}
	}
	return false
}

// insert puts names[k], of hash h, in the index, growing it to keep it at
// most half full.
func (s *Scanner) insert(k int, h uint64) {
	ns := &s.nameSet
	if 2*(ns.inIndex+1) > len(ns.index) {
		s.grow()
	}
	ns.place(k, h)
	ns.inIndex++
}

// place puts k, of hash h, in the first free slot of its probe sequence.
func (ns *nameSet) place(k int, h uint64) {
	mask := uint64(len(ns.index) - 1)
	j := h & mask
	for ns.index[j] != 0 {
		j = (j + 1) & mask
	}
	ns.index[j] = uint32(k + 1)
}

// grow doubles the index and places its entries again.
func (s *Scanner) grow() {
	ns := &s.nameSet
	old := ns.index
	ns.index = make([]uint32, max(64, 2*len(old)))
	for _, e := range old {
		if e != 0 {
			ns.place(int(e-1), s.hashOf(int(e-1)))
		}
	}
}

// remove takes names[k] out of the index, moving back the entries after it
// in its cluster that would no longer be found (deletion in linear probing
// without tombstones).
func (s *Scanner) remove(k int) {
	ns := &s.nameSet
	mask := uint64(len(ns.index) - 1)
	i := s.hashOf(k) & mask
	for ns.index[i] != uint32(k+1) {
		i = (i + 1) & mask
	}
	for j := (i + 1) & mask; ns.index[j] != 0; j = (j + 1) & mask {
		home := s.hashOf(int(ns.index[j]-1)) & mask
		// the entry at j stays when its home is cyclically in (i, j]
		if i <= j && i < home && home <= j || i > j && (i < home || home <= j) {
			continue
		}
		ns.index[i] = ns.index[j]
		i = j
	}
	ns.index[i] = 0
	ns.inIndex--
}
