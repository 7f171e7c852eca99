package dedup

import (
	"crypto/sha256"
	"slices"
	"sync"
	"time"
)

// The dedup table's bounds, shared fairly. A principal (a key, an
// identity) holds at most a tenth of the table's entries and of the bytes
// kept (MaxPerPrincipal, maxBytesPerPrincipal). A key may serve
// many principals (user * serves every identity), so one key could still
// take the whole table with ten of them, and leave every other tenant's
// retries to be paid twice. So under pressure, a table full of entries or
// a process out of bytes to keep, a key that holds less than its share (a
// tenth) takes the place of the oldest ended entry of the key that holds
// the most, over its share. Without pressure a key may hold as much as
// nobody else needs, and a request pays nothing for the rule.
const (
	// keyShare is a key's share of the table's entries: below it, a
	// key's request may take the place of an entry of a key above it,
	// once the table is full.
	keyShare = MaxEntries / 10
	// bytesKeyShare is the same in the bytes kept: below it, a
	// key's flight may take the bytes of an ended entry of a key above it,
	// once every byte is taken.
	bytesKeyShare = maxBytes / 10
	// maxEvictScan bounds the entries one eviction looks at, from the
	// oldest of a key, and the entries it lets go of: a key's flights
	// still in flight are passed over (and go to the back), so that its
	// open streams cannot make each request under pressure walk them all.
	maxEvictScan = 16
)

// Key is a request as a retry must repeat it: the same principal, the
// same idempotency key (or none) and the same request. The client's key is
// kept as a digest, whatever its length.
type Key struct {
	state  string
	digest Digest // of the request, and of its idempotency key if any
}

// NewKey is the key of the request of digest d by the principal whose state
// id is state, with the idempotency key idem (or none).
func NewKey(state, idem string, d Digest) Key {
	if idem != "" {
		d = sha256.Sum256(append(d[:], idem...))
	}
	return Key{state: state, digest: d}
}

// Table holds the flights of the requests that may be retried, per
// node, bounded in entries and in bytes: in all, per principal and, under
// pressure, per key.
type Table struct {
	mu sync.Mutex
	m  map[Key]*Flight
	// shares are by principal (Key.state) and by key (the owner Put is
	// given), while either counts an entry; a key that serves one
	// principal (a relay key, a user entry) is that principal, and counts
	// both in one
	shares map[string]*holding
	// heavy lists the keys that may hold more than their share: the only
	// ones an eviction looks at (a few: ten shares fill the table)
	heavy     []*holding
	lastSweep time.Time
}

// holding is what the entries of one principal take, and of one key:
// entries, and the bytes their flights keep. It lives as long as it counts
// an entry, and a flight gives its bytes back before its entry goes, so it
// is let go of with none counted.
type holding struct {
	name           string
	principal, key shareCount
	heavy          bool    // in Table.heavy
	oldest, newest *Flight // the key's entries, oldest first
}

type shareCount struct {
	entries int
	bytes   byteBudget
}

// entry is where a flight the dedup table holds sits in its key's
// order; Table.mu guards it. Its entry's key is its digest and its
// principal's name (Flight.share).
type entry struct {
	digest     Digest
	prev, next *Flight
}

// NewTable is an empty table. The bytes its flights keep count in the
// process's, with every other flight's.
func NewTable() *Table {
	return &Table{m: map[Key]*Flight{}, shares: map[string]*holding{}}
}

// Find returns the flight a retry may attach to: in flight, or answered
// successfully within window.
func (t *Table) Find(k Key, now time.Time, window time.Duration) *Flight {
	t.mu.Lock()
	defer t.mu.Unlock()
	f := t.m[k]
	if f == nil {
		return nil
	}
	f.mu.Lock()
	live := !f.dropped && (!f.done || f.ok && now.Sub(f.ended) <= window)
	if live {
		f.followers++
	}
	f.mu.Unlock()
	if !live {
		return nil
	}
	return f
}

// Put records f as the flight of k, a request of a principal served under
// the key owner (its state id), in place of an earlier one that has ended,
// and reports whether it did: an identical request still in flight keeps
// its place (its retries are as well answered by it), a principal that
// holds its share takes no more, and a full table takes no more unless
// the owner holds less than its share and another key more (evictFor).
// The table is swept at most once a second, so a full table costs a
// request nothing more. A flight the table holds gives its bytes back
// when it leaves the table, after it ended.
func (t *Table) Put(k Key, owner string, f *Flight, now time.Time, window time.Duration) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if now.Sub(t.lastSweep) >= min(window, time.Second) {
		t.sweep(now, window)
	}
	ks := t.shares[owner]
	if old := t.m[k]; old != nil {
		if !old.stopped() {
			return false
		}
		if old.owner == ks { // f takes its place, and its counts
			p := old.share
			t.detach(old)
			t.attach(k, f, p, ks)
			return true
		}
		t.forget(k) // its principal is served under another key since
		ks = t.shares[owner]
	}
	p := t.shares[k.state]
	if p != nil && p.principal.entries >= MaxPerPrincipal ||
		len(t.m) >= MaxEntries && !t.evictFor(ks) {
		return false
	}
	if p == nil {
		p = &holding{name: k.state}
		t.shares[k.state] = p
	}
	if ks == nil {
		if ks = p; owner != k.state {
			ks = &holding{name: owner}
			t.shares[owner] = ks
		}
	}
	p.principal.entries++
	ks.key.entries++
	t.attach(k, f, p, ks)
	return true
}

// attach makes f the flight of k, counted in the shares of its principal
// p and its key ks, as the newest entry of ks; t.mu is held.
func (t *Table) attach(k Key, f *Flight, p, ks *holding) {
	f.mu.Lock()
	f.table, f.share, f.owner = t, p, ks
	p.principal.bytes.used.Add(f.kept) // what it kept before (none, from a request)
	ks.key.bytes.used.Add(f.kept)
	f.mu.Unlock()
	f.entry.digest = k.digest
	ks.push(f)
	t.m[k] = f
	t.markHeavy(ks)
}

// detach gives back the bytes f counts and takes it out of its key's
// order; the counts of entries are the caller's. t.mu is held.
func (t *Table) detach(f *Flight) {
	f.owner.unlink(f)
	f.mu.Lock()
	f.giveBack()
	f.table, f.share, f.owner = nil, nil, nil
	f.mu.Unlock()
}

// forget deletes the entry of k, giving back the bytes its flight counts;
// t.mu is held.
func (t *Table) forget(k Key) {
	f := t.m[k]
	if f == nil {
		return
	}
	p, ks := f.share, f.owner
	t.detach(f)
	delete(t.m, k)
	p.principal.entries--
	ks.key.entries--
	t.letGo(p)
	if ks != p {
		t.letGo(ks)
	}
}

// letGo deletes s once it counts no entry; t.mu is held.
func (t *Table) letGo(s *holding) {
	if s.principal.entries > 0 || s.key.entries > 0 {
		return
	}
	delete(t.shares, s.name)
	if s.heavy {
		if i := slices.Index(t.heavy, s); i >= 0 {
			t.heavy = slices.Delete(t.heavy, i, i+1)
		}
		s.heavy = false
	}
}

// push appends f to the key's entries, as its newest.
func (s *holding) push(f *Flight) {
	f.entry.prev, f.entry.next = s.newest, nil
	if s.newest != nil {
		s.newest.entry.next = f
	} else {
		s.oldest = f
	}
	s.newest = f
}

// unlink takes f out of the key's entries.
func (s *holding) unlink(f *Flight) {
	e := &f.entry
	if e.prev != nil {
		e.prev.entry.next = e.next
	} else {
		s.oldest = e.next
	}
	if e.next != nil {
		e.next.entry.prev = e.prev
	} else {
		s.newest = e.prev
	}
	e.prev, e.next = nil, nil
}

// over reports whether the key holds more than its share, in entries or
// in bytes.
func (s *holding) over() bool {
	return s.key.entries > keyShare || s.key.bytes.used.Load() > bytesKeyShare
}

// markHeavy lists s in t.heavy once it holds more than its share; t.mu is
// held.
func (t *Table) markHeavy(s *holding) {
	if !s.heavy && s.over() {
		s.heavy = true
		t.heavy = append(t.heavy, s)
	}
}

// heaviest is the key that holds the most entries (or bytes) over its
// share, nil when none does; those no longer over either leave t.heavy.
// t.mu is held.
func (t *Table) heaviest(inBytes bool) *holding {
	var top *holding
	var most int64
	listed := t.heavy[:0]
	for _, s := range t.heavy {
		if !s.over() {
			s.heavy = false
			continue
		}
		listed = append(listed, s)
		v, share := int64(s.key.entries), int64(keyShare)
		if inBytes {
			v, share = s.key.bytes.used.Load(), bytesKeyShare
		}
		if v > share && v > most {
			top, most = s, v
		}
	}
	clear(t.heavy[len(listed):])
	t.heavy = listed
	return top
}

// evictFor makes room in a full table for an entry of the key whose share
// is ks (nil: it has none yet), when that key holds less than its share:
// the oldest ended entry of the key that holds the most, over its share,
// leaves. t.mu is held.
func (t *Table) evictFor(ks *holding) bool {
	if ks != nil && ks.key.entries >= keyShare {
		return false
	}
	v := t.heaviest(false)
	if v == nil {
		return false
	}
	_, ok := t.evictOldest(v)
	return ok
}

// makeRoom frees at least n of the bytes kept for a flight of the key
// whose share is ks, when that key keeps less than its share: the oldest
// ended entries of the key that keeps the most, over its share, leave. It
// reports whether it freed any.
func (t *Table) makeRoom(ks *holding, n int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ks.key.bytes.used.Load()+n > bytesKeyShare {
		return false
	}
	var freed int64
	for range maxEvictScan {
		v := t.heaviest(true)
		if v == nil {
			break
		}
		got, ok := t.evictOldest(v)
		if !ok {
			break
		}
		if freed += got; freed >= n {
			break
		}
	}
	return freed > 0
}

// evictOldest forgets the oldest entry of the key ks whose flight has
// ended (done, or dropped), and returns the bytes it kept. A flight still
// in flight, whose followers are attached to it, never leaves this way: it
// goes to the back of its key's order, and at most maxEvictScan entries
// are looked at. t.mu is held.
func (t *Table) evictOldest(ks *holding) (freed int64, ok bool) {
	for range maxEvictScan {
		f := ks.oldest
		if f == nil {
			return 0, false
		}
		f.mu.Lock()
		ended, kept := f.done || f.dropped, f.kept
		f.mu.Unlock()
		if ended {
			t.forget(Key{state: f.share.name, digest: f.entry.digest})
			return kept, true
		}
		if f == ks.newest {
			return 0, false
		}
		ks.unlink(f)
		ks.push(f)
	}
	return 0, false
}

// Sweep forgets the flights that ended more than window ago, and dropped
// ones, as the table does at most once a second as requests come.
func (t *Table) Sweep(now time.Time, window time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.sweep(now, window)
}

// sweep forgets the flights that ended more than window ago, and dropped
// ones, and lists again the keys over their share (one whose answers grew
// past it since its last request, one that fell back); t.mu is held.
func (t *Table) sweep(now time.Time, window time.Duration) {
	t.lastSweep = now
	for k, f := range t.m {
		f.mu.Lock()
		gone := f.dropped || f.done && (!f.ok || now.Sub(f.ended) > window)
		f.mu.Unlock()
		if gone {
			t.forget(k)
		}
	}
	for _, s := range t.heavy {
		s.heavy = false
	}
	clear(t.heavy)
	t.heavy = t.heavy[:0]
	for _, s := range t.shares {
		t.markHeavy(s)
	}
}

// Len is the number of entries, the table's own accounting.
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// Clear forgets every entry, giving back the bytes their flights count.
func (t *Table) Clear() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.m {
		t.forget(k)
	}
}

// Counts is what the entries held under the key owner take: their number
// and the bytes they keep.
func (t *Table) Counts(owner string) (entries int, kept int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if s := t.shares[owner]; s != nil {
		return s.key.entries, s.key.bytes.used.Load()
	}
	return 0, 0
}

// Counted lists the names of the principals and keys the table counts
// entries of.
func (t *Table) Counted() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	names := make([]string, 0, len(t.shares))
	for name := range t.shares {
		names = append(names, name)
	}
	return names
}

// Stats is what the table counts: its entries, the principals and keys it
// counts them of, and the keys it lists as over their share.
func (t *Table) Stats() (entries, counted, heavy int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m), len(t.shares), len(t.heavy)
}

// Followers is the number of requests that follow the flights the table
// holds.
func (t *Table) Followers() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, f := range t.m {
		f.mu.Lock()
		n += f.followers
		f.mu.Unlock()
	}
	return n
}
