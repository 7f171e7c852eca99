// Package redistest runs a real redis-server for tests: on a free loopback
// port, persistence off, killed by PID when the test ends. Tests that need
// it fail under CI=true when redis-server is missing, and skip elsewhere
// with a message saying how to install it.
package redistest

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Install says how to get redis-server.
const Install = "apt-get install -y redis-server (Debian and Ubuntu), or brew install redis"

// Server is a running redis-server.
type Server struct {
	Addr    string // 127.0.0.1:<port>
	bin     string
	t       testing.TB
	cmd     *exec.Cmd
	cluster bool
}

// Start starts a redis-server for the test.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server is not installed (CI must have it): %s", Install)
		}
		t.Skipf("redis-server is not installed; to run this test: %s", Install)
	}
	s := &Server{Addr: freeAddr(t), bin: bin, t: t}
	s.Restart()
	t.Cleanup(s.Kill)
	return s
}

// StartCluster starts a redis-server for the test as a Redis Cluster of
// one node that holds every slot: a client sees a cluster (a script may
// not touch keys of two slots), on one process.
func StartCluster(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server is not installed (CI must have it): %s", Install)
		}
		t.Skipf("redis-server is not installed; to run this test: %s", Install)
	}
	s := &Server{Addr: freeAddr(t), bin: bin, t: t, cluster: true}
	s.Restart()
	t.Cleanup(s.Kill)
	if reply, err := s.Command("CLUSTER", "ADDSLOTSRANGE", "0", "16383"); err != nil || reply != "+OK" {
		t.Fatalf("CLUSTER ADDSLOTSRANGE: %q %v", reply, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if info, err := s.Command("CLUSTER", "INFO"); err == nil && strings.Contains(info, "cluster_state:ok") {
			return s
		}
		if time.Now().After(deadline) {
			t.Fatalf("the cluster on %s did not come up within 10s", s.Addr)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Kill kills the server (SIGKILL), as a crash would; its data is gone.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.cmd = nil
}

// Restart starts the server again on the same port (after Kill), empty,
// and returns once it accepts commands.
func (s *Server) Restart() {
	s.t.Helper()
	_, port, _ := net.SplitHostPort(s.Addr)
	dir := s.t.TempDir()
	args := []string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--enable-debug-command", "local"}
	if s.cluster {
		args = append(args, "--cluster-enabled", "yes", "--cluster-config-file", dir+"/nodes.conf")
	}
	s.cmd = exec.Command(s.bin, args...)
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		s.t.Fatalf("redis-server: %v", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if reply, err := s.Command("PING"); err == nil && reply == "+PONG" {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("redis-server on %s did not answer PING within 10s", s.Addr)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Stop freezes the server (SIGSTOP): connections stay open and nothing
// answers, as in a network partition. Continue ends it.
func (s *Server) Stop() { _ = s.cmd.Process.Signal(syscall.SIGSTOP) }

// Continue thaws a server Stop froze.
func (s *Server) Continue() { _ = s.cmd.Process.Signal(syscall.SIGCONT) }

// Command sends one inline command to the server, as Send does.
func (s *Server) Command(args ...string) (string, error) { return Send(s.Addr, args...) }

// Send sends one inline command to the Redis at addr and returns its
// reply: the first line (such as +PONG or :3), or for a bulk string the
// string itself. It is for checks that need no client, in tests and in the
// benchmark harness.
func Send(addr string, args ...string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := fmt.Fprintf(c, "%s\r\n", strings.Join(args, " ")); err != nil {
		return "", err
	}
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	line = strings.TrimRight(line, "\r\n")
	n, isBulk := strings.CutPrefix(line, "$")
	size, convErr := strconv.Atoi(n)
	if err != nil || !isBulk || convErr != nil || size < 0 {
		return line, err
	}
	bulk := make([]byte, size)
	_, err = io.ReadFull(r, bulk)
	return string(bulk), err
}

func freeAddr(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
