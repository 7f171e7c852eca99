package money

import (
	"testing"
	"time"
)

// TestAGroupTakesAtMostItsShareOfACapOthersUse: while another group holds
// part of a cap (or waits for room on it), a group's holds may take at
// most an even share of the cap's room; alone, it may take all of it.
func TestAGroupTakesAtMostItsShareOfACapOthersUse(t *testing.T) {
	a := NewAccount("share-unit")
	a.Configure([NumPeriods]float64{PeriodDay: 1}, 0, "share-unit", discardLogger(), nil)
	now := time.Date(2030, time.March, 15, 12, 0, 0, 0, time.UTC)
	if ans := a.reserveAs(now, ToNano(0.96), "a"); ans.Verdict != HoldTaken {
		t.Fatalf("a group alone takes $0.96 of $1: %v", ans.Verdict)
	}
	if ans := a.reserveAs(now, ToNano(0.02), "b"); ans.Verdict != HoldTaken {
		t.Fatalf("another group's $0.02 beside it: %v", ans.Verdict)
	}
	// two groups: a's share is $0.50, and it holds $0.96
	if ans := a.reserveAs(now, ToNano(0.01), "a"); ans.Verdict != HoldWait {
		t.Errorf("a group past its share takes more: %v, want a wait", ans.Verdict)
	}
	a.unreserveAs(ToNano(0.96), "a")
	if ans := a.reserveAs(now, ToNano(0.49), "a"); ans.Verdict != HoldTaken {
		t.Errorf("within its share: %v", ans.Verdict)
	}
	if ans := a.reserveAs(now, ToNano(0.02), "a"); ans.Verdict != HoldWait {
		t.Errorf("$0.51 of a $0.50 share: %v, want a wait", ans.Verdict)
	}
	a.unreserveAs(ToNano(0.02), "b")
	if ans := a.reserveAs(now, ToNano(0.5), "a"); ans.Verdict != HoldTaken {
		t.Errorf("alone again, it takes the rest: %v", ans.Verdict)
	}
	// a group that waits for room counts among those that share it
	a.unreserveAs(ToNano(0.5), "a")
	a.unreserveAs(ToNano(0.49), "a")
	a.Want("c")
	if ans := a.reserveAs(now, ToNano(0.6), "a"); ans.Verdict != HoldWait {
		t.Errorf("past half while another group waits: %v, want a wait", ans.Verdict)
	}
	a.Unwant("c")
	if ans := a.reserveAs(now, ToNano(0.6), "a"); ans.Verdict != HoldTaken {
		t.Errorf("once it stopped waiting: %v", ans.Verdict)
	}
}
