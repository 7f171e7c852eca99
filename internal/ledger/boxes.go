package ledger

import (
	"database/sql/driver"

	"github.com/jackc/pgx/v5/pgtype"
)

// int64Boxes hands out a batch's int64 values as pointers into one
// buffer, each in an interface: an interface holds a pointer as it is,
// where boxing an int64 (as any(v) does for a value past 255) makes an
// allocation of its own, five or more a row, which cost the writer about
// a tenth of its time in allocation and the collector. Every way a value
// reaches a database takes a box as its int64, without boxing it again:
// the SQLite writer's own binding reads it (bindArgs), pgx encodes it as
// an Int64Valuer, and database/sql's converter, for the SQLite driver on
// a write tried again, asks it for its Value.
//
// A box stays valid for as long as it is referenced: a full buffer is
// replaced, never grown in place, so the boxes made before still point
// into the old one, which the collector keeps while they do. reset
// reuses the buffer, so the values it boxed must no longer be read: the
// writer resets it only before a statement's values, after the last
// statement that read them ran.
type int64Boxes struct{ vals []int64Box }

// int64Box is an int64 of int64Boxes.
type int64Box struct{ v int64 }

// Int64Value is the box's value, for pgx (pgtype.Int64Valuer).
func (b *int64Box) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: b.v, Valid: true}, nil
}

// Value is the box's value, for database/sql (driver.Valuer).
func (b *int64Box) Value() (driver.Value, error) { return b.v, nil }

// box is v in an interface: as it is when the runtime boxes it without
// allocating, else in a box of the buffer.
func (b *int64Boxes) box(v int64) any {
	if v >= 0 && v < 256 {
		return v // the runtime boxes these without allocating
	}
	if len(b.vals) == cap(b.vals) {
		b.vals = make([]int64Box, 0, max(2*cap(b.vals), 1024))
	}
	b.vals = append(b.vals, int64Box{v})
	return &b.vals[len(b.vals)-1]
}

// reset takes the buffer back for the next statement's values.
func (b *int64Boxes) reset() { b.vals = b.vals[:0] }

// Interface guards
var (
	_ pgtype.Int64Valuer = (*int64Box)(nil)
	_ driver.Valuer      = (*int64Box)(nil)
)
