package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"
)

// target is one way to reach the upstream.
type target struct {
	name string
	// caddyfile is the config of its caddy process, with $PORT (the site's
	// port), $UPSTREAM, $DEAD and $REDIS (host:port) and $LEDGER (a file
	// in the run's temporary directory) to fill in, and for
	// the targets whose idle streams are measured over both HTTP/1.1 and
	// HTTP/2, $UPSTREAM_URL (with its scheme) and $UPSTREAM_TLS (the
	// transport block that trusts the upstream's self-signed certificate,
	// or nothing); empty for the direct target.
	caddyfile string
	// redis says that the caddyfile names $REDIS: the target needs the
	// redis-server the harness starts.
	redis bool
	// failsOver says that requests fail over: their replies carry
	// x-relay-attempts: 2, or none when the dead channel was still cooling
	// (for 1ns) as the request picked. Other targets' replies carry none.
	failsOver bool
	// idle says whether the idle-stream memory is measured.
	idle bool
	// fixedRate says whether the fixed-rate workload is measured.
	fixedRate bool
	// cpu says whether the CPU comparison workload is measured.
	cpu bool
	// onlyCPU says that the CPU comparison is the only workload measured.
	onlyCPU bool
	// ledger says that the caddyfile keeps a usage ledger in a SQLite file
	// at $LEDGER: its process gets an admin endpoint, and after the load
	// the harness checks that the ledger holds a row for every request it
	// sent (bench.checkLedger).
	ledger bool
	// header returns the headers of the load's seq-th request (from 0);
	// nil: requestHeader(), the same for every request.
	header func(seq uint64) http.Header
	// dedup says that header marks every request as an SDK's first
	// attempt, for the relay to record for its retries: after the warm-up
	// the harness checks that a retry of one is answered without the
	// upstream (bench.checkDedup), so that a row of the target did measure
	// dedup recording its requests.
	dedup bool
	// rev is the git revision whose cmd/caddy serves the target; "" for
	// the checkout's own (see baselineTarget).
	rev string
}

// runs reports whether t is measured under w: every target but those of
// the CPU comparison alone under the closed-loop and streaming workloads
// but the CPU comparison, some under the others.
func (t *target) runs(w workload) bool {
	switch {
	case w.cpu:
		return t.cpu
	case t.onlyCPU:
		return false
	case w.kind == fixedRate:
		return t.fixedRate
	case w.kind == idle:
		return t.idle
	}
	return true
}

// needRedis returns the targets of ts that need redis-server.
func needRedis(ts []*target) []*target {
	var need []*target
	for _, t := range ts {
		if t.redis {
			need = append(need, t)
		}
	}
	return need
}

// withoutRedis returns the targets of ts that do not need redis-server.
func withoutRedis(ts []*target) []*target {
	var without []*target
	for _, t := range ts {
		if !t.redis {
			without = append(without, t)
		}
	}
	return without
}

// globalOptions start every Caddyfile: no admin endpoint (readiness is the
// "serving initial configuration" log line) and no autosave.
const globalOptions = `{
	admin off
	persist_config off
}
`

// The targets, in the order they run and are listed.
var (
	direct = &target{name: "(a) direct"}

	reverseProxy = &target{name: "(b) reverse_proxy", idle: true, fixedRate: true, cpu: true, caddyfile: globalOptions + `
:$PORT {
	reverse_proxy $UPSTREAM_URL {
		$UPSTREAM_TLS
	}
}
`}

	relayOne = &target{name: "(c) relay, 1 channel", idle: true, fixedRate: true, cpu: true, caddyfile: globalOptions + `
:$PORT {
	relay {
		key sk-bench bench
		channel upstream {
			url $UPSTREAM_URL
			api_key sk-upstream
			$UPSTREAM_TLS
		}
		group bench {
			channels upstream
		}
	}
}
`}

	relayTiers = &target{name: "(d) relay, 3 channels in 2 tiers", caddyfile: globalOptions + `
:$PORT {
	relay {
		key sk-bench bench
		channel first {
			url http://$UPSTREAM
			api_key sk-upstream
			priority 1
		}
		channel second {
			url http://$UPSTREAM
			api_key sk-upstream
			priority 1
		}
		channel fallback {
			url http://$UPSTREAM
			api_key sk-upstream
			priority 2
		}
		group bench {
			channels first second fallback
		}
	}
}
`}

	// relayFailover's first choice refuses connections and is never left
	// cooling nor broken open, so every request tries it, then fails over.
	// The retry budget allows a retry per request.
	relayFailover = &target{name: "(e) relay, failover", failsOver: true, caddyfile: globalOptions + `
:$PORT {
	relay {
		key sk-bench bench
		channel dead {
			url http://$DEAD
			api_key sk-upstream
			priority 1
			cooldown 1ns
			max_cooldown 1ns
			breaker {
				min_requests 1000000000
			}
		}
		channel good {
			url http://$UPSTREAM
			api_key sk-upstream
			priority 2
		}
		group bench {
			channels dead good
			retries 1
			retry_budget 100% 1000000/s
		}
	}
}
`}

	// relayKeyLimits is (c) with every limit a key can have, set so high
	// that none refuses at the harness's load: each request still takes a
	// concurrency slot, a request from the rate's bucket and its estimated
	// tokens from the token bucket, and gives back the slot and corrects the
	// tokens when it ends.
	relayKeyLimits = &target{name: "(f) relay, key limits", fixedRate: true, caddyfile: globalOptions + `
:$PORT {
	relay {
		key sk-bench bench {
			rate 1000000/s
			tokens 1000000000/s
			concurrency 100000
		}
		channel upstream {
			url http://$UPSTREAM
			api_key sk-upstream
		}
		group bench {
			channels upstream
		}
	}
}
`}

	// relayRedis is (f) with its key's limits kept in Redis, as a fleet
	// keeps them: each admission is a script in Redis, each release is
	// given back to it. With on_error deny, a request that Redis does not
	// admit in time fails instead of being admitted on local limits, so a
	// row of 100% success was all measured through Redis.
	relayRedis = &target{name: "(g) relay, key limits in Redis", redis: true, fixedRate: true,
		caddyfile: strings.Replace(relayKeyLimits.caddyfile, "\t\tgroup bench {", `		storage redis {
			address $REDIS
			prefix bench:
			on_error deny
		}
		group bench {`, 1)}

	// relayFeatures is (c) with what a relay serving people turns on: each
	// request is served as the identity it carries (as an authentication
	// handler before the relay would establish it), every identity under
	// `user *` with a daily budget of its own and the group with one
	// (each request holds its worst case against both and is charged its
	// cost), and every request is marked as an SDK's first attempt, so
	// that dedup records it for its retries (none come). The budgets are
	// far from being spent. There is no key: a request that the relay did
	// not serve as its identity fails (401).
	relayFeatures = &target{name: "(h) relay, budgets, identity and dedup headers", cpu: true, header: featuresHeader, dedup: true,
		caddyfile: globalOptions + `
:$PORT {
	relay {
		identity {http.request.header.X-Bench-User}
		user * bench {
			budget 1000000usd/day
		}
		channel upstream {
			url http://$UPSTREAM
			api_key sk-upstream
		}
		group bench {
			channels upstream
			budget 1000000usd/day
		}
	}
}
`}

	// relayLedger is (c) with a usage ledger in a SQLite file: each
	// request hands its row to the ledger's queue, and the ledger's writer
	// writes the rows to the file in batches, in the same process, so its
	// CPU counts in the row. Measured in the CPU comparison alone, against
	// (c); after the load the harness reads GET /relay/usage from the
	// process's admin endpoint and fails unless every request it sent has
	// its row.
	relayLedger = &target{name: "(i) relay, 1 channel, ledger", cpu: true, onlyCPU: true, ledger: true,
		caddyfile: strings.Replace(relayOne.caddyfile, "\t\tkey sk-bench bench\n", "\t\tledger sqlite $LEDGER\n\t\tkey sk-bench bench\n", 1)}

	targets = []*target{direct, reverseProxy, relayOne, relayTiers, relayFailover, relayKeyLimits, relayRedis, relayFeatures, relayLedger}
)

// benchIdentities is how many identities the load of relayFeatures takes
// turns with: each has its own state (limits, budget, spend account) in
// the relay, as the people behind one relay do.
const benchIdentities = 1000

// featuresHeader is the headers of relayFeatures' seq-th request: those of
// every request, an identity (one of benchIdentities, in turn), and
// x-stainless-retry-count: 0, which the Anthropic SDKs send on a first
// attempt. A first attempt is never answered from another request, so
// dedup records every request (by its identity and body: as many entries
// as identities, far below the dedup table's bound) and answers none.
//
// The identity comes from a request header that the client sets, which
// the relay warns about when the config loads: in production an
// authentication handler sets it, whose cost is Caddy's and would be paid
// in front of reverse_proxy too.
func featuresHeader(seq uint64) http.Header {
	h := requestHeader()
	h["X-Bench-User"] = []string{"user-" + strconv.FormatUint(seq%benchIdentities, 10) + "@bench.example"}
	h["X-Stainless-Retry-Count"] = []string{"0"}
	return h
}

// startTimeout bounds a caddy process's start, a big config's included.
const startTimeout = time.Minute

// readyLine is what Caddy logs once it serves the config it was started with.
const readyLine = "serving initial configuration"

// caddyProcess is a running `caddy run`.
type caddyProcess struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed once Wait returned
}

// startCaddy writes config to a file in dir, runs caddy with it and returns
// once Caddy serves it.
func startCaddy(ctx context.Context, bin, dir, config string) (*caddyProcess, error) {
	f, err := os.CreateTemp(dir, "*.Caddyfile")
	if err != nil {
		return nil, err
	}
	if _, err := f.WriteString(config); err != nil {
		f.Close()
		return nil, err
	}
	if err := f.Close(); err != nil {
		return nil, err
	}
	return startCaddyArgs(ctx, bin, dir, "run", "--adapter", "caddyfile", "--config", f.Name())
}

// startCaddyArgs runs caddy with args and returns once Caddy serves its
// config.
func startCaddyArgs(ctx context.Context, bin, dir string, args ...string) (*caddyProcess, error) {
	startup := &startupLog{ready: make(chan struct{})}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "XDG_CONFIG_HOME="+dir, "XDG_DATA_HOME="+dir)
	cmd.Stderr = startup
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &caddyProcess{cmd: cmd, exited: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.exited)
	}()
	timeout := time.NewTimer(startTimeout)
	defer timeout.Stop()
	var err error
	select {
	case <-startup.ready:
		return p, nil
	case <-p.exited:
		err = errors.New("caddy exited before serving")
	case <-timeout.C:
		err = fmt.Errorf("caddy did not serve within %s", startTimeout)
	case <-ctx.Done():
		err = ctx.Err()
	}
	p.stop()
	return nil, fmt.Errorf("%w; its log:\n%s", err, startup.String())
}

// stop kills the process and waits for it; on the direct target's nil
// process it does nothing.
func (p *caddyProcess) stop() {
	if p == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.exited
}

// rssKiB is the process's resident memory, VmRSS in /proc/<pid>/status.
func (p *caddyProcess) rssKiB() (int64, error) {
	status, err := os.ReadFile("/proc/" + strconv.Itoa(p.cmd.Process.Pid) + "/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, errors.New("no VmRSS in /proc/<pid>/status")
}

// startupLog is caddy's stderr: it keeps the log until Caddy reports that it
// serves its config, then discards everything (the relay logs a line per
// request).
type startupLog struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	ready chan struct{} // closed at readyLine
}

// Write implements io.Writer.
func (l *startupLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	select {
	case <-l.ready:
	default:
		l.buf.Write(p)
		if bytes.Contains(l.buf.Bytes(), []byte(readyLine)) {
			close(l.ready)
		}
	}
	return len(p), nil
}

// String returns the log kept so far.
func (l *startupLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}
