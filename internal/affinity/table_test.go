package affinity

import (
	"testing"
	"time"
)

var testNow = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// twoKeys is a digested Prompt of two prefixes, the longer one's TTL 1h.
func twoKeys() *Prompt {
	p := &Prompt{N: 2, Model: "m", Group: "g"}
	p.Keys[0], p.Keys[1] = KeyOf(1, 5000), KeyOf(2, 9000)
	p.TTL1h[1] = true
	return p
}

func TestTableRecordsExpireWithTheirCache(t *testing.T) {
	tbl := NewTable(1024)
	p := twoKeys()
	if ch := tbl.Warm(p, testNow, nil); ch != "" {
		t.Fatalf("an empty table has %q", ch)
	}
	tbl.Record(p, "a", testNow, nil)
	if ch := tbl.Warm(p, testNow.Add(30*time.Minute), nil); ch != "a" {
		t.Fatalf("the 1h prefix: warm on %q after 30 minutes, want a", ch)
	}
	if ch := tbl.Warm(p, testNow.Add(CacheTTL1h), nil); ch != "" {
		t.Fatalf("warm on %q after an hour", ch)
	}

	// the longest live prefix wins
	short := &Prompt{N: 1}
	short.Keys[0] = p.Keys[0]
	tbl.Record(short, "b", testNow.Add(time.Minute), nil)
	if ch := tbl.Warm(p, testNow.Add(2*time.Minute), nil); ch != "a" {
		t.Fatalf("warm on %q, want a, where the longer prefix is", ch)
	}
	if ch := tbl.Warm(short, testNow.Add(2*time.Minute), nil); ch != "b" {
		t.Fatalf("the shorter prefix is warm on %q, want b", ch)
	}
}

func TestALongerRecordOfTheSameChannelStays(t *testing.T) {
	tbl := NewTable(1024)
	k := KeyOf(3, 7000)
	tbl.Set(k, "a", testNow.Add(time.Hour).UnixNano())
	tbl.Set(k, "a", testNow.Add(5*time.Minute).UnixNano()) // a 5m read of a 1h write
	p := &Prompt{N: 1}
	p.Keys[0] = k
	if ch := tbl.Warm(p, testNow.Add(30*time.Minute), nil); ch != "a" {
		t.Fatal("a 5m record shortened a 1h one")
	}
	tbl.Set(k, "b", testNow.Add(5*time.Minute).UnixNano()) // another channel served it
	if ch := tbl.Warm(p, testNow.Add(time.Minute), nil); ch != "b" {
		t.Fatalf("warm on %q, want b, which served it last", ch)
	}
}

func TestSeedIsDerivedOnce(t *testing.T) {
	var s Seed
	if _, ok := s.Get(); ok {
		t.Fatal("a seed before Derive")
	}
	d := s.Derive([]byte("secret"))
	if got, ok := s.Get(); !ok || got != d {
		t.Fatalf("Get = %d, %v, want %d", got, ok, d)
	}
	var other Seed
	if other.Derive([]byte("secret")) != d || other.Derive([]byte("another")) == d {
		t.Fatal("the seed is not the secret's")
	}
}
