package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
)

// The house's rules, checked against the tree: the root package holds the
// request path and imports the rooms; no room imports the root back; the
// outcome of a request is written in one file.

const module = "github.com/caddy-relay/relay"

// moduleRoot is the repository's root, from this package's folder.
var moduleRoot = filepath.Join("..", "..", "..")

var measured = sync.OnceValues(func() (*House, error) { return Measure(moduleRoot) })

func rootHouse(t *testing.T) *House {
	t.Helper()
	h, err := measured()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestEachPartOfTheRequestIsWrittenByItsOwner: a request's outcome (the
// type ending) is written only by the methods of ending.go, and its
// current attempt (attempting) only by the attempt step (attempt.go): no
// other file assigns to their fields, takes their address, or calls a
// method that changes them.
func TestEachPartOfTheRequestIsWrittenByItsOwner(t *testing.T) {
	h := rootHouse(t)
	for typ, owner := range map[string]string{"ending": "ending.go", "attempting": "attempt.go"} {
		writes := h.Writes(typ)
		if len(writes) == 0 {
			t.Errorf("found no write of %s at all: has the type been renamed?", typ)
		}
		for _, w := range writes {
			if w.File != owner {
				t.Errorf("%s:%d writes %s: it is written only in %s", w.File, w.Line, w.Field, owner)
			}
		}
	}
}

type pkg struct {
	ImportPath   string
	Imports      []string
	TestImports  []string
	XTestImports []string
}

// modulePackages lists the module's packages with their imports.
func modulePackages(t *testing.T) []pkg {
	t.Helper()
	cmd := exec.Command("go", "list", "-json=ImportPath,Imports,TestImports,XTestImports", "./...")
	cmd.Dir = moduleRoot
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	var ps []pkg
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	return ps
}

// arrows says, for each room of the module (by the start of its path
// within it), which of the module's packages it may import. The root (".")
// may import every room; the binary (cmd/) the root. Nothing else imports
// the root, and a leaf never imports the status page or a provider.
var arrows = []struct {
	room  string
	may   []string // path prefixes within the module
	tests []string // more, for its tests
}{
	{".", []string{"internal/", "provider", "providers/", "statuspage"}, nil},
	{"cmd/", []string{".", "internal/", "provider", "providers/", "statuspage"}, nil},
	{"bench", []string{"internal/"}, nil},
	{"examples/", []string{"provider"}, nil},
	{"provider", nil, nil},
	{"providers/", []string{"provider", "internal/"}, nil},
	{"statuspage", []string{"internal/"}, nil},
	{"internal/", []string{"internal/", "provider"}, nil},
}

// TestImportsFollowTheArrows: every import between the module's packages
// runs along an arrow of the house: the root imports its rooms, and no room
// imports the root back.
func TestImportsFollowTheArrows(t *testing.T) {
	rel := func(path string) string {
		if path == module {
			return "."
		}
		return strings.TrimPrefix(path, module+"/")
	}
	for _, p := range modulePackages(t) {
		from := rel(p.ImportPath)
		i := slices.IndexFunc(arrows, func(a struct {
			room  string
			may   []string
			tests []string
		}) bool {
			return from == a.room || a.room != "." && strings.HasPrefix(from, a.room)
		})
		if i < 0 {
			t.Errorf("package %s is in no room of the house: add it to the arrows", from)
			continue
		}
		for _, imp := range slices.Concat(p.Imports, p.TestImports, p.XTestImports) {
			if imp != module && !strings.HasPrefix(imp, module+"/") || imp == p.ImportPath {
				continue
			}
			to := rel(imp)
			ok := slices.ContainsFunc(arrows[i].may, func(m string) bool { return to == m || m != "." && strings.HasPrefix(to, m) })
			if !ok {
				t.Errorf("%s imports %s: against the arrows (a room never imports the root, a leaf never the status page or a provider)", from, to)
			}
		}
	}
}

// TestNoUnsafeOutsideJSONScan: only internal/jsonscan, whose reads of a
// body are measured and fuzzed, bets on the runtime's internals.
func TestNoUnsafeOutsideJSONScan(t *testing.T) {
	cmd := exec.Command("git", "grep", "-l", "-E", `^\s*(import\s+)?"unsafe"|^import "unsafe"`, "--", "*.go")
	cmd.Dir = moduleRoot
	out, _ := cmd.Output() // exit 1: none found
	for _, f := range strings.Fields(string(out)) {
		if !regexp.MustCompile(`^internal/jsonscan/`).MatchString(f) {
			t.Errorf("%s imports unsafe: only internal/jsonscan may", f)
		}
	}
}
