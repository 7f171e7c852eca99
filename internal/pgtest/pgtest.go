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

// binDir finds the server's programs: on the PATH, else Debian's
// /usr/lib/postgresql/<version>/bin.
func binDir() string {
	if p, err := exec.LookPath("initdb"); err == nil {
		if _, err := exec.LookPath("postgres"); err == nil {
			return filepath.Dir(p)
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

// Kill kills the server and every backend (SIGKILL to its process
// group), as a crash would; the data stays, and Restart recovers it.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	_ = s.cmd.Wait()
	s.cmd = nil
}

// Restart starts the server (again, after Kill) on the same port and data,
// and returns once it accepts connections.
func (s *Server) Restart() {
	s.t.Helper()
	s.cmd = exec.Command(filepath.Join(s.bin, "postgres"), "-D", s.dir, "-p", strconv.Itoa(s.Port),
		"-h", "127.0.0.1", "-k", filepath.Dir(s.dir), "-c", "fsync=off", "-c", "logging_collector=off")
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.cred}
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
			s.t.Fatalf("postgres on port %d was not ready within 30s", s.Port)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
