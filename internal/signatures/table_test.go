package signatures

import (
	"strings"
	"testing"
)

func TestTableRemembersTheLastLearned(t *testing.T) {
	tbl := NewTable(2)
	if tbl.Some() {
		t.Fatal("an empty table has some")
	}
	tbl.Learn(1, "org-a", nil)
	tbl.Learn(2, "org-b", nil)
	if !tbl.Some() || tbl.DomainOf(1) != "org-a" || tbl.DomainOf(2) != "org-b" {
		t.Fatalf("learned: %q %q", tbl.DomainOf(1), tbl.DomainOf(2))
	}
	tbl.DomainOf(1) // a lookup does not keep a signature longer
	tbl.Learn(3, "org-c", nil)
	if tbl.DomainOf(1) != "" || tbl.DomainOf(3) != "org-c" {
		t.Fatalf("past its size the oldest learned goes first: %q %q", tbl.DomainOf(1), tbl.DomainOf(3))
	}
	if tbl.DomainOf(99) != "" {
		t.Fatal("a signature never learned has a domain")
	}
}

func TestDigestIsOfTheUnescapedSignature(t *testing.T) {
	plain, escaped := Digest([]byte(`"ab/c+d=="`)), Digest([]byte(`"ab\/c\u002bd=="`))
	if plain != escaped {
		t.Fatal("one signature written two ways digests apart")
	}
	if Digest([]byte(`"ab/c+d="`)) == plain {
		t.Fatal("two signatures digest alike")
	}
}

func TestValidDomain(t *testing.T) {
	for s, want := range map[string]bool{
		"acme-org":                          true,
		"anthropic:key-0123abcd":            true,
		"bedrock:us-east-1/key-ab@x.y_z":    true,
		"":                                  false,
		"two words":                         false,
		"brace{":                            false,
		"new\nline":                         false,
		strings.Repeat("a", MaxDomainLen):   true,
		strings.Repeat("a", MaxDomainLen+1): false,
	} {
		if got := ValidDomain(s); got != want {
			t.Errorf("ValidDomain(%q) = %v", s, got)
		}
	}
}

func TestASharedMessageTeachesItsValidLines(t *testing.T) {
	tbl := NewTable(16)
	tbl.learnShared("another-node\nnot-hex org-x\n1f bad domain\n\n2a org-far\n3b", "this-node")
	if tbl.DomainOf(0x2a) != "org-far" {
		t.Fatal("a valid line taught nothing")
	}
	if tbl.DomainOf(0x1f) != "" || tbl.DomainOf(0x3b) != "" {
		t.Fatal("a malformed line taught")
	}
	tbl.learnShared("this-node\n4c org-own", "this-node")
	if tbl.DomainOf(0x4c) != "" {
		t.Fatal("the node's own message, heard back, taught")
	}
}
