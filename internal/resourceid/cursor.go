package resourceid

import "encoding/binary"

// A list cursor holds, sealed as item ids are, where each channel's list
// stands in a merged list of batches or files, in that channel's own terms
// (after an id, or a page token and how many of that page were passed).

// Pos is where one channel's list stands in a merged list.
type Pos struct {
	// Channel is the channel whose list it is.
	Channel string
	// Mode is PosStart, PosAfter, PosPage or PosDone.
	Mode byte
	// Value is the upstream's id (PosAfter) or page token (PosPage, ""
	// for its first page).
	Value string
	// Skip is, for PosPage, how many of that page were passed already.
	Skip int
}

// The modes of a Pos.
const (
	PosStart = 's' // nothing passed yet
	PosAfter = 'a' // passed up to the item Value
	PosPage  = 'p' // passed up to Skip items into the page Value
	PosDone  = 'd' // all passed
)

// SealCursor encodes the positions as a cursor of kind for group.
func SealCursor(secret []byte, kind Kind, group string, pos []Pos) string {
	p := []byte{tagCursor}
	for _, q := range pos {
		p = binary.AppendUvarint(p, uint64(len(q.Channel)))
		p = append(p, q.Channel...)
		p = append(p, q.Mode)
		p = binary.AppendUvarint(p, uint64(len(q.Value)))
		p = append(p, q.Value...)
		p = binary.AppendUvarint(p, uint64(q.Skip))
	}
	return sealID(secret, kind, group, p)
}

// OpenCursor decodes a cursor of kind for group; false when it is not one.
func OpenCursor(secret []byte, kind Kind, group, s string) ([]Pos, bool) {
	p := openID(secret, kind, group, s)
	if len(p) == 0 || p[0] != tagCursor {
		return nil, false
	}
	p = p[1:]
	str := func() (string, bool) {
		n, w := binary.Uvarint(p)
		if w <= 0 || n > uint64(len(p)-w) {
			return "", false
		}
		v := string(p[w : w+int(n)])
		p = p[w+int(n):]
		return v, true
	}
	var out []Pos
	for len(p) > 0 {
		var q Pos
		var ok bool
		if q.Channel, ok = str(); !ok || len(p) == 0 {
			return nil, false
		}
		q.Mode, p = p[0], p[1:]
		if q.Value, ok = str(); !ok {
			return nil, false
		}
		n, w := binary.Uvarint(p)
		if w <= 0 || n > 1<<20 {
			return nil, false
		}
		q.Skip, p = int(n), p[w:]
		out = append(out, q)
	}
	return out, true
}
