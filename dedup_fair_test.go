package relay

import (
	"bytes"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/dedup"
	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// putAnswered records, under the key owner, a request of the principal
// state whose answer (body) has already ended; it reports whether the
// table took it.
func putAnswered(state, owner string, i int, body []byte, now time.Time) bool {
	f := dedup.NewFlight()
	var d dedup.Digest
	d[0], d[1], d[2] = byte(i), byte(i>>8), byte(i>>16)
	ok := dedups.Put(dedup.NewKey(state, "", d), owner, f, now, time.Minute)
	f.Begin(200, http.Header{"Content-Type": {"application/json"}}, false, nil)
	f.Add(body)
	f.Finish(true, 0, 0, now)
	if !ok {
		f.Release()
	}
	return ok
}

// fillAsOneKey fills the dedup table with answered requests of the
// identities fill-<n> of the key owner, each up to its principal's share.
func fillAsOneKey(t *testing.T, owner string, now time.Time) {
	t.Helper()
	for i := 0; dedups.Len() < dedup.MaxEntries; i++ {
		if i > 2*dedup.MaxEntries {
			t.Fatalf("the table does not fill: %d entries", dedups.Len())
		}
		putAnswered(userStatePrefix+"fill-"+strconv.Itoa(i/dedup.MaxPerPrincipal), owner, i, []byte(`{"ok":true}`), now)
	}
}

// One relay key serving many identities (user *, an identity from a
// header a tenant sets as it likes) fills the whole dedup table, each
// identity within its principal's share; another key's request is still
// recorded, in place of the oldest answered entry of that key, and its
// SDK's retry is answered without the upstream. Once the window passes,
// nothing is counted.
func TestDedupKeyOfManyIdentitiesLeavesRoomForOthers(t *testing.T) {
	forgetDedups(t)
	before := dedup.SharedBytes()
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
	if n, _ := dedups.Counts("user:*"); n != 12 {
		t.Fatalf("user * counts %d entries, want its 12 identities' 12", n)
	}
	fillAsOneKey(t, "user:*", time.Now())
	if n, _ := dedups.Counts("user:*"); n != dedup.MaxEntries {
		t.Fatalf("user * holds %d entries, want the whole table, %d", n, dedup.MaxEntries)
	}

	hits := up.Hits()
	first := as("", clientKey, "0")
	retry := as("", clientKey, "1")
	if up.Hits() != hits+1 || !bytes.Equal(retry.body, first.body) {
		t.Fatalf("another key's retry in a table one key filled: %d upstream calls, want 1", up.Hits()-hits)
	}
	if n, _ := dedups.Counts(otherKeyName(t)); n != 1 {
		t.Errorf("the other key counts %d entries, want 1", n)
	}
	if n := dedups.Len(); n != dedup.MaxEntries {
		t.Errorf("the table holds %d entries, want %d", n, dedup.MaxEntries)
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

	dedups.Sweep(time.Now().Add(2*time.Minute), time.Minute)
	if n, shares, heavy := dedups.Stats(); n != 0 || shares != 0 || heavy != 0 {
		t.Errorf("after the window: %d entries, %d shares, %d heavy keys", n, shares, heavy)
	}
	if b := dedup.SharedBytes(); b != before {
		t.Errorf("after the window: %d bytes kept, want %d", b, before)
	}
}

// otherKeyName is the state id of the one key in the dedup table that is
// not user * (whose identities' state ids all start with user:).
func otherKeyName(t *testing.T) string {
	t.Helper()
	for _, name := range dedups.Counted() {
		if !strings.HasPrefix(name, userStatePrefix) {
			return name
		}
	}
	t.Fatal("the other key has no share in the table")
	return ""
}
