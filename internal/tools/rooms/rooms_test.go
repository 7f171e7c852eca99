package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
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

// owners says which files may write each part of a request's state
// (request.go): what was asked is written by the steps that read it
// (route and body: relay.go, request.go; a Chat Completions body's
// translation: openai.go; inspection: inspect*.go; a create's reading of
// its own body: resource_send.go), and frozen after; the current attempt
// by the attempt step; the outcome only through the methods of ending.go.
var owners = map[string][]string{
	"asked":      {"relay.go", "request.go", "openai.go", "inspect.go", "inspect_messages.go", "resource_send.go"},
	"attempting": {"attempt.go"},
	"ending":     {"ending.go"},
}

// TestEachPartOfTheRequestIsWrittenByItsOwner: no file but its owners
// assigns to a field of a part of the request's state, takes its address,
// or calls a method that changes it. A request made whole (a probe's, a
// revalidation's) may start with its own asked value anywhere; an outcome
// starts empty.
func TestEachPartOfTheRequestIsWrittenByItsOwner(t *testing.T) {
	h := rootHouse(t)
	for typ, files := range owners {
		writes := h.Writes(typ)
		if len(writes) == 0 {
			t.Errorf("found no write of %s at all: has the type been renamed?", typ)
		}
		for _, w := range writes {
			if slices.Contains(files, w.File) || typ == "asked" && w.Field == typ+"{}" {
				continue
			}
			t.Errorf("%s:%d writes %s: only %s may", w.File, w.Line, w.Field, strings.Join(files, ", "))
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

// under reports whether the package at path (within the module; "." the
// root) is in room: room itself, or, for a room ending in a slash, a
// package below it.
func under(path, room string) bool {
	if strings.HasSuffix(room, "/") {
		return strings.HasPrefix(path, room)
	}
	return path == room || room != "." && strings.HasPrefix(path, room+"/")
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
			return under(from, a.room)
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
			ok := slices.ContainsFunc(arrows[i].may, func(m string) bool { return under(to, m) })
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

// fileMap reads the tables of docs/architecture.md's "Where things are":
// the names in backquotes of the packages (a path with a slash, in a row's
// first column) and of the root's files (a name or a pattern ending in
// .go, in a row's last column).
func fileMap(t *testing.T) (files, packages []string) {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(moduleRoot, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	start := strings.Index(text, "\n## Where things are")
	if start < 0 {
		t.Fatal(`docs/architecture.md has no section "Where things are"`)
	}
	text = text[start+1:]
	if end := strings.Index(text, "\n## "); end >= 0 {
		text = text[:end]
	}
	name := regexp.MustCompile("`([^`]+)`")
	for _, line := range strings.Split(text, "\n") {
		if !strings.HasPrefix(line, "|") || strings.HasPrefix(line, "| ---") {
			continue
		}
		// the rooms' table names packages in its first column; the
		// root's, files in its last
		cells := strings.Split(strings.Trim(line, "| "), " | ")
		for _, m := range name.FindAllStringSubmatch(cells[0], -1) {
			if n := m[1]; strings.Contains(n, "/") && !strings.ContainsAny(n, " .") && !strings.HasPrefix(n, "/") {
				packages = append(packages, strings.TrimSuffix(n, "/"))
			}
		}
		for _, m := range name.FindAllStringSubmatch(cells[len(cells)-1], -1) {
			if n := m[1]; strings.HasSuffix(n, ".go") && !strings.Contains(n, "/") {
				files = append(files, n)
			}
		}
	}
	return files, packages
}

// TestTheFileMapIsTheTree: docs/architecture.md's map names every source
// file of the root package and every package of the module, and nothing
// that is not there.
func TestTheFileMapIsTheTree(t *testing.T) {
	files, packages := fileMap(t)
	entries, err := os.ReadDir(moduleRoot)
	if err != nil {
		t.Fatal(err)
	}
	var tree []string
	for _, e := range entries {
		if n := e.Name(); strings.HasSuffix(n, ".go") && !strings.HasSuffix(n, "_test.go") {
			tree = append(tree, n)
		}
	}
	matches := func(pattern, name string) bool { ok, _ := filepath.Match(pattern, name); return ok }
	for _, f := range tree {
		if !slices.ContainsFunc(files, func(p string) bool { return matches(p, f) }) {
			t.Errorf("%s is not in docs/architecture.md's file map", f)
		}
	}
	for _, p := range files {
		if !slices.ContainsFunc(tree, func(f string) bool { return matches(p, f) }) {
			t.Errorf("docs/architecture.md's file map names %s, which is not a source file of the root", p)
		}
	}
	for _, p := range modulePackages(t) {
		rel := strings.TrimPrefix(p.ImportPath, module+"/")
		if p.ImportPath == module || strings.HasPrefix(rel, "internal/tools/") {
			continue
		}
		if !slices.ContainsFunc(packages, func(m string) bool { return rel == m || strings.HasPrefix(rel, m+"/") }) {
			t.Errorf("package %s is not in docs/architecture.md's file map", rel)
		}
	}
	for _, m := range packages {
		if _, err := os.Stat(filepath.Join(moduleRoot, m)); err != nil {
			t.Errorf("docs/architecture.md's file map names %s, which is not in the tree", m)
		}
	}
}

// The root holds the request path: few enough files that a newcomer can
// read its list, none too long to read at a sitting.
const (
	maxRootFiles = 75
	maxFileLines = 600
)

// TestTheRootHoldsTheRequestPath: the root package has at most
// maxRootFiles source files, and no source file of the module is longer
// than maxFileLines.
func TestTheRootHoldsTheRequestPath(t *testing.T) {
	h := rootHouse(t)
	if len(h.Files) > maxRootFiles {
		t.Errorf("the root package has %d source files, more than %d: move a leaf or a kind of state into a package of its own", len(h.Files), maxRootFiles)
	}
	cmd := exec.Command("git", "ls-files", "*.go")
	cmd.Dir = moduleRoot
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range strings.Fields(string(out)) {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(moduleRoot, f))
		if err != nil {
			continue // deleted in the work tree
		}
		if n := bytes.Count(b, []byte("\n")); n > maxFileLines {
			t.Errorf("%s has %d lines, more than %d: cut it by concept", f, n, maxFileLines)
		}
	}
}
