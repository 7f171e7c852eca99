package money

import (
	"strconv"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/redistest"
)

// TestFleetHoldsLeaseAndSettleWithTheirCost takes holds of one account
// from two nodes of a fleet: a node's hold stands in the other's way until
// the sync that adds its cost gives it back, in one script, so the fleet
// never counts neither; and the holds of a node that dies expire with
// their lease.
func TestFleetHoldsLeaseAndSettleWithTheirCost(t *testing.T) {
	srv := redistest.Start(t)
	const lease = 300 * time.Millisecond
	fa := testFleet(t, srv.Addr, "holds:", lease)
	fb := testFleet(t, srv.Addr, "holds:", lease)
	now := time.Now()
	caps := [NumPeriods]float64{PeriodDay: 1}
	a, b := NewAccount("fleet-holds"), NewAccount("fleet-holds")
	a.Configure(caps, 0, "fleet-holds", discardLogger(), nil)
	b.Configure(caps, 0, "fleet-holds", discardLogger(), nil)
	a.fleet.Store(fa)
	b.fleet.Store(fb)
	spendAccounts.LoadOrStore("test-holds-a", a)
	spendAccounts.LoadOrStore("test-holds-b", b)
	t.Cleanup(func() { spendAccounts.Delete("test-holds-a"); spendAccounts.Delete("test-holds-b") })
	take := func(acct *Account, usd float64) (*Holds, HoldAnswer) {
		hs := &Holds{}
		hs.Add(acct, ToNano(usd))
		asks := []limits.Ask{{Limiter: new(limits.Limiter), Estimate: 0}}
		_, scope, _, ans := limits.TakeAll[HoldAnswer](now, asks, hs)
		if scope != limits.ScopeNone {
			t.Fatalf("refused by %s", scope)
		}
		return hs, ans
	}
	redisInt := func(key string) int64 {
		v, err := srv.Command("GET", key)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.ParseInt(v, 10, 64) // none: 0
		return n
	}
	heldKey, dayKey := "holds:{s:fleet-holds}:held", "holds:{s:fleet-holds}:day:"+PeriodDay.Start(now).Format("20060102")

	ha, ans := take(a, 0.6)
	if ans.Verdict != HoldTaken || redisInt(heldKey) != 600_000_000 {
		t.Fatalf("node A's hold: %+v, held in Redis %d", ans, redisInt(heldKey))
	}
	if _, ans := take(b, 0.6); ans.Verdict != HoldWait {
		t.Fatalf("node B, $0.60 beside A's $0.60: %+v, want to wait", ans)
	}
	if _, ans := take(b, 1.1); ans.Verdict != HoldRefused {
		t.Fatalf("node B, $1.10: %+v, want refused", ans)
	}

	// A's request cost $0.20: its hold stays until the sync (which the
	// settle asks for at once) adds the cost, in one script: the hold is
	// read before the spend, so a reader sees the hold, or the cost, or
	// both, never neither
	a.settle(now, ha.list[0], 0.2, nil, discardLogger())
	if held, spent := redisInt(heldKey), redisInt(dayKey); held+spent < 200_000_000 {
		t.Fatalf("settled: held %d, spent %d in Redis; the fleet counts neither the hold nor the cost", held, spent)
	}
	fa.flushSpend()
	if redisInt(heldKey) != 0 || redisInt(dayKey) != 200_000_000 {
		t.Fatalf("synced: held %d, spent %d in Redis; want the cost in and the hold out", redisInt(heldKey), redisInt(dayKey))
	}

	// node B holds $0.60 and dies: its hold expires with its lease
	if _, ans := take(b, 0.6); ans.Verdict != HoldTaken {
		t.Fatalf("node B, $0.60 beside $0.20 spent: %+v", ans)
	}
	// a total lost (an expired key, say) is counted again from the holds
	if _, err := srv.Command("DEL", heldKey); err != nil {
		t.Fatal(err)
	}
	if _, ans := take(a, 0.3); ans.Verdict != HoldWait || ans.Held != 600_000_000 || redisInt(heldKey) != 600_000_000 {
		t.Fatalf("node A after the total was lost: %+v, held in Redis %d; want B's $0.60 counted again", ans, redisInt(heldKey))
	}
	leave(fb)
	if _, ans := take(a, 0.3); ans.Verdict != HoldWait {
		t.Fatalf("node A, $0.30 while B's $0.60 is held: %+v, want to wait", ans)
	}
	waitFor(t, "the dead node's hold expired", 5*time.Second, func() bool {
		hs, ans := take(a, 0.3)
		if ans.Verdict == HoldTaken {
			hs.Unreserve()
			return true
		}
		return false
	})
}
