package statuspage

import (
	"fmt"
	"testing"
	"time"
)

func TestRingKeepsTheLastRequests(t *testing.T) {
	g := new(ring)
	r := &Request{ID: "req", At: time.Unix(100, 0), Model: "m", Served: "m", Channel: "ring-ch", Status: 200, Attempts: 1, CostUSD: 0.5}
	r.Chain[0], r.Outcomes[0] = "ring-ch", Success
	if n := testing.AllocsPerRun(100, func() { g.record(r) }); n != 0 {
		t.Errorf("record allocates %v times", n)
	}
	for i := range RecentSize + 5 {
		r.ID = fmt.Sprint("r", i)
		g.record(r)
	}
	rows, last := g.since(0)
	if len(rows) != RecentSize || rows[0].ID != "r5" || rows[len(rows)-1].ID != fmt.Sprint("r", RecentSize+4) || last != rows[len(rows)-1].seq {
		t.Fatalf("%d rows, first %s, last %s, seq %d", len(rows), rows[0].ID, rows[len(rows)-1].ID, last)
	}
	more, _ := g.since(last - 2)
	if len(more) != 2 || more[1].seq != last {
		t.Fatalf("since: %d rows", len(more))
	}
	if none, _ := g.since(last); len(none) != 0 {
		t.Fatalf("since the newest: %d rows", len(none))
	}
	row := rows[0].row()
	if row.Channel != "ring-ch" || len(row.Chain) != 1 || row.Chain[0] != "ring-ch:success" || row.CostUSD != 0.5 || row.Served != "" {
		t.Fatalf("row: %+v", row)
	}
}

// TestRowOfAFailure: a request whose upstream's failure was passed on
// shows how its last attempt ended as its code; a fallback model shows as
// served.
func TestRowOfAFailure(t *testing.T) {
	r := Request{At: time.Unix(100, 0), Model: "m", Served: "m2", Status: 529, Attempts: 6}
	r.Chain, r.Outcomes = [ChainSize]string{"a", "b"}, [ChainSize]string{"rate_limited", "overloaded"}
	row := r.row()
	if row.Code != "overloaded" || row.Served != "m2" || len(row.Chain) != 2 || row.Chain[1] != "b:overloaded" || row.Attempts != 6 {
		t.Fatalf("row: %+v", row)
	}
}

// BenchmarkRecord is writing one ring slot.
func BenchmarkRecord(b *testing.B) {
	g := new(ring)
	r := &Request{ID: "req", At: time.Unix(100, 0), Model: "m", Served: "m", Channel: "ring-ch", Status: 200, Attempts: 1}
	r.Chain[0], r.Outcomes[0] = "ring-ch", Success
	b.ReportAllocs()
	for b.Loop() {
		g.record(r)
	}
}
