// Package pgtest runs a real PostgreSQL server for tests: initdb in a
// temporary directory, postgres on a free loopback port, killed (its whole
// process group) when the test ends. Tests that need it fail under CI=true
// when the server is missing, and skip elsewhere with a message saying how
// to install it.
package pgtest

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Install says how to get the server.
const Install = "apt-get install -y postgresql (Debian and Ubuntu), or brew install postgresql"

// Server is a running postgres.
type Server struct {
	Port int
	dir  string // data directory
	bin  string // the directory of initdb, postgres, pg_isready
	cred *syscall.Credential
	t    testing.TB
	cmd  *exec.Cmd
}

// DSN is the server's connection string (trust authentication, user
// postgres, database postgres).
func (s *Server) DSN() string {
	return fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=postgres sslmode=disable connect_timeout=2", s.Port)
}

// binDir finds the server's programs: where the postgres on the PATH
// really is (a link on the PATH may stand for it alone), else Debian's
// /usr/lib/postgresql/<version>/bin.
func binDir() string {
	if p, err := exec.LookPath("postgres"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			if _, err := os.Stat(filepath.Join(filepath.Dir(real), "pg_isready")); err == nil {
				return filepath.Dir(real)
			}
		}
	}
	found, _ := filepath.Glob("/usr/lib/postgresql/*/bin/postgres")
	if len(found) == 0 {
		return ""
	}
	return filepath.Dir(found[len(found)-1])
}

// Start makes a database cluster and starts its server for the test.
func Start(t testing.TB) *Server {
	t.Helper()
	bin := binDir()
	if bin == "" {
		if os.Getenv("CI") == "true" {
			t.Fatalf("postgres is not installed (CI must have it): %s", Install)
		}
		t.Skipf("postgres is not installed; to run this test: %s", Install)
	}
	root, err := os.MkdirTemp("", "pgtest")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(root) })
	s := &Server{dir: filepath.Join(root, "data"), bin: bin, t: t}
	// postgres refuses to run as root: as root, run it as the postgres user
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("running as root, the tests run postgres as the user postgres, which does not exist: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chmod(root, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(root, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	s.run(filepath.Join(bin, "initdb"), "-D", s.dir, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Port = l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	s.Restart()
	t.Cleanup(s.Kill)
	return s
}

func (s *Server) run(name string, args ...string) {
	s.t.Helper()
	cmd := exec.Command(name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	if out, err := cmd.CombinedOutput(); err != nil {
		s.t.Fatalf("%s: %v\n%s", filepath.Base(name), err, out)
	}
}

// Kill kills the server and every backend (SIGKILL), as a crash would;
// the data stays, and Restart recovers it. Backends are in sessions of
// their own, so they are found by their parent: the postmaster is frozen
// first, so that it forks none meanwhile.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	pid := s.cmd.Process.Pid
	_ = syscall.Kill(pid, syscall.SIGSTOP)
	children := childrenOf(pid)
	for _, c := range children {
		_ = syscall.Kill(c, syscall.SIGKILL)
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	_ = s.cmd.Wait()
	s.cmd = nil
	// they hold the shared memory a restart needs until they are gone
	for _, c := range children {
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			if syscall.Kill(c, 0) == syscall.ESRCH {
				break
			}
		}
	}
}

// childrenOf lists the processes whose parent is pid, from /proc.
func childrenOf(pid int) []int {
	var out []int
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so read after its ')'
		rest := string(b[strings.LastIndexByte(string(b), ')')+1:])
		fields := strings.Fields(rest)
		if len(fields) > 1 && fields[1] == strconv.Itoa(pid) {
			c, _ := strconv.Atoi(filepath.Base(filepath.Dir(f)))
			out = append(out, c)
		}
	}
	return out
}

// Restart starts the server (again, after Kill) on the same port and data,
// and returns once it accepts connections.
func (s *Server) Restart() {
	s.t.Helper()
	s.cmd = exec.Command(filepath.Join(s.bin, "postgres"), "-D", s.dir, "-p", strconv.Itoa(s.Port),
		"-h", "127.0.0.1", "-k", filepath.Dir(s.dir), "-c", "fsync=off", "-c", "logging_collector=off")
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
	logFile := filepath.Join(filepath.Dir(s.dir), "postgres.log")
	log, err := os.OpenFile(logFile, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		s.t.Fatal(err)
	}
	defer log.Close()
	s.cmd.Stdout, s.cmd.Stderr = log, log
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("postgres: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ready := exec.Command(filepath.Join(s.bin, "pg_isready"), "-q", "-h", "127.0.0.1", "-p", strconv.Itoa(s.Port))
		if ready.Run() == nil {
			return
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(logFile)
			s.t.Fatalf("postgres on port %d was not ready within 30s; its log:\n%s", s.Port, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
