package affinity

import (
	"strings"
	"testing"
)

// body is a prompt of three sections, each a string of n bytes, and where
// each section's value lies in it.
func body(tools, system, messages int) ([]byte, [numSections][2]int) {
	var b strings.Builder
	var at [numSections][2]int
	b.WriteString(`{"tools":`)
	for sect, n := range []int{tools, system, messages} {
		if sect == SectSystem {
			b.WriteString(`,"system":`)
		} else if sect == SectMessages {
			b.WriteString(`,"messages":`)
		}
		at[sect][0] = b.Len()
		b.WriteString(`"` + strings.Repeat("x", n) + `"`)
		at[sect][1] = b.Len()
	}
	b.WriteString("}")
	return []byte(b.String()), at
}

// noted is a Prompt of body whose sections are at, with a breakpoint at
// the end of each section named.
func noted(at [numSections][2]int, marked ...int) *Prompt {
	p := new(Prompt)
	for sect, s := range at {
		p.NoteSpan(sect, s[0], s[1])
	}
	for _, sect := range marked {
		p.Mark(uint8(sect), at[sect][1], false)
	}
	return p
}

func TestDigestKeysThePrefixesLongEnoughToCache(t *testing.T) {
	b, at := body(100, 5000, 6000)
	p := noted(at, SectTools, SectSystem, SectMessages)
	if !p.Digest(1, "g", "claude-sonnet-4-5", b) {
		t.Fatal("no key")
	}
	// the tools alone are under 1,024 tokens (4 bytes a token)
	if p.N != 2 || p.Model != "claude-sonnet-4-5" || p.Group != "g" {
		t.Fatalf("N %d model %q group %q, want 2 keys of g's claude-sonnet-4-5", p.N, p.Model, p.Group)
	}
	if p.Keys[0] == p.Keys[1] {
		t.Fatal("two prefixes have one key")
	}

	// the same prefix digests alike; another seed, group or model does not
	q := noted(at, SectSystem)
	q.Digest(1, "g", "claude-sonnet-4-5", b)
	if q.N != 1 || q.Keys[0] != p.Keys[0] {
		t.Fatalf("the system's prefix alone: %+v, want the key %x", q, p.Keys[0])
	}
	for _, c := range []struct {
		seed         uint64
		group, model string
	}{{2, "g", "claude-sonnet-4-5"}, {1, "h", "claude-sonnet-4-5"}, {1, "g", "claude-opus-4-1"}} {
		r := noted(at, SectSystem)
		if r.Digest(c.seed, c.group, c.model, b) && r.Keys[0] == p.Keys[0] {
			t.Errorf("%+v: the same key", c)
		}
	}

	// a Haiku model caches from 2,048 tokens
	h := noted(at, SectSystem, SectMessages)
	if !h.Digest(1, "g", "claude-haiku-4-5", b) || h.N != 1 {
		t.Fatalf("haiku: %d keys, want the longer prefix only", h.N)
	}
}

func TestDigestTakesNoBreakpointsPastTheLimit(t *testing.T) {
	b, at := body(100, 5000, 6000)
	p := noted(at, SectSystem, SectSystem, SectMessages, SectMessages, SectMessages)
	if p.Digest(1, "g", "m", b) {
		t.Fatalf("five breakpoints: keys %+v", p.Keys[:p.N])
	}
	if p.Breakpoints() != MaxBreakpoints {
		t.Fatalf("%d breakpoints noted", p.Breakpoints())
	}
	if none := noted(at); none.Digest(1, "g", "m", b) {
		t.Fatal("keys without a breakpoint")
	}
	// a breakpoint outside its section cannot be
	bad := noted(at)
	bad.Mark(SectSystem, at[SectMessages][1], false)
	if bad.Digest(1, "g", "m", b) {
		t.Fatal("keys of a breakpoint outside its section")
	}
}

func TestAutomaticCachingMarksTheWholePrompt(t *testing.T) {
	b, at := body(100, 5000, 6000)
	p := noted(at, SectSystem)
	p.SetAutomatic(true, true)
	if !p.Digest(1, "g", "m", b) || p.N != 2 || p.TTL1h[0] || !p.TTL1h[1] {
		t.Fatalf("N %d TTL1h %v, want the system's 5m key and the whole prompt's 1h one", p.N, p.TTL1h)
	}
	if p.TTL(0) != CacheTTL || p.TTL(1) != CacheTTL1h {
		t.Fatalf("TTLs %v %v", p.TTL(0), p.TTL(1))
	}
	whole := noted(at, SectSystem, SectMessages)
	whole.Digest(1, "g", "m", b)
	if whole.Keys[1] != p.Keys[1] {
		t.Fatal("the automatic breakpoint is not at the end of the messages")
	}
}
