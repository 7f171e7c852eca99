package relay

import (
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/money"

	"github.com/caddy-relay/relay/internal/limits"
)

// BenchmarkAdmitAndSelectWithBudget is BenchmarkAdmitAndSelect for keys
// with a budget: each request also plans its hold (its worst case), takes
// it with its channel's admission and settles it at its cost.
func BenchmarkAdmitAndSelectWithBudget(b *testing.B) {
	r := benchRelay(b)
	keys := make([]*key, 0, 3)
	for _, k := range r.keys {
		r.activate(k)
		k.state.spend.Configure([money.NumPeriods]float64{money.PeriodDay: 1e9}, 0, k.name, discardLogger(), nil)
		keys = append(keys, k)
	}
	policy := health.CooldownPolicy{Base: time.Second, Max: time.Minute, Auth: time.Hour}
	var triedBuf [4]*channel
	in := &inbound{route: routeMessages, ask: asked{model: "claude-sonnet-4-5", estimate: 100, maxOut: 1024}}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		k := keys[i%len(keys)]
		now := time.Now()
		g, scope, _ := k.limits.Take(now, 100)
		if scope != limits.ScopeNone {
			b.Fatal("key refused")
		}
		in.who.key, in.who.state, in.grant.holds = k, k.state, nil
		if rerr := r.planHolds(in); rerr != nil {
			b.Fatal(rerr)
		}
		sel := selection{model: "claude-sonnet-4-5", tried: triedBuf[:0], rand: defaultRand, now: now}
		ch, rerr := pickErr(k.group, &sel)
		if ch == nil {
			b.Fatal(rerr)
		}
		t, _, _, _, ans := ch.health.admitWith(now, 100, nil, in.grant.holds)
		if t == nil || ans.Verdict != money.HoldTaken {
			b.Fatal("channel or hold refused")
		}
		in.grant.holds.Taken = true
		t.finish(verdict{outcome: outcomeSuccess}, policy, now, 0, 150)
		r.settleHolds(in, 0.001)
		k.limits.Done(now, g, 150)
	}
}

// BenchmarkHold is one budget hold alone, from a request's admission to
// its end, without the limits and selection around it
// (BenchmarkAdmitAndSelectWithBudget has them): held, a request of a key
// with a daily budget plans its hold (its worst case, against what was
// spent), takes it, and settles it at its cost; unheld, a request of a key
// without a budget plans nothing and has its cost charged, as every
// request does. held is the budget's figure (at most 1 µs), held less
// unheld what the hold adds.
func BenchmarkHold(b *testing.B) {
	r := benchRelay(b)
	keys := make(map[string]*key, 2)
	for _, k := range r.keys {
		r.activate(k)
		keys[k.name] = k
	}
	budgeted, plain := keys["bench-k0"], keys["bench-k1"]
	budgeted.state.spend.Configure([money.NumPeriods]float64{money.PeriodDay: 1e9}, 0, budgeted.name, discardLogger(), nil)
	run := func(k *key, holds bool) func(*testing.B) {
		return func(b *testing.B) {
			in := &inbound{route: routeMessages, ask: asked{model: "claude-sonnet-4-5", estimate: 100, maxOut: 1024},
				who: requester{key: k, state: k.state}}
			b.ReportAllocs()
			for b.Loop() {
				in.grant.holds = nil
				if rerr := r.planHolds(in); rerr != nil || (in.grant.holds != nil) != holds {
					b.Fatalf("planned %v (%v), want holds: %v", in.grant.holds, rerr, holds)
				}
				if holds {
					if ans, ok := in.grant.holds.Reserve(r.now()); !ok {
						b.Fatalf("hold not taken: %+v", ans)
					}
					in.grant.holds.Taken = true
				}
				r.settleHolds(in, 0.001)
			}
		}
	}
	b.Run("held", run(budgeted, true))
	b.Run("unheld", run(plain, false))
}
