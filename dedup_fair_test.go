package relay

import (
	"bytes"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// putAnswered records, under the key owner, a request of the principal
// state whose answer (body) has already ended; it reports the entry's key
// and flight, and whether the table took it.
func putAnswered(state, owner string, i int, body []byte, now time.Time) (dedupKey, *flight, bool) {
	f := newFlight()
	var d bodyDigest
	d[0], d[1], d[2] = byte(i), byte(i>>8), byte(i>>16)
	k := dedupKey{state: state, digest: d}
	ok := dedups.put(k, owner, f, now, time.Minute)
	f.begin(200, http.Header{"Content-Type": {"application/json"}})
	f.add(body)
	f.finish(true, usage{}, 0, now)
	if !ok {
		f.release()
	}
	return k, f, ok
}

// fillAsOneKey fills the dedup table with answered requests of the
// identities fill-<n> of the key owner, each up to its principal's share.
func fillAsOneKey(t *testing.T, owner string, now time.Time) {
	t.Helper()
	for i := 0; dedups.len() < maxDedupEntries; i++ {
		if i > 2*maxDedupEntries {
			t.Fatalf("the table does not fill: %d entries", dedups.len())
		}
		putAnswered(userStatePrefix+"fill-"+strconv.Itoa(i/maxDedupPerPrincipal), owner, i, []byte(`{"ok":true}`), now)
	}
}

// dedupCounts are the table's counts of a key: its entries and the bytes
// they keep.
func dedupCounts(name string) (entries int, kept int64) {
	dedups.mu.Lock()
	defer dedups.mu.Unlock()
	if s := dedups.shares[name]; s != nil {
		return s.key.entries, s.key.bytes.used.Load()
	}
	return 0, 0
}

// sweepAfterWindow sweeps the table as it will be once every entry's
// window has passed, and reports what it still counts.
func sweepAfterWindow(now time.Time) (entries, shares, heavy int) {
	dedups.mu.Lock()
	defer dedups.mu.Unlock()
	dedups.sweep(now.Add(2*time.Minute), time.Minute)
	return len(dedups.m), len(dedups.shares), len(dedups.heavy)
}

// One relay key serving many identities (user *, an identity from a
// header a tenant sets as it likes) fills the whole dedup table, each
// identity within its principal's share; another key's request is still
// recorded, in place of the oldest answered entry of that key, and its
// SDK's retry is answered without the upstream. Once the window passes,
// nothing is counted.
func TestDedupKeyOfManyIdentitiesLeavesRoomForOthers(t *testing.T) {
	forgetDedups(t)
	before := sharedBytes.used.Load()
	up := fakeupstream.New(t, fakeupstream.Message("answer"))
	startRelay(t, "\t\tidentity {http.request.header.X-Tenant-User}\n\t\tuser * dd-fair\n"+
		channelBlock("dd-fair", up.URL, "models claude-sonnet-4-5")+keyAndGroup("dd-fair", "dd-fair"))

	as := func(user, key, retry string) reply {
		t.Helper()
		h := []string{"X-Stainless-Retry-Count", retry}
		if user != "" {
			h = append(h, "X-Tenant-User", user)
		}
		r := send(t, http.MethodPost, "/v1/messages", key, simpleBody, h...)
		if r.status != 200 {
			t.Fatalf("%s%s: status %d: %s", user, key, r.status, r.body)
		}
		return r
	}
	// the tenant's identities, each its own principal, all of user *
	for i := range 12 {
		as("u"+strconv.Itoa(i), "", "0")
	}
	if n, _ := dedupCounts("user:*"); n != 12 {
		t.Fatalf("user * counts %d entries, want its 12 identities' 12", n)
	}
	fillAsOneKey(t, "user:*", time.Now())
	if n, _ := dedupCounts("user:*"); n != maxDedupEntries {
		t.Fatalf("user * holds %d entries, want the whole table, %d", n, maxDedupEntries)
	}

	hits := up.Hits()
	first := as("", clientKey, "0")
	retry := as("", clientKey, "1")
	if up.Hits() != hits+1 || !bytes.Equal(retry.body, first.body) {
		t.Fatalf("another key's retry in a table one key filled: %d upstream calls, want 1", up.Hits()-hits)
	}
	if n, _ := dedupCounts(otherKeyName(t)); n != 1 {
		t.Errorf("the other key counts %d entries, want 1", n)
	}
	if n := dedups.len(); n != maxDedupEntries {
		t.Errorf("the table holds %d entries, want %d", n, maxDedupEntries)
	}
	// the entry that left is the oldest of user *: u0's; u1's is still kept
	hits = up.Hits()
	as("u1", "", "1")
	if up.Hits() != hits {
		t.Error("the retry of user *'s second oldest request went upstream")
	}
	as("u0", "", "1")
	if up.Hits() != hits+1 {
		t.Error("the retry of user *'s oldest request did not go upstream: which entry left?")
	}

	if n, shares, heavy := sweepAfterWindow(time.Now()); n != 0 || shares != 0 || heavy != 0 {
		t.Errorf("after the window: %d entries, %d shares, %d heavy keys", n, shares, heavy)
	}
	if b := sharedBytes.used.Load(); b != before {
		t.Errorf("after the window: %d bytes kept, want %d", b, before)
	}
}

// otherKeyName is the state id of the one key in the dedup table that is
// not user * (whose identities' state ids all start with user:).
func otherKeyName(t *testing.T) string {
	t.Helper()
	dedups.mu.Lock()
	defer dedups.mu.Unlock()
	for name := range dedups.shares {
		if !strings.HasPrefix(name, userStatePrefix) {
			return name
		}
	}
	t.Fatal("the other key has no share in the table")
	return ""
}

// An eviction never takes an entry still in flight (its followers are
// attached to it): it takes the oldest ended one after it, and when a
// key's entries are all in flight, another key's request is not recorded.
// A key at its share evicts nobody.
func TestDedupEvictionSparesFlightsInFlight(t *testing.T) {
	forgetDedups(t)
	now := testNow
	var live []*flight
	var liveKeys []dedupKey
	for i := range 3 { // the three oldest of user *: in flight
		f := newFlight()
		k := dedupKey{state: "user:live", digest: bodyDigest{0xff, byte(i)}}
		if !dedups.put(k, "user:*", f, now, time.Minute) {
			t.Fatal("not recorded")
		}
		f.begin(200, http.Header{"Content-Type": {"text/event-stream"}})
		f.add([]byte("event: ping\ndata: {}\n\n"))
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
		if got := dedups.find(k, now, time.Minute); got != live[i] {
			t.Errorf("the flight in flight %d left the table", i)
		}
	}
	dedups.mu.Lock()
	stillThere := slices.Contains(slices.Collect(maps.Values(dedups.m)), oldestEnded)
	dedups.mu.Unlock()
	if stillThere || oldestEnded.share != nil {
		t.Error("the oldest ended entry is still in the table")
	}
	if n := dedups.len(); n != maxDedupEntries {
		t.Errorf("the table holds %d entries, want %d", n, maxDedupEntries)
	}
	// a key at its share evicts nobody
	for i := 1; i < dedupKeyShare; i++ {
		if _, _, ok := putAnswered("victim-"+strconv.Itoa(i/maxDedupPerPrincipal), "victim", i, []byte(`{}`), now); !ok {
			t.Fatalf("the other key's request %d was not recorded", i)
		}
	}
	if _, _, ok := putAnswered("victim-x", "victim", 1<<20, []byte(`{}`), now); ok {
		t.Error("a key at its share took another's place")
	}
	if n, _ := dedupCounts("victim"); n != dedupKeyShare {
		t.Errorf("the other key holds %d entries, want its share, %d", n, dedupKeyShare)
	}

	// a key whose entries are all in flight gives none up
	forgetDedups(t)
	var flights []*flight
	for i := range maxDedupEntries {
		f := newFlight()
		k := dedupKey{state: "user:s" + strconv.Itoa(i/maxDedupPerPrincipal), digest: bodyDigest{byte(i), byte(i >> 8)}}
		if !dedups.put(k, "user:*", f, now, time.Minute) {
			t.Fatalf("request %d not recorded", i)
		}
		flights = append(flights, f)
	}
	if _, _, ok := putAnswered("victim", "victim", 0, []byte(`{}`), now); ok {
		t.Error("a request was recorded in place of a flight in flight")
	}
	if n := dedups.len(); n != maxDedupEntries {
		t.Errorf("the table holds %d entries, want %d", n, maxDedupEntries)
	}
	for _, f := range append(flights, live...) {
		f.finish(true, usage{}, 0, now)
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
	big := bytes.Repeat([]byte("x"), maxSharedAnswer)
	type entry struct {
		k dedupKey
		f *flight
	}
	var hostile []entry
	for i := 0; len(hostile) == 0 || !hostile[len(hostile)-1].f.dropped; i++ {
		if i > maxSharedBytes/maxSharedAnswer {
			t.Fatalf("%d answers of %d bytes kept: past every byte", i, maxSharedAnswer)
		}
		var d bodyDigest
		d[0] = byte(i)
		k := dedupKey{state: "user:big-" + strconv.Itoa(i), digest: d}
		f := newFlight()
		if !dedups.put(k, "user:*", f, now, time.Minute) {
			t.Fatalf("request %d not recorded", i)
		}
		f.begin(200, http.Header{"Content-Type": {"application/json"}})
		f.add(big)
		if i > 0 { // the oldest stays in flight
			f.finish(true, usage{}, 0, now)
		}
		hostile = append(hostile, entry{k, f})
	}
	// the last one did not fit, and its key, over its share, could not
	// make room by evicting
	filled := sharedBytes.used.Load()
	if filled+maxSharedAnswer <= maxSharedBytes || len(hostile) < 3 {
		t.Fatalf("%d bytes kept by %d answers: the process's bytes are not all taken", filled, len(hostile))
	}
	hostileBytes := int64(len(hostile)-1) * maxSharedAnswer

	k, f, ok := putAnswered("victim", "victim", 0, big, now)
	if !ok || !f.ok {
		t.Fatal("another key's answer was not kept once one key took every byte")
	}
	if got := dedups.find(k, now, time.Minute); got != f {
		t.Fatal("the other key's retry does not find its answer")
	}
	if got := dedups.find(hostile[0].k, now, time.Minute); got != hostile[0].f {
		t.Error("the oldest answer, still in flight, left the table")
	}
	if got := dedups.find(hostile[1].k, now, time.Minute); got != nil {
		t.Error("the oldest ended answer is still in the table")
	}
	if got := dedups.find(hostile[2].k, now, time.Minute); got != hostile[2].f {
		t.Error("more answers left than the other's needed")
	}
	if b := sharedBytes.used.Load(); b != filled {
		t.Errorf("%d bytes kept, want %d", b, filled)
	}
	if _, b := dedupCounts("user:*"); b != hostileBytes-maxSharedAnswer {
		t.Errorf("user * counts %d bytes, want %d", b, hostileBytes-maxSharedAnswer)
	}
	if _, b := dedupCounts("victim"); b != maxSharedAnswer {
		t.Errorf("the other key counts %d bytes, want %d", b, maxSharedAnswer)
	}

	hostile[0].f.finish(true, usage{}, 0, now)
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
	ended := func() *flight {
		f := newFlight()
		f.finish(true, usage{}, 0, now)
		return f
	}
	b.Run("replace", func(b *testing.B) {
		forgetDedupsB(b)
		keys := make([]dedupKey, 1000)
		for i := range keys {
			keys[i] = dedupKey{state: "user:u" + strconv.Itoa(i)}
			dedups.put(keys[i], "user:*", ended(), now, time.Minute)
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			f := newFlight()
			if !dedups.put(keys[i%len(keys)], "user:*", f, now, time.Minute) {
				b.Fatal("not recorded")
			}
			f.finish(true, usage{}, 0, now)
			i++
		}
	})
	b.Run("evict", func(b *testing.B) {
		forgetDedupsB(b)
		for i := 0; dedups.len() < maxDedupEntries; i++ {
			k := dedupKey{state: "user:f" + strconv.Itoa(i/maxDedupPerPrincipal), digest: bodyDigest{byte(i), byte(i >> 8), byte(i >> 16)}}
			dedups.put(k, "user:*", ended(), now, time.Minute)
		}
		victim := dedupKey{state: "victim"}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			k := dedupKey{state: "user:g" + strconv.Itoa(i%10), digest: bodyDigest{0xff, byte(i), byte(i >> 8), byte(i >> 16)}}
			dedups.put(k, "user:*", ended(), now, time.Minute) // fills the table again
			if dedups.len() != maxDedupEntries {
				b.Fatal("the table is not full")
			}
			if !dedups.put(victim, "victim", ended(), now, time.Minute) {
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
	entries, kept := map[*dedupShare]int{}, map[*dedupShare]int64{}
	keyEntries, keyKept := map[*dedupShare]int{}, map[*dedupShare]int64{}
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
		if !ok || i > maxSharedBytes>>20 {
			t.Fatal("user *'s answers do not take every byte")
		}
		if f.dropped {
			break
		}
	}
	var mu sync.Mutex
	var open []*flight
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
				k := dedupKey{state: state, digest: bodyDigest{byte(g), byte(i), byte(i >> 8)}}
				f := newFlight()
				ok := dedups.put(k, owner, f, now, time.Minute)
				f.begin(200, http.Header{"Content-Type": {"text/event-stream"}})
				f.add(mib[:64<<10])
				f.add(mib)
				if !ok {
					f.finish(true, usage{}, 0, now)
					f.release()
					continue
				}
				if i%7 == 0 { // still streaming
					mu.Lock()
					open = append(open, f)
					mu.Unlock()
					continue
				}
				f.finish(true, usage{}, 0, now)
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
	if b := sharedBytes.used.Load(); b > maxSharedBytes {
		t.Errorf("%d bytes kept, past %d", b, maxSharedBytes)
	}
	for _, f := range open {
		f.add(mib[:1])
		f.finish(true, usage{}, 0, now)
	}
	checkDedupCounts(t)
	if n, shares, heavy := sweepAfterWindow(now); n != 0 || shares != 0 || heavy != 0 {
		t.Errorf("after the window: %d entries, %d shares, %d heavy keys", n, shares, heavy)
	}
	if b := sharedBytes.used.Load(); b != before {
		t.Errorf("after the window: %d bytes kept, want %d", b, before)
	}
}
