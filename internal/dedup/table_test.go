package dedup

import (
	"bytes"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
)

// testNow is the tests' clock.
var testNow = time.Date(2025, time.March, 14, 15, 9, 26, 0, time.UTC)

// dedups is the table the tests fill.
var dedups = NewTable()

// forgetDedups empties the table, so a test starts from nothing.
func forgetDedups(t testing.TB) {
	t.Helper()
	dedups.Clear()
	t.Cleanup(dedups.Clear)
}

// begin records an answer's status and headers, as the relay's writer
// does.
func (f *Flight) begin(status int, h http.Header) {
	f.Begin(status, h, h.Get("Content-Type") == "text/event-stream", nil)
}

// putAnswered records, under the key owner, a request of the principal
// state whose answer (body) has already ended; it reports the entry's key
// and flight, and whether the table took it.
func putAnswered(state, owner string, i int, body []byte, now time.Time) (Key, *Flight, bool) {
	f := NewFlight()
	var d Digest
	d[0], d[1], d[2] = byte(i), byte(i>>8), byte(i>>16)
	k := Key{state: state, digest: d}
	ok := dedups.Put(k, owner, f, now, time.Minute)
	f.begin(200, http.Header{"Content-Type": {"application/json"}})
	f.Add(body)
	f.Finish(true, 0, 0, now)
	if !ok {
		f.Release()
	}
	return k, f, ok
}

// fillAsOneKey fills the dedup table with answered requests of the
// identities fill-<n> of the key owner, each up to its principal's share.
func fillAsOneKey(t *testing.T, owner string, now time.Time) {
	t.Helper()
	for i := 0; dedups.Len() < MaxEntries; i++ {
		if i > 2*MaxEntries {
			t.Fatalf("the table does not fill: %d entries", dedups.Len())
		}
		putAnswered("user:"+"fill-"+strconv.Itoa(i/MaxPerPrincipal), owner, i, []byte(`{"ok":true}`), now)
	}
}

// dedupCounts are the table's counts of a key: its entries and the bytes
// they keep.
func dedupCounts(name string) (entries int, kept int64) { return dedups.Counts(name) }

// sweepAfterWindow sweeps the table as it will be once every entry's
// window has passed, and reports what it still counts.
func sweepAfterWindow(now time.Time) (entries, shares, heavy int) {
	dedups.Sweep(now.Add(2*time.Minute), time.Minute)
	return dedups.Stats()
}

// An eviction never takes an entry still in flight (its followers are
// attached to it): it takes the oldest ended one after it, and when a
// key's entries are all in flight, another key's request is not recorded.
// A key at its share evicts nobody.
func TestDedupEvictionSparesFlightsInFlight(t *testing.T) {
	forgetDedups(t)
	now := testNow
	var live []*Flight
	var liveKeys []Key
	for i := range 3 { // the three oldest of user *: in flight
		f := NewFlight()
		k := Key{state: "user:live", digest: Digest{0xff, byte(i)}}
		if !dedups.Put(k, "user:*", f, now, time.Minute) {
			t.Fatal("not recorded")
		}
		f.begin(200, http.Header{"Content-Type": {"text/event-stream"}})
		f.Add([]byte("event: ping\ndata: {}\n\n"))
		live, liveKeys = append(live, f), append(liveKeys, k)
	}
	fillAsOneKey(t, "user:*", now)
	dedups.mu.Lock()
	oldestEnded := dedups.shares["user:*"].oldest.entry.next.entry.next.entry.next
	dedups.mu.Unlock()

	if _, _, ok := putAnswered("victim", "victim", 0, []byte(`{}`), now); !ok {
		t.Fatal("another key's request was not recorded in a table one key filled")
	}
	for i, k := range liveKeys {
		if got := dedups.Find(k, now, time.Minute); got != live[i] {
			t.Errorf("the flight in flight %d left the table", i)
		}
	}
	dedups.mu.Lock()
	stillThere := slices.Contains(slices.Collect(maps.Values(dedups.m)), oldestEnded)
	dedups.mu.Unlock()
	if stillThere || oldestEnded.share != nil {
		t.Error("the oldest ended entry is still in the table")
	}
	if n := dedups.Len(); n != MaxEntries {
		t.Errorf("the table holds %d entries, want %d", n, MaxEntries)
	}
	// a key at its share evicts nobody
	for i := 1; i < keyShare; i++ {
		if _, _, ok := putAnswered("victim-"+strconv.Itoa(i/MaxPerPrincipal), "victim", i, []byte(`{}`), now); !ok {
			t.Fatalf("the other key's request %d was not recorded", i)
		}
	}
	if _, _, ok := putAnswered("victim-x", "victim", 1<<20, []byte(`{}`), now); ok {
		t.Error("a key at its share took another's place")
	}
	if n, _ := dedupCounts("victim"); n != keyShare {
		t.Errorf("the other key holds %d entries, want its share, %d", n, keyShare)
	}

	// a key whose entries are all in flight gives none up
	forgetDedups(t)
	var flights []*Flight
	for i := range MaxEntries {
		f := NewFlight()
		k := Key{state: "user:s" + strconv.Itoa(i/MaxPerPrincipal), digest: Digest{byte(i), byte(i >> 8)}}
		if !dedups.Put(k, "user:*", f, now, time.Minute) {
			t.Fatalf("request %d not recorded", i)
		}
		flights = append(flights, f)
	}
	if _, _, ok := putAnswered("victim", "victim", 0, []byte(`{}`), now); ok {
		t.Error("a request was recorded in place of a flight in flight")
	}
	if n := dedups.Len(); n != MaxEntries {
		t.Errorf("the table holds %d entries, want %d", n, MaxEntries)
	}
	for _, f := range append(flights, live...) {
		f.Finish(true, 0, 0, now)
	}
	if n, shares, heavy := sweepAfterWindow(now); n != 0 || shares != 0 || heavy != 0 {
		t.Errorf("after the window: %d entries, %d shares, %d heavy keys", n, shares, heavy)
	}
}

// When every byte kept is taken by one key's answers (each identity within
// its principal's share), another key's answer is still kept: the oldest
// ended answers of that key give their bytes back, never one still in
// flight; the key that took them cannot do the same. Every byte is given
// back after the window.
func TestDedupBytesEvictionUnderPressure(t *testing.T) {
	forgetDedups(t)
	now := testNow
	before := sharedBytes.used.Load() // flights other tests may still have
	big := bytes.Repeat([]byte("x"), MaxAnswer)
	type entry struct {
		k Key
		f *Flight
	}
	var hostile []entry
	for i := 0; len(hostile) == 0 || !hostile[len(hostile)-1].f.dropped; i++ {
		if i > maxBytes/MaxAnswer {
			t.Fatalf("%d answers of %d bytes kept: past every byte", i, MaxAnswer)
		}
		var d Digest
		d[0] = byte(i)
		k := Key{state: "user:big-" + strconv.Itoa(i), digest: d}
		f := NewFlight()
		if !dedups.Put(k, "user:*", f, now, time.Minute) {
			t.Fatalf("request %d not recorded", i)
		}
		f.begin(200, http.Header{"Content-Type": {"application/json"}})
		f.Add(big)
		if i > 0 { // the oldest stays in flight
			f.Finish(true, 0, 0, now)
		}
		hostile = append(hostile, entry{k, f})
	}
	// the last one did not fit, and its key, over its share, could not
	// make room by evicting
	filled := sharedBytes.used.Load()
	if filled+MaxAnswer <= maxBytes || len(hostile) < 3 {
		t.Fatalf("%d bytes kept by %d answers: the process's bytes are not all taken", filled, len(hostile))
	}
	hostileBytes := int64(len(hostile)-1) * MaxAnswer

	k, f, ok := putAnswered("victim", "victim", 0, big, now)
	if !ok || !f.ok {
		t.Fatal("another key's answer was not kept once one key took every byte")
	}
	if got := dedups.Find(k, now, time.Minute); got != f {
		t.Fatal("the other key's retry does not find its answer")
	}
	if got := dedups.Find(hostile[0].k, now, time.Minute); got != hostile[0].f {
		t.Error("the oldest answer, still in flight, left the table")
	}
	if got := dedups.Find(hostile[1].k, now, time.Minute); got != nil {
		t.Error("the oldest ended answer is still in the table")
	}
	if got := dedups.Find(hostile[2].k, now, time.Minute); got != hostile[2].f {
		t.Error("more answers left than the other's needed")
	}
	if b := sharedBytes.used.Load(); b != filled {
		t.Errorf("%d bytes kept, want %d", b, filled)
	}
	if _, b := dedupCounts("user:*"); b != hostileBytes-MaxAnswer {
		t.Errorf("user * counts %d bytes, want %d", b, hostileBytes-MaxAnswer)
	}
	if _, b := dedupCounts("victim"); b != MaxAnswer {
		t.Errorf("the other key counts %d bytes, want %d", b, MaxAnswer)
	}

	hostile[0].f.Finish(true, 0, 0, now)
	if n, shares, heavy := sweepAfterWindow(now); n != 0 || shares != 0 || heavy != 0 {
		t.Errorf("after the window: %d entries, %d shares, %d heavy keys", n, shares, heavy)
	}
	if b := sharedBytes.used.Load(); b != before {
		t.Errorf("after the window: %d bytes kept, want %d", b, before)
	}
}

// BenchmarkDedupPut is the dedup table's put: replace, a marked request
// of one of 1,000 identities of one key taking the place of its answered
// entry (every request of an SDK that repeats itself); evict, in a table
// one key filled, another key's request taking the place of the first's
// oldest answered entry (with that key's put that fills the table again
// and the forgetting of the other's entry, so that each round evicts).
func BenchmarkDedupPut(b *testing.B) {
	now := testNow
	ended := func() *Flight {
		f := NewFlight()
		f.Finish(true, 0, 0, now)
		return f
	}
	b.Run("replace", func(b *testing.B) {
		forgetDedups(b)
		keys := make([]Key, 1000)
		for i := range keys {
			keys[i] = Key{state: "user:u" + strconv.Itoa(i)}
			dedups.Put(keys[i], "user:*", ended(), now, time.Minute)
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			f := NewFlight()
			if !dedups.Put(keys[i%len(keys)], "user:*", f, now, time.Minute) {
				b.Fatal("not recorded")
			}
			f.Finish(true, 0, 0, now)
			i++
		}
	})
	b.Run("evict", func(b *testing.B) {
		forgetDedups(b)
		for i := 0; dedups.Len() < MaxEntries; i++ {
			k := Key{state: "user:f" + strconv.Itoa(i/MaxPerPrincipal), digest: Digest{byte(i), byte(i >> 8), byte(i >> 16)}}
			dedups.Put(k, "user:*", ended(), now, time.Minute)
		}
		victim := Key{state: "victim"}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			k := Key{state: "user:g" + strconv.Itoa(i%10), digest: Digest{0xff, byte(i), byte(i >> 8), byte(i >> 16)}}
			dedups.Put(k, "user:*", ended(), now, time.Minute) // fills the table again
			if dedups.Len() != MaxEntries {
				b.Fatal("the table is not full")
			}
			if !dedups.Put(victim, "victim", ended(), now, time.Minute) {
				b.Fatal("not recorded")
			}
			dedups.mu.Lock()
			dedups.forget(victim)
			dedups.mu.Unlock()
			i++
		}
	})
}

// checkDedupCounts checks the table's accounting against its entries:
// each share's entries and bytes are those of its flights, and each key's
// order holds exactly its entries.
func checkDedupCounts(t *testing.T) {
	t.Helper()
	dedups.mu.Lock()
	defer dedups.mu.Unlock()
	entries, kept := map[*holding]int{}, map[*holding]int64{}
	keyEntries, keyKept := map[*holding]int{}, map[*holding]int64{}
	for k, f := range dedups.m {
		f.mu.Lock()
		if f.share != dedups.shares[k.state] || f.owner == nil {
			t.Errorf("an entry of %s counts in another principal's share", k.state)
		}
		entries[f.share]++
		kept[f.share] += f.kept
		keyEntries[f.owner]++
		keyKept[f.owner] += f.kept
		f.mu.Unlock()
	}
	for name, s := range dedups.shares {
		if s.principal.entries != entries[s] || s.principal.bytes.used.Load() != kept[s] {
			t.Errorf("%s counts %d entries, %d bytes as a principal; its flights: %d, %d", name, s.principal.entries, s.principal.bytes.used.Load(), entries[s], kept[s])
		}
		if s.key.entries != keyEntries[s] || s.key.bytes.used.Load() != keyKept[s] {
			t.Errorf("%s counts %d entries, %d bytes as a key; its flights: %d, %d", name, s.key.entries, s.key.bytes.used.Load(), keyEntries[s], keyKept[s])
		}
		n := 0
		for f := s.oldest; f != nil; f = f.entry.next {
			if f.owner != s {
				t.Errorf("%s's order holds another key's entry", name)
			}
			n++
		}
		if n != s.key.entries {
			t.Errorf("%s's order holds %d entries, want %d", name, n, s.key.entries)
		}
	}
}

// Many tenants at once, after a key of many identities took every byte,
// which goes on with large answers, some still streaming: the others'
// answers are still kept, the table's accounting holds throughout, and
// every byte is given back in the end.
func TestDedupFairUnderConcurrency(t *testing.T) {
	forgetDedups(t)
	now := testNow
	before := sharedBytes.used.Load()
	mib := bytes.Repeat([]byte("x"), 1<<20)
	for i := 0; ; i++ { // user * takes every byte first
		_, f, ok := putAnswered("user:pre-"+strconv.Itoa(i), "user:*", i, mib, now)
		if !ok || i > maxBytes>>20 {
			t.Fatal("user *'s answers do not take every byte")
		}
		if f.dropped {
			break
		}
	}
	var mu sync.Mutex
	var open []*Flight
	var wg sync.WaitGroup
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := "user:*"
			if g >= 3 {
				owner = "tenant-" + strconv.Itoa(g)
			}
			for i := range 300 {
				state := owner
				if g < 3 {
					state = "user:id-" + strconv.Itoa(g*300+i)
				}
				k := Key{state: state, digest: Digest{byte(g), byte(i), byte(i >> 8)}}
				f := NewFlight()
				ok := dedups.Put(k, owner, f, now, time.Minute)
				f.begin(200, http.Header{"Content-Type": {"text/event-stream"}})
				f.Add(mib[:64<<10])
				f.Add(mib)
				if !ok {
					f.Finish(true, 0, 0, now)
					f.Release()
					continue
				}
				if i%7 == 0 { // still streaming
					mu.Lock()
					open = append(open, f)
					mu.Unlock()
					continue
				}
				f.Finish(true, 0, 0, now)
			}
		}()
	}
	wg.Wait()
	checkDedupCounts(t)
	for g := 3; g < 6; g++ {
		if _, b := dedupCounts("tenant-" + strconv.Itoa(g)); b == 0 {
			t.Errorf("tenant-%d keeps no answer", g)
		}
	}
	if b := sharedBytes.used.Load(); b > maxBytes {
		t.Errorf("%d bytes kept, past %d", b, maxBytes)
	}
	for _, f := range open {
		f.Add(mib[:1])
		f.Finish(true, 0, 0, now)
	}
	checkDedupCounts(t)
	if n, shares, heavy := sweepAfterWindow(now); n != 0 || shares != 0 || heavy != 0 {
		t.Errorf("after the window: %d entries, %d shares, %d heavy keys", n, shares, heavy)
	}
	if b := sharedBytes.used.Load(); b != before {
		t.Errorf("after the window: %d bytes kept, want %d", b, before)
	}
}

// The dedup table and the bytes kept stay within their bounds however many
// distinct requests come.
func TestDedupBounded(t *testing.T) {
	forgetDedups(t)
	now := testNow
	piece := make([]byte, 8<<10)
	var flights []*Flight
	for i := range 12_000 {
		f := NewFlight()
		f.begin(200, http.Header{"Content-Type": {"application/json"}})
		f.Add(piece)
		var d Digest
		d[0], d[1] = byte(i), byte(i>>8)
		k := Key{state: "k" + strconv.Itoa(i%12), digest: d}
		dedups.Put(k, k.state, f, now, time.Minute)
		flights = append(flights, f)
	}
	if n := dedups.Len(); n > MaxEntries {
		t.Errorf("dedup entries = %d, want at most %d", n, MaxEntries)
	}
	if b := sharedBytes.used.Load(); b > maxBytes {
		t.Errorf("bytes kept = %d, want at most %d", b, maxBytes)
	}
	dropped := 0
	for _, f := range flights {
		if f.dropped {
			dropped++
		}
		f.Finish(!f.dropped, 0, 0, now)
	}
	if dropped == 0 {
		t.Error("no flight was dropped past the byte bound")
	}
	// once the window has passed, everything is given back
	dedups.mu.Lock()
	dedups.sweep(now.Add(2*time.Minute), time.Minute)
	dedups.mu.Unlock()
	for _, f := range flights {
		f.Release() // those the table never held
	}
	if n, b := dedups.Len(), sharedBytes.used.Load(); n != 0 || b != 0 {
		t.Errorf("after the window: %d entries, %d bytes", n, b)
	}
	// an identical request while the first is in flight leaves it in its
	// place, and every byte is given back in the end
	k := Key{state: "k"}
	first, second := NewFlight(), NewFlight()
	if !dedups.Put(k, k.state, first, now, time.Minute) || dedups.Put(k, k.state, second, now, time.Minute) {
		t.Fatal("the second identical request in flight replaced the first")
	}
	first.Add(piece)
	second.Add(piece)
	second.Release() // as share does for a flight the table did not take
	first.Add(piece)
	first.Finish(true, 0, 0, now)
	dedups.mu.Lock()
	dedups.sweep(now.Add(2*time.Minute), time.Minute)
	dedups.mu.Unlock()
	if b := sharedBytes.used.Load(); b != 0 {
		t.Errorf("%d bytes still counted", b)
	}

	// an answer over the per-answer cap is not kept
	f := NewFlight()
	f.begin(200, http.Header{})
	f.Add(make([]byte, MaxAnswer+1))
	if !f.dropped || sharedBytes.used.Load() != 0 {
		t.Errorf("a %d-byte answer was kept", MaxAnswer+1)
	}
}

// TestDedupBoundedPerPrincipal: one principal's flood of recorded requests
// takes at most its share of the dedup table, so that another's request is
// still recorded and its retry answered from it; the table's count of a
// principal's entries goes with them.
func TestDedupBoundedPerPrincipal(t *testing.T) {
	forgetDedups(t)
	now := testNow
	put := func(state string, i int) (Key, *Flight, bool) {
		f := NewFlight()
		f.begin(200, http.Header{"Content-Type": {"application/json"}})
		f.Add([]byte(`{"ok":true}`))
		f.Finish(true, 0, 0, now)
		var d Digest
		d[0], d[1] = byte(i), byte(i>>8)
		k := Key{state: state, digest: d}
		ok := dedups.Put(k, state, f, now, time.Minute)
		if !ok {
			f.Release()
		}
		return k, f, ok
	}
	recorded := 0
	for i := range 3 * MaxPerPrincipal {
		if _, _, ok := put("hostile", i); ok {
			recorded++
		}
	}
	if recorded != MaxPerPrincipal {
		t.Fatalf("one principal recorded %d requests, want its share, %d", recorded, MaxPerPrincipal)
	}
	k, f, ok := put("victim", 0)
	if !ok {
		t.Fatal("another principal's request was not recorded: the flood took the table")
	}
	if got := dedups.Find(k, now, time.Minute); got != f {
		t.Fatal("the other principal's retry does not find its first attempt")
	}
	// the same request of the flooding principal again replaces its own
	// answered entry: it does not count twice
	if _, _, ok := put("hostile", 0); !ok {
		t.Fatal("a request that replaces its own answered entry was refused")
	}
	dedups.mu.Lock()
	if n := dedups.shares["hostile"].principal.entries; n != MaxPerPrincipal {
		t.Errorf("the flooding principal counts %d entries, want %d", n, MaxPerPrincipal)
	}
	dedups.sweep(now.Add(2*time.Minute), time.Minute)
	n, per := len(dedups.m), len(dedups.shares)
	dedups.mu.Unlock()
	if n != 0 || per != 0 {
		t.Errorf("after the window: %d entries, %d principals counted", n, per)
	}
}

// TestDedupBytesBoundedPerPrincipal: the answers one principal's recorded
// requests keep are bounded by its share of the bytes, so that another's
// answer is still kept for its retries; the share goes with the entries.
func TestDedupBytesBoundedPerPrincipal(t *testing.T) {
	forgetDedups(t)
	now := testNow
	before := sharedBytes.used.Load()
	mib := bytes.Repeat([]byte("x"), 1<<20)
	answer := func(state string, i int) (Key, *Flight) {
		var d Digest
		d[0], d[1] = byte(i), byte(i>>8)
		k := Key{state: state, digest: d}
		f := NewFlight()
		if !dedups.Put(k, state, f, now, time.Minute) {
			t.Fatalf("%s's request %d was not recorded", state, i)
		}
		f.begin(200, http.Header{"Content-Type": {"application/json"}})
		f.Add(mib)
		f.Finish(true, 0, 0, now)
		return k, f
	}
	kept := 0
	for i := range 20 {
		if _, f := answer("hostile", i); f.ok {
			kept++
		}
	}
	if want := maxBytesPerPrincipal >> 20; kept != want {
		t.Fatalf("one principal kept %d answers of 1 MiB, want its share, %d", kept, want)
	}
	if used := sharedBytes.used.Load() - before; used != int64(kept)<<20 {
		t.Errorf("the process counts %d bytes kept, want %d", used, kept<<20)
	}
	k, f := answer("victim", 0)
	if !f.ok {
		t.Fatal("another principal's answer was not kept: the large answers took every byte")
	}
	if got := dedups.Find(k, now, time.Minute); got != f {
		t.Fatal("the other principal's retry does not find its answer")
	}
	dedups.mu.Lock()
	hostile := dedups.shares["hostile"].principal.bytes.used.Load()
	dedups.sweep(now.Add(2*time.Minute), time.Minute)
	per := len(dedups.shares)
	dedups.mu.Unlock()
	if hostile != int64(kept)<<20 {
		t.Errorf("the principal's share counts %d bytes, want %d", hostile, kept<<20)
	}
	if used := sharedBytes.used.Load(); per != 0 || used != before {
		t.Errorf("after the window: %d principals counted, %d bytes kept (%d before)", per, used, before)
	}
}
