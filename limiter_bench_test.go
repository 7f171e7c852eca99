package relay

import (
	"fmt"
	"testing"
	"time"
)

// benchRelay has 3 groups over 10 channels (some shared), limits on every
// key and channel, and no contention.
func benchRelay(b *testing.B) *Relay {
	r := &Relay{}
	for i := 0; i < 10; i++ {
		r.Channels = append(r.Channels, &Channel{Name: fmt.Sprintf("bench-ch%d", i), UpstreamRaw: upstream("mock"),
			Models: []string{"claude-sonnet-4-5", "claude-haiku-4-5"}, Priority: 1 + i%2, Weight: 1 + i,
			Rate: "100000000/s", Tokens: "1000000000/s", Concurrency: 1 << 20})
	}
	for g := 0; g < 3; g++ {
		grp := &Group{Name: fmt.Sprintf("bench-g%d", g)}
		for i := g * 3; i < g*3+4; i++ {
			grp.Channels = append(grp.Channels, fmt.Sprintf("bench-ch%d", i))
		}
		r.Groups = append(r.Groups, grp)
		r.Keys = append(r.Keys, &Key{Secret: fmt.Sprintf("sk-bench-%d", g), Group: grp.Name, Name: fmt.Sprintf("bench-k%d", g),
			Rate: "100000000/s", Tokens: "1000000000/s", Concurrency: 1 << 20})
	}
	provisionHandler(b, r)
	return r
}

// BenchmarkAdmitAndSelect measures the uncontended path of one request
// from key admission to a channel's admitted attempt, and back: key limits,
// selection among the group's channels, channel limits and breaker.
func BenchmarkAdmitAndSelect(b *testing.B) {
	r := benchRelay(b)
	keys := make([]*key, 0, 3)
	for _, k := range r.keys {
		keys = append(keys, k)
	}
	policy := cooldownPolicy{base: time.Second, max: time.Minute, auth: time.Hour}
	var triedBuf [4]*channel
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		k := keys[i%len(keys)]
		now := time.Now()
		if scope, _ := k.limits.take(now, 100); scope != scopeNone {
			b.Fatal("key refused")
		}
		sel := selection{model: "claude-sonnet-4-5", tried: triedBuf[:0], rand: defaultRand, now: now}
		ch, rerr := pickErr(k.group, &sel)
		if ch == nil {
			b.Fatal(rerr)
		}
		t, _ := ch.health.admit(now, 100)
		if t == nil {
			b.Fatal("channel refused")
		}
		t.finish(verdict{outcome: outcomeSuccess}, policy, now, 0, 150)
		k.limits.done(now, 100, 150)
	}
}
