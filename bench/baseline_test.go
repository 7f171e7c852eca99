package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestExtractRevision writes the tree of HEAD into a directory, as
// -baseline does before it builds there: the whole repository, though the
// test runs in bench/. A revision that is no commit fails.
func TestExtractRevision(t *testing.T) {
	if err := exec.Command("git", "rev-parse", "--show-toplevel").Run(); err != nil {
		t.Skipf("not in a git checkout (or no git): %v", err)
	}
	ctx := context.Background()
	dst := t.TempDir()
	if err := extractRevision(ctx, "HEAD", dst); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"go.mod", "cmd/caddy/main.go", "bench/main.go"} {
		if _, err := os.Stat(filepath.Join(dst, f)); err != nil {
			t.Errorf("the tree of HEAD has no %s: %v", f, err)
		}
	}
	if _, err := os.Stat(filepath.Join(dst, ".tree.tar")); !os.IsNotExist(err) {
		t.Errorf("the archive was left in the tree: %v", err)
	}
	for _, rev := range []string{"no-such-revision-anywhere", "-h", ""} {
		if err := extractRevision(ctx, rev, t.TempDir()); err == nil {
			t.Errorf("%q: extracted, want an error", rev)
		}
	}
}
