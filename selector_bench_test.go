package relay

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"
)

// benchPick measures one pick among 4 live channels of one tier under a
// policy (with a 10% canary split when split is set).
func benchPick(b *testing.B, policy string, split bool) {
	g := &group{name: "bench-pick", policy: policy}
	for i := 0; i < 4; i++ {
		ch := testChannel(fmt.Sprintf("bench-pick-%d", i), withWeight(1+i))
		ch.health.configure(defaultBreaker, limits{}, channelOwner{}, time.Now())
		ch.health.ewmaMs.Store(math.Float64bits(float64(100 + 50*i)))
		g.channels = append(g.channels, ch)
	}
	if split {
		g.splits = []groupSplit{{ch: g.channels[3], share: 0.1}}
	}
	var triedBuf [4]*channel
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sel := selection{model: "m", session: "session-1234", tried: triedBuf[:0], rand: rand.IntN, now: testNow}
		if ch, _ := pickErr(g, &sel); ch == nil {
			b.Fatal("no pick")
		}
	}
}

func BenchmarkPickWeighted(b *testing.B)        { benchPick(b, policyWeighted, false) }
func BenchmarkPickAdaptive(b *testing.B)        { benchPick(b, policyAdaptive, false) }
func BenchmarkPickSticky(b *testing.B)          { benchPick(b, policySticky, false) }
func BenchmarkPickStickyWithSplit(b *testing.B) { benchPick(b, policySticky, true) }
