package statuspage

import (
	"fmt"
	"testing"
	"time"
)

// TestSnapshotShowsTheCostliestKeys: the page is sent to every viewer each
// time it changes, so it shows at most MaxKeys keys, those that spent most
// this month, by name, and counts them all.
func TestSnapshotShowsTheCostliestKeys(t *testing.T) {
	src := &fakeSource{}
	for i := range MaxKeys + 100 {
		src.snap.Keys = append(src.snap.Keys, Key{Name: fmt.Sprintf("k-%04d", i), Kind: "key", SpendUSD: map[string]float64{"month": float64(i)}})
	}
	src.snap.KeysTotal = MaxKeys + 200
	snap := snapshot(src, time.Now(), nil, nil)
	if len(snap.Keys) != MaxKeys || snap.KeysTotal != MaxKeys+200 {
		t.Fatalf("%d keys shown of %d", len(snap.Keys), snap.KeysTotal)
	}
	if snap.Keys[0].Name != "k-0100" || snap.Keys[MaxKeys-1].Name != fmt.Sprintf("k-%04d", MaxKeys+99) {
		t.Errorf("keys shown from %s to %s, want the costliest by name", snap.Keys[0].Name, snap.Keys[MaxKeys-1].Name)
	}
	if snap.Channels == nil || snap.Groups == nil || snap.Sessions == nil || snap.Fleet != nil {
		t.Errorf("empty lists: %+v", snap)
	}
}

// TestSnapshotCountsEachChannelsRecentTraffic from the ring's rows: its
// attempts and failures by minute, its failed share and median first byte
// of the last 5 minutes.
func TestSnapshotCountsEachChannelsRecentTraffic(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 30, 0, time.UTC)
	src := &fakeSource{snap: Snapshot{Channels: []ChannelView{{Channel: Channel{Name: "b"}}, {Channel: Channel{Name: "a"}}}}}
	row := func(ago time.Duration, firstByte time.Duration, chain ...string) Request {
		r := Request{At: now.Add(-ago), Attempts: len(chain) / 2, FirstByte: firstByte}
		for i := 0; i+1 < len(chain); i += 2 {
			r.Chain[i/2], r.Outcomes[i/2] = chain[i], chain[i+1]
			if chain[i+1] == Success {
				r.Channel = chain[i]
			}
		}
		return r
	}
	rows := []Request{
		row(0, 100*time.Millisecond, "a", "overloaded", "b", Success),
		row(time.Minute, 300*time.Millisecond, "b", Success),
		row(2*time.Minute, 200*time.Millisecond, "b", Success),
		row(7*time.Minute, time.Second, "a", "transient"),  // in the sparkline, not in the 5 minutes
		row(20*time.Minute, time.Second, "a", "transient"), // too old
	}
	snap := snapshot(src, now, rows, nil)
	a, b := snap.Channels[0], snap.Channels[1]
	if a.Name != "a" || b.Name != "b" {
		t.Fatalf("channels not by name: %s %s", a.Name, b.Name)
	}
	if a.Recent.PerMinute[recentMinutes-1] != 1 || a.Recent.ErrorsPerMinute[recentMinutes-1] != 1 || a.Recent.PerMinute[recentMinutes-8] != 1 || a.Recent.ErrorRatio != 1 {
		t.Errorf("a: %+v", a.Recent)
	}
	if b.Recent.PerMinute[recentMinutes-1] != 1 || b.Recent.PerMinute[recentMinutes-2] != 1 || b.Recent.ErrorRatio != 0 || b.Recent.FirstByteP50Ms != 200 {
		t.Errorf("b: %+v", b.Recent)
	}
}
