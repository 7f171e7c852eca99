package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/redistest"
)

// installRedis says how to get redis-server, which the targets keeping
// their limits in Redis need.
const installRedis = "apt-get install -y redis-server (Debian and Ubuntu), or brew install redis"

// redisReadyWithin bounds the start of redis-server.
const redisReadyWithin = 10 * time.Second

// redisServer is a redis-server of the harness's own: on a free loopback
// port, in a directory of its own, persistence off.
type redisServer struct {
	addr   string // 127.0.0.1:<port>
	log    string // its log file
	cmd    *exec.Cmd
	exited chan struct{} // closed once Wait returned
}

// startRedis starts a redis-server with its files in a new directory under
// dir and returns once it answers PING. Without redis-server on PATH, it
// fails saying how to install it.
func startRedis(ctx context.Context, dir string) (*redisServer, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server is not on PATH; install it: %s", installRedis)
	}
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	if dir, err = os.MkdirTemp(dir, "redis-"); err != nil {
		return nil, err
	}
	_, port, _ := net.SplitHostPort(addr)
	s := &redisServer{addr: addr, log: filepath.Join(dir, "redis.log"), exited: make(chan struct{})}
	s.cmd = exec.Command(bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", s.log)
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("redis-server: %w", err)
	}
	go func() {
		_ = s.cmd.Wait()
		close(s.exited)
	}()
	if err := s.waitReady(ctx); err != nil {
		s.stop()
		log, _ := os.ReadFile(s.log)
		return nil, fmt.Errorf("redis-server on %s: %w; its log:\n%s", addr, err, log)
	}
	return s, nil
}

// waitReady returns once the server answers PING.
func (s *redisServer) waitReady(ctx context.Context) error {
	deadline := time.Now().Add(redisReadyWithin)
	for {
		if reply, err := s.command("PING"); err == nil && reply == "+PONG" {
			return nil
		}
		select {
		case <-s.exited:
			return errors.New("exited before answering PING")
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("did not answer PING within %s", redisReadyWithin)
		}
	}
}

// stop kills the server and waits for it; its data is gone with it.
func (s *redisServer) stop() {
	_ = s.cmd.Process.Kill()
	<-s.exited
}

// command sends one inline command and returns its reply.
func (s *redisServer) command(args ...string) (string, error) { return redistest.Send(s.addr, args...) }

// commandsProcessed is the number of commands the server has processed,
// total_commands_processed in INFO stats.
func (s *redisServer) commandsProcessed() (int64, error) {
	info, err := s.command("INFO", "stats")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "total_commands_processed:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, errors.New("no total_commands_processed in INFO stats")
}
