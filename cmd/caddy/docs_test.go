package main

// The documentation as a newcomer uses it: every shell block of README.md
// and docs/*.md is marked runnable or not; the runnable ones are run, in
// order, against the quickstart started as the README says; the listings
// that show a file are that file; links and tables of contents resolve.

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"
)

// repoRoot is the repository root, seen from this package's directory.
const repoRoot = "../.."

// The markers a shell block carries on the line before its fence.
const (
	runnableMarker    = "<!-- runnable -->"
	notRunnablePrefix = "<!-- not runnable: "
	fileMarkerPrefix  = "<!-- file: "
)

// quickstartCommand is the README's first command: the docs test starts
// the relay as it says.
const quickstartCommand = "go run ./cmd/caddy run --config examples/quickstart.Caddyfile"

// docFile is one Markdown file of the documentation.
type docFile struct {
	path  string // relative to the repository root
	lines []string
}

// codeBlock is one fenced block of a docFile.
type codeBlock struct {
	file   string
	line   int    // 1-based line of the opening fence
	lang   string // the fence's info string
	marker string // the line before the fence
	body   string
}

// fence reports whether line opens or closes a fenced code block (which
// may be indented, inside a list item).
func fence(line string) bool { return strings.HasPrefix(strings.TrimLeft(line, " "), "```") }

func (b codeBlock) shell() bool {
	switch b.lang {
	case "sh", "bash", "shell", "console":
		return true
	}
	return false
}

func (b codeBlock) runnable() bool { return b.marker == runnableMarker }

func (b codeBlock) where() string { return fmt.Sprintf("%s:%d", b.file, b.line) }

// docFiles returns README.md, then docs/*.md in alphabetical order: the
// order the runnable blocks run in.
func docFiles(t *testing.T) []docFile {
	t.Helper()
	paths := []string{"README.md"}
	more, err := filepath.Glob(filepath.Join(repoRoot, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(more)
	for _, p := range more {
		rel, err := filepath.Rel(repoRoot, p)
		if err != nil {
			t.Fatal(err)
		}
		paths = append(paths, filepath.ToSlash(rel))
	}
	var files []docFile
	for _, p := range paths {
		b, err := os.ReadFile(filepath.Join(repoRoot, p))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, docFile{path: p, lines: strings.Split(string(b), "\n")})
	}
	return files
}

// blocks returns the fenced code blocks of f, in order.
func (f docFile) blocks(t *testing.T) []codeBlock {
	t.Helper()
	var out []codeBlock
	for i := 0; i < len(f.lines); i++ {
		line := strings.TrimLeft(f.lines[i], " ")
		if !fence(line) {
			continue
		}
		b := codeBlock{file: f.path, line: i + 1, lang: strings.TrimSpace(strings.TrimPrefix(line, "```"))}
		if i > 0 {
			b.marker = strings.TrimSpace(f.lines[i-1])
		}
		var body []string
		for i++; i < len(f.lines) && !fence(f.lines[i]); i++ {
			body = append(body, f.lines[i])
		}
		if i == len(f.lines) {
			t.Errorf("%s: the code block has no closing fence", b.where())
		}
		b.body = strings.Join(body, "\n")
		out = append(out, b)
	}
	return out
}

// anchors returns the GitHub anchors of f's headings (outside code).
func (f docFile) anchors() map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	inCode := false
	for _, line := range f.lines {
		if fence(line) {
			inCode = !inCode
			continue
		}
		if inCode || !strings.HasPrefix(line, "#") {
			continue
		}
		text := strings.TrimSpace(strings.TrimLeft(line, "#"))
		a := slug(text)
		if n := seen[a]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", a, n)] = true
		} else {
			anchors[a] = true
		}
		seen[a]++
	}
	return anchors
}

// slug is GitHub's anchor of a heading: lower case, punctuation dropped,
// spaces turned into hyphens.
func slug(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}

// TestDocsText checks the documentation without running anything: every
// shell block is marked, a listing marked as a file is that file, links and
// tables of contents resolve, and the text cites nothing outside the
// repository.
func TestDocsText(t *testing.T) {
	files := docFiles(t)
	anchors := map[string]map[string]bool{}
	for _, f := range files {
		anchors[f.path] = f.anchors()
	}
	goMod, err := os.ReadFile(filepath.Join(repoRoot, "go.mod"))
	if err != nil {
		t.Fatal(err)
	}
	goVersion := regexp.MustCompile(`(?m)^go (\S+)$`).FindSubmatch(goMod)
	if goVersion == nil {
		t.Fatal("go.mod has no go directive")
	}
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	cited := regexp.MustCompile(`DESIGN\.md|\b[Ii]ssues? #?\d+`)
	goVersionMention := regexp.MustCompile(`\bGo 1\.\d+(\.\d+)?( or later)?`)

	for _, f := range files {
		for _, b := range f.blocks(t) {
			switch {
			case strings.HasPrefix(b.marker, fileMarkerPrefix):
				name := strings.TrimSuffix(strings.TrimPrefix(b.marker, fileMarkerPrefix), " -->")
				want, err := os.ReadFile(filepath.Join(repoRoot, name))
				if err != nil {
					t.Errorf("%s: the listing names %s: %v", b.where(), name, err)
				} else if strings.TrimRight(string(want), "\n") != b.body {
					t.Errorf("%s: the listing differs from %s; copy the file into it", b.where(), name)
				}
			case !b.shell():
			case b.runnable():
				if regexp.MustCompile(`caddy (run|start)\b`).MatchString(b.body) {
					t.Errorf("%s: a runnable block starts the relay; the docs test starts it itself, so mark it %q", b.where(), notRunnablePrefix+"starts the relay; the docs test starts it itself -->")
				}
			case strings.HasPrefix(b.marker, notRunnablePrefix) && strings.HasSuffix(b.marker, "-->"):
			default:
				t.Errorf("%s: a shell block needs %q or %q on the line before its fence", b.where(), runnableMarker, notRunnablePrefix+"<what it needs> -->")
			}
		}

		inCode := false
		for i, line := range f.lines {
			where := fmt.Sprintf("%s:%d", f.path, i+1)
			if fence(line) {
				inCode = !inCode
			}
			trimmed := strings.TrimSpace(line)
			if (trimmed == runnableMarker || strings.HasPrefix(trimmed, notRunnablePrefix)) &&
				(i+1 == len(f.lines) || !fence(f.lines[i+1])) {
				t.Errorf("%s: a runnable marker must sit on the line right before a code fence", where)
			}
			if m := cited.FindString(line); m != "" {
				t.Errorf("%s: %q cites something outside the repository; say the rule instead", where, m)
			}
			for _, m := range goVersionMention.FindAllStringSubmatch(line, -1) {
				if m[0] != "Go "+string(goVersion[1])+" or later" {
					t.Errorf("%s: %q: say \"Go %s or later\", as go.mod does", where, m[0], goVersion[1])
				}
			}
			if inCode {
				continue
			}
			for _, m := range link.FindAllStringSubmatch(line, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				path, anchor, _ := strings.Cut(target, "#")
				file := f.path
				if path != "" {
					file = filepath.ToSlash(filepath.Join(filepath.Dir(f.path), path))
					if _, err := os.Stat(filepath.Join(repoRoot, file)); err != nil {
						t.Errorf("%s: link to %s: no such file", where, target)
						continue
					}
				}
				if anchor == "" {
					continue
				}
				known, ok := anchors[file]
				if !ok {
					t.Errorf("%s: link to %s: an anchor into a file that is not documentation", where, target)
				} else if !known[anchor] {
					t.Errorf("%s: link to %s: %s has no heading with that anchor", where, target, file)
				}
			}
		}

		if strings.HasPrefix(f.path, "docs/") {
			checkContents(t, f)
		}
	}
}

// checkContents checks that a page of docs/ opens with a table of contents
// that lists every section.
func checkContents(t *testing.T, f docFile) {
	t.Helper()
	start := slices.Index(f.lines, "## Contents")
	if start < 0 || start > 40 {
		t.Errorf("%s: no \"## Contents\" near the top", f.path)
		return
	}
	listed := map[string]bool{}
	i := start + 1
	for ; i < len(f.lines) && !strings.HasPrefix(f.lines[i], "## "); i++ {
		if m := regexp.MustCompile(`\]\(#([^)]+)\)`).FindStringSubmatch(f.lines[i]); m != nil {
			listed[m[1]] = true
		}
	}
	inCode := false
	for j, line := range f.lines {
		if fence(line) {
			inCode = !inCode
		}
		if inCode || j <= start || !strings.HasPrefix(line, "## ") {
			continue
		}
		if a := slug(strings.TrimPrefix(line, "## ")); !listed[a] {
			t.Errorf("%s:%d: the section %q is missing from the contents", f.path, j+1, line)
		}
	}
}

// TestCIRunsTheREADMEsTestCommand: CI (.ci/run) runs go vet, then exactly
// the test command the README's first block gives a newcomer, so that what
// the README promises is what CI proves.
func TestCIRunsTheREADMEsTestCommand(t *testing.T) {
	files := docFiles(t)
	var first []string
	for _, b := range files[0].blocks(t) {
		if b.shell() {
			first = strings.Split(b.body, "\n")
			break
		}
	}
	if len(first) != 2 {
		t.Fatalf("README.md's first shell block has %d lines, want 2: the quickstart and the tests", len(first))
	}
	want, _, _ := strings.Cut(first[1], "#")
	want = strings.TrimSpace(want)
	ci, err := os.ReadFile(filepath.Join(repoRoot, ".ci/run"))
	if err != nil {
		t.Fatal(err)
	}
	var commands []string
	for _, line := range strings.Split(string(ci), "\n") {
		if line = strings.TrimSpace(line); strings.HasPrefix(line, "go vet") || strings.HasPrefix(line, "go test") {
			commands = append(commands, line)
		}
	}
	vet, test := slices.Index(commands, "go vet ./..."), slices.Index(commands, want)
	if vet < 0 || test < 0 || vet > test {
		t.Errorf(".ci/run runs %q; want go vet ./..., then the README's test command %q", commands, want)
	}
}

// TestSDKExampleBuilds compiles the Go program the README shows.
func TestSDKExampleBuilds(t *testing.T) {
	cmd := exec.Command("go", "build", "-o", filepath.Join(t.TempDir(), "sdk-example"), "./examples/sdk/go")
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./examples/sdk/go: %v\n%s", err, out)
	}
}

// TestDocsRunnableBlocks starts the quickstart as the README says (ports
// 8080 and 2019, as written), then runs every runnable shell block with
// `bash -euo pipefail` in the repository root: README.md first, then
// docs/*.md in alphabetical order, each file's blocks in document order,
// all against that one relay. Then it runs the Go SDK example against it.
func TestDocsRunnableBlocks(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the quickstart on ports 8080 and 2019 and runs the documentation's commands")
	}
	for _, tool := range []string{"bash", "curl", "jq", "openssl", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("the documentation's commands need %s (CI must have it): %v", tool, err)
			}
			t.Skipf("the documentation's commands need %s; install it (apt-get install -y %s) to run this test", tool, tool)
		}
	}
	files := docFiles(t)

	// The README's first shell block holds the command that starts the
	// quickstart: start it the same way, with the binary TestMain built.
	var first *codeBlock
	for _, b := range files[0].blocks(t) {
		if b.shell() {
			first = &b
			break
		}
	}
	if first == nil {
		t.Fatal("README.md has no shell block")
	}
	command, _, _ := strings.Cut(strings.SplitN(first.body, "\n", 2)[0], "#")
	if strings.TrimSpace(command) != quickstartCommand {
		t.Fatalf("%s: the README's first command is %q, want %q; update this test with it", first.where(), strings.TrimSpace(command), quickstartCommand)
	}
	for _, addr := range []string{":8080", "localhost:2019"} {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatalf("port %s is busy: the docs test starts the quickstart on it, as the README says (is a quickstart already running?): %v", strings.TrimPrefix(addr, "localhost"), err)
		}
		_ = ln.Close()
	}
	args := strings.Fields(quickstartCommand)
	runCaddy(t, caddyBin, filepath.Join(repoRoot, args[len(args)-1]))

	ran := 0
	for _, f := range files {
		for _, b := range f.blocks(t) {
			if !b.shell() || !b.runnable() {
				continue
			}
			ran++
			out, err := runBlock(b.body, 3*time.Minute)
			if err != nil {
				t.Errorf("%s: the runnable block failed: %v\n--- block:\n%s\n--- output:\n%s", b.where(), err, b.body, out)
			} else if testing.Verbose() {
				t.Logf("%s: ok\n%s", b.where(), out)
			}
		}
	}
	if ran == 0 {
		t.Fatal("no runnable block found")
	}
	t.Logf("ran %d runnable blocks", ran)

	out, err := runBlock("go run ./examples/sdk/go", 3*time.Minute)
	if err != nil || !strings.Contains(out, "hello from caddy-relay's mock provider") {
		t.Errorf("go run ./examples/sdk/go against the quickstart: %v\n%s", err, out)
	}
}

// runBlock runs script with bash -euo pipefail in the repository root and
// returns its output (stdout and stderr).
func runBlock(script string, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
	cmd.Dir = repoRoot
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		err = fmt.Errorf("timed out after %v: %w", timeout, err)
	}
	return string(out), err
}

// outputMarkerPrefix marks a listing as what a command prints: the docs
// test runs the command with the binary it built and compares.
const outputMarkerPrefix = "<!-- output of: ./caddy "

// TestDocsCommandOutputs: a listing marked "output of: ./caddy <args> |
// grep <word>" is what this package's binary prints for it (the modules
// docs/operations.md says list-modules shows), so the text follows the
// code when a module is added.
func TestDocsCommandOutputs(t *testing.T) {
	checked := 0
	for _, f := range docFiles(t) {
		for _, b := range f.blocks(t) {
			rest, ok := strings.CutPrefix(b.marker, outputMarkerPrefix)
			if !ok {
				continue
			}
			command, ok := strings.CutSuffix(rest, " -->")
			args, word, piped := strings.Cut(command, " | grep ")
			if !ok || !piped {
				t.Errorf("%s: the marker must read %q", b.where(), outputMarkerPrefix+"<args> | grep <word> -->")
				continue
			}
			out, err := exec.Command(caddyBin, strings.Fields(args)...).CombinedOutput()
			if err != nil {
				t.Fatalf("%s: caddy %s: %v\n%s", b.where(), args, err, out)
			}
			var want []string
			for line := range strings.SplitSeq(string(out), "\n") {
				if strings.Contains(line, strings.TrimSpace(word)) {
					want = append(want, line)
				}
			}
			if got := strings.Join(want, "\n"); got != b.body {
				t.Errorf("%s: the listing differs from what caddy %s | grep %s prints; copy it:\n%s", b.where(), args, word, got)
			}
			checked++
		}
	}
	if checked == 0 {
		t.Fatal("no listing marked " + outputMarkerPrefix + "...: docs/operations.md shows what list-modules prints")
	}
}
