package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// baselineTarget is (c) as built from rev, another git revision of the
// checkout: the same Caddyfile, served by that revision's cmd/caddy, taking
// turns with the other targets, so that two builds are compared in one
// sitting on one machine.
func baselineTarget(rev string) *target {
	t := *relayOne
	t.name = "(c0) relay, 1 channel, " + rev
	t.rev = rev
	return &t
}

// withBaseline returns ts with t after (c), or last when ts has no (c).
func withBaseline(ts []*target, t *target) []*target {
	out := make([]*target, 0, len(ts)+1)
	added := false
	for _, x := range ts {
		out = append(out, x)
		if x == relayOne {
			out, added = append(out, t), true
		}
	}
	if !added {
		out = append(out, t)
	}
	return out
}

// baselineOf returns the target of ts built from another revision, if any.
func baselineOf(ts []*target) *target {
	for _, t := range ts {
		if t.rev != "" {
			return t
		}
	}
	return nil
}

// buildRevision builds cmd/caddy as it is at rev, a git revision of the
// repository the harness runs in, into dir, and returns the binary's path.
// It writes rev's tree with git archive into a temporary directory (no
// worktree: the repository is not changed), builds there with the
// harness's environment (GOFLAGS included; GOWORK off, so that rev's own
// go.mod decides) and removes the tree.
func buildRevision(ctx context.Context, rev, dir string) (string, error) {
	src, err := os.MkdirTemp("", "relay-bench-baseline-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(src)
	if err := extractRevision(ctx, rev, src); err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "caddy-relay-baseline")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/caddy-relay/relay/cmd/caddy")
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "GOWORK=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/caddy of %s: %v\n%s", rev, err, out)
	}
	return bin, nil
}

// extractRevision writes the tree of rev into dst, an empty directory:
// git archive of the whole repository (whatever the working directory is
// in it), unpacked by tar.
func extractRevision(ctx context.Context, rev, dst string) error {
	if rev == "" || strings.HasPrefix(rev, "-") {
		return fmt.Errorf("%q is not a git revision", rev)
	}
	top, err := git(ctx, "", "rev-parse", "--show-toplevel")
	if err != nil {
		return err
	}
	commit, err := git(ctx, top, "rev-parse", "--verify", "--quiet", rev+"^{commit}")
	if err != nil {
		return fmt.Errorf("%s is not a commit of %s", rev, top)
	}
	tarball := filepath.Join(dst, ".tree.tar")
	if _, err := git(ctx, top, "archive", "--format=tar", "-o", tarball, commit); err != nil {
		return err
	}
	defer os.Remove(tarball)
	if out, err := exec.CommandContext(ctx, "tar", "-x", "-f", tarball, "-C", dst).CombinedOutput(); err != nil {
		return fmt.Errorf("tar -x: %v\n%s", err, out)
	}
	return nil
}

// git runs git with args in dir ("": the working directory) and returns
// its output, trimmed.
func git(ctx context.Context, dir string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return "", fmt.Errorf("git %s: %v\n%s", strings.Join(args, " "), err, exit.Stderr)
		}
		return "", fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
	}
	return strings.TrimSpace(string(out)), nil
}
