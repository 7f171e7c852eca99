package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// idlePing is how often the idle upstream pings: rarely enough that the
// held streams cost memory and nothing else.
const idlePing = 30 * time.Second

// upstreamKeys are the credentials the fake upstreams take (they refuse
// what Anthropic's API refuses, a wrong key included): the relay targets'
// channel key, and the load's own key, which targets (a) and (b) send on as
// the client sent it.
var upstreamKeys = fakeupstream.AcceptKeys("sk-upstream", "sk-bench")

// bench is what every measurement of a run shares.
type bench struct {
	options
	dir           string // temporary: the caddy binary and the Caddyfiles
	caddy         string // the binary built from ./cmd/caddy
	fast          *fakeupstream.Upstream
	fastHits      atomic.Int64           // the requests fast answered
	idle          *fakeupstream.Upstream // HTTP/1.1
	idleH2        *fakeupstream.Upstream // HTTP/2 over TLS
	deadAddr      string                 // a loopback address that refuses connections
	redis         *redisServer           // for the targets that need it; nil if none does
	baselineCaddy string                 // built from ./cmd/caddy at options.baseline, for its target
}

// run measures every target with every workload it applies to. A request
// that failed does not stop the run: it shows in the report's success
// ratios (see report.failures).
func run(ctx context.Context, o options) (*report, error) {
	if err := raiseFileLimit(); err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "relay-bench-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if room := maxIdleStreams(); o.idleStreams > room && !o.cpuOnly {
		o.logf("the open-file limit leaves room for %d idle streams, not %d: measuring %d", room, o.idleStreams, room)
		o.idleStreams = room
	}
	if o.baseline != "" {
		o.targets = withBaseline(o.targets, baselineTarget(o.baseline))
	}
	if o.idleOnly {
		o.targets = slices.DeleteFunc(slices.Clone(o.targets), func(t *target) bool { return !t.idle })
	}
	if o.cpuOnly {
		o.targets = slices.DeleteFunc(slices.Clone(o.targets), func(t *target) bool { return !t.cpu })
	}
	b := &bench{options: o, dir: dir}
	// first, so that a missing redis-server fails the run at once
	if need := needRedis(o.targets); len(need) > 0 {
		o.logf("starting redis-server")
		if b.redis, err = startRedis(ctx, dir); err != nil {
			return nil, fmt.Errorf("%s: %w", targetNames(need), err)
		}
		defer b.redis.stop()
	}
	o.logf("building ./cmd/caddy")
	if b.caddy, err = buildCaddy(ctx, dir); err != nil {
		return nil, err
	}
	switch {
	case o.baseline == "":
	case o.baselineFromCheckout:
		b.baselineCaddy = b.caddy
	default:
		o.logf("building ./cmd/caddy of %s", o.baseline)
		if b.baselineCaddy, err = buildRevision(ctx, o.baseline, dir); err != nil {
			return nil, err
		}
	}
	var releaseDead func()
	if b.deadAddr, releaseDead, err = deadAddr(); err != nil {
		return nil, err
	}
	defer releaseDead()
	fast := fakeupstream.Fast()
	b.fast = fakeupstream.Start(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.fastHits.Add(1)
		fast(w, r)
	}), false, upstreamKeys)
	defer b.fast.Close()
	b.idle = fakeupstream.Start(fakeupstream.Idle(idlePing), false, upstreamKeys)
	defer b.idle.Close()
	b.idleH2 = fakeupstream.StartTLS(fakeupstream.Idle(idlePing), false, upstreamKeys)
	defer b.idleH2.Close()

	rep := &report{machine: describeMachine(), options: o}
	if !o.idleOnly {
		rows, err := b.measureLoad(ctx)
		if err != nil {
			return nil, err
		}
		rep.rows = rows
		b.logRedis()
	}
	for _, w := range o.workloads() {
		if w.kind != idle {
			continue
		}
		for _, t := range o.targets {
			if !t.idle {
				continue
			}
			r, err := b.measureIdle(ctx, t, w)
			if err != nil {
				return nil, fmt.Errorf("%s, %s: %w", t.name, w, err)
			}
			rep.rows = append(rep.rows, r)
		}
	}
	return rep, nil
}

// measureLoad serves every target in front of the fast upstream at once,
// each in its own caddy process (idle ones cost no CPU), and measures each
// workload in rounds, the targets it applies to taking turns in an order
// that rotates every round: on a shared machine, a slow minute then weighs
// on every target alike instead of on whichever ran during it. A row holds
// the medians of its rounds.
func (b *bench) measureLoad(ctx context.Context) ([]row, error) {
	urls := make(map[*target]string, len(b.targets))
	procs := make(map[*target]*caddyProcess, len(b.targets))
	admins := make(map[*target]string, len(b.targets)) // with -profile, or a ledger: the process's admin endpoint
	sent := make(map[*target]int64, len(b.targets))    // the requests each target was sent
	for _, t := range b.targets {
		served := t
		if (b.profileDir != "" || t.ledger) && t.caddyfile != "" {
			addr, err := freeAddr()
			if err != nil {
				return nil, err
			}
			copied := *t
			copied.caddyfile = strings.Replace(t.caddyfile, "admin off", "admin "+addr, 1)
			served, admins[t] = &copied, addr
		}
		url, proc, err := b.serve(ctx, served, b.fast)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", t.name, err)
		}
		if proc != nil {
			defer proc.stop()
		}
		urls[t], procs[t] = url, proc
		b.logf("%s: warm-up", t.name)
		sent[t] += attack(ctx, t, url, workload{kind: nonStreaming, concurrency: b.warmUpConcurrency()}, b.duration/10).requests
		if t.dedup {
			if err := b.checkDedup(ctx, t, url); err != nil {
				return nil, fmt.Errorf("%s: %w", t.name, err)
			}
		}
	}
	var rows []row
	for _, w := range b.workloads() {
		if w.kind == idle {
			continue
		}
		ts := b.targetsOf(w)
		rounds := make([][]row, len(ts))
		n, d := b.roundsOf(w)
		for round := 0; round < n; round++ {
			for k := range ts {
				i := (k + round) % len(ts)
				b.logf("%s: %s, round %d of %d", ts[i].name, w, round+1, n)
				// with -profile, the last round of the CPU comparison is
				// profiled too (CPU for the round, then allocations)
				var prof *cpuProfile
				if addr := admins[ts[i]]; addr != "" && b.profileDir != "" && w.cpu && round == n-1 {
					prof = startCPUProfile(ctx, addr, d)
				}
				r, err := measureRound(ctx, ts[i], urls[ts[i]], procs[ts[i]], w, d)
				if err != nil {
					return nil, fmt.Errorf("%s, %s: %w", ts[i].name, w, err)
				}
				if prof != nil {
					if err := prof.save(ctx, filepath.Join(b.profileDir, profileName(ts[i]))); err != nil {
						return nil, fmt.Errorf("%s: profile: %w", ts[i].name, err)
					}
				}
				if r.cpuPerReq > 0 {
					b.logf("%s: %s, round %d: %.0f req/s, %s CPU a request", ts[i].name, w, round+1, r.reqPerSec, micros(r.cpuPerReq))
				}
				rounds[i] = append(rounds[i], r)
				sent[ts[i]] += r.requests
				if err := ctx.Err(); err != nil {
					return nil, err
				}
			}
		}
		for i := range ts {
			rows = append(rows, median(rounds[i]))
		}
	}
	for _, t := range b.targets {
		if t.ledger {
			if err := b.checkLedger(ctx, t, admins[t], sent[t]); err != nil {
				return nil, fmt.Errorf("%s: %w", t.name, err)
			}
			perRow, err := ledgerWriterCPU(ctx, admins[t])
			if err != nil {
				return nil, fmt.Errorf("%s: %w", t.name, err)
			}
			for i := range rows {
				if rows[i].target == t && rows[i].workload == b.cpuWorkload() {
					rows[i].ledgerPerRow = perRow
				}
			}
			b.logf("%s: the ledger's writer spent %s of CPU a row", t.name, perRow)
		}
	}
	return rows, nil
}

// measureRound measures one round of w against t, served by proc (nil for
// the direct target), for d: what attack measures, and the CPU time proc
// used in the round divided by the requests answered in it. Between rounds
// proc serves nothing, so the CPU it used in the round is the round's.
func measureRound(ctx context.Context, t *target, url string, proc *caddyProcess, w workload, d time.Duration) (row, error) {
	if proc == nil {
		return attack(ctx, t, url, w, d), nil
	}
	before, err := proc.cpuTime()
	if err != nil {
		return row{}, err
	}
	r := attack(ctx, t, url, w, d)
	after, err := proc.cpuTime()
	if err != nil {
		return row{}, err
	}
	if r.requests > 0 {
		r.cpuPerReq = (after - before) / time.Duration(r.requests)
	}
	return r, nil
}

// checkDedup sends a retry (x-stainless-retry-count: 1) of the first
// request of t's warm-up, which the relay recorded as a first attempt, and
// fails unless the reply is whole and no upstream was asked for it: the
// relay answered it from the recorded answer. Nothing else runs meanwhile,
// so the fast upstream's count moves only for this request.
func (b *bench) checkDedup(ctx context.Context, t *target, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(messageBody(false)))
	if err != nil {
		return err
	}
	req.Header = t.header(0)
	req.Header.Set("X-Stainless-Retry-Count", "1")
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	hits := b.fastHits.Load()
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK || !bytes.Contains(body, messageEnd) {
		return fmt.Errorf("a retry of a recorded request: status %d, %q", resp.StatusCode, body)
	}
	if n := b.fastHits.Load() - hits; n != 0 {
		return fmt.Errorf("a retry of a recorded request reached the upstream (%d requests): the relay did not record the load's requests for dedup", n)
	}
	b.logf("%s: a retry of the warm-up's first request was answered without the upstream: dedup records the load's requests", t.name)
	return nil
}

// warmUpConcurrency is the highest concurrency of the run's closed-loop
// non-streaming workloads: the warm-up opens as many connections as any
// of them will.
func (o options) warmUpConcurrency() int {
	c := 1
	for _, w := range o.workloads() {
		if w.kind == nonStreaming {
			c = max(c, w.concurrency)
		}
	}
	return c
}

// targetsOf returns the targets of the run that w applies to, in order.
func (b *bench) targetsOf(w workload) []*target {
	var ts []*target
	for _, t := range b.targets {
		if t.runs(w) {
			ts = append(ts, t)
		}
	}
	return ts
}

// logRedis logs how many commands the redis-server processed, if the run
// started one: a sign that the targets using it did.
func (b *bench) logRedis() {
	if b.redis == nil {
		return
	}
	n, err := b.redis.commandsProcessed()
	if err != nil {
		b.logf("redis-server: %v", err)
		return
	}
	b.logf("redis-server processed %d commands", n)
}

// median merges the rounds of one target and workload: the median of each
// measure (of an even number of rounds, the mean of the middle two), every
// error, the worst success ratio, the requests of all rounds.
func median(rounds []row) row {
	m := rounds[0]
	pick := func(get func(row) float64) float64 {
		v := make([]float64, len(rounds))
		for i, r := range rounds {
			v[i] = get(r)
		}
		slices.Sort(v)
		if n := len(v); n%2 == 0 {
			return (v[n/2-1] + v[n/2]) / 2
		}
		return v[len(v)/2]
	}
	m.reqPerSec = pick(func(r row) float64 { return r.reqPerSec })
	m.p50 = time.Duration(pick(func(r row) float64 { return float64(r.p50) }))
	m.p99 = time.Duration(pick(func(r row) float64 { return float64(r.p99) }))
	m.firstByte = time.Duration(pick(func(r row) float64 { return float64(r.firstByte) }))
	m.failedOver = pick(func(r row) float64 { return r.failedOver })
	m.cpuPerReq = time.Duration(pick(func(r row) float64 { return float64(r.cpuPerReq) }))
	for _, r := range rounds[1:] {
		m.requests += r.requests
		m.success = min(m.success, r.success)
		m.errors = append(m.errors, r.errors...)
	}
	slices.Sort(m.errors)
	m.errors = slices.Compact(m.errors)
	return m
}

// measureIdle opens the idle streams of w through t and reports the caddy
// process's resident memory per stream, and how many upstream connections
// the streams hold open: one a stream over HTTP/1.1, a few in all over
// HTTP/2 (where the log also says how many the upstream accepted: clients
// that dial at once for a new host keep one connection and close the rest).
func (b *bench) measureIdle(ctx context.Context, t *target, w workload) (row, error) {
	b.logf("%s: %s", t.name, w)
	up, profile := b.idle, profileName(t)
	if w.h2 {
		up, profile = b.idleH2, profile+"-h2"
	}
	var adminAddr string
	tt := t
	if b.profileDir != "" {
		var err error
		if adminAddr, err = freeAddr(); err != nil {
			return row{}, err
		}
		copied := *t
		copied.caddyfile = strings.Replace(t.caddyfile, "admin off", "admin "+adminAddr, 1)
		tt = &copied
	}
	url, proc, err := b.serve(ctx, tt, up)
	if err != nil {
		return row{}, err
	}
	defer proc.stop()
	before, err := proc.rssKiB()
	if err != nil {
		return row{}, err
	}
	accepted, open := up.Conns(), up.OpenConns()
	held := openIdleStreams(ctx, url, w.concurrency)
	defer held.close()
	after, err := proc.rssKiB()
	if err != nil {
		return row{}, err
	}
	if adminAddr != "" {
		if err := saveProfiles(ctx, adminAddr, filepath.Join(b.profileDir, profile)); err != nil {
			return row{}, err
		}
	}
	r := row{target: t, workload: w, success: float64(held.opened()) / float64(w.concurrency), upstreamConns: up.OpenConns() - open}
	b.logf("%s: %s: %d held open over %d upstream connections (%d accepted)", t.name, w, held.opened(), r.upstreamConns, up.Conns()-accepted)
	if n := held.opened(); n > 0 {
		r.kibPerStream = float64(after-before) / float64(n)
	}
	if held.err != nil {
		r.errors = []string{held.err.Error()}
	}
	return r, ctx.Err()
}

// serve starts a caddy process serving t in front of up and returns the
// URL of its messages endpoint; the direct target is up itself, with no
// process. Over TLS (up's self-signed certificate), the Caddyfile's
// transport skips verifying the upstream's certificate.
func (b *bench) serve(ctx context.Context, t *target, up *fakeupstream.Upstream) (string, *caddyProcess, error) {
	upAddr := up.Listener.Addr().String()
	upURL, upTLS := "http://"+upAddr, ""
	if up.TLS != nil {
		upURL, upTLS = "https://"+upAddr, "transport http {\n\t\t\ttls_insecure_skip_verify\n\t\t}"
	}
	if t.caddyfile == "" {
		return "http://" + upAddr + messagesPath, nil, nil
	}
	addr, err := freeAddr()
	if err != nil {
		return "", nil, err
	}
	_, port, _ := net.SplitHostPort(addr)
	var redisAddr string
	if b.redis != nil {
		redisAddr = b.redis.addr
	}
	// $UPSTREAM_URL and $UPSTREAM_TLS first: $UPSTREAM is a prefix of both
	cfg := strings.NewReplacer("$UPSTREAM_URL", upURL, "$UPSTREAM_TLS", upTLS, "$PORT", port, "$UPSTREAM", upAddr, "$DEAD", b.deadAddr, "$REDIS", redisAddr,
		"$LEDGER", filepath.Join(b.dir, profileName(t)+"-ledger.db")).Replace(t.caddyfile)
	bin := b.caddy
	if t.rev != "" {
		bin = b.baselineCaddy
	}
	proc, err := startCaddy(ctx, bin, b.dir, cfg)
	if err != nil {
		return "", nil, err
	}
	return "http://127.0.0.1:" + port + messagesPath, proc, nil
}

// targetNames joins the names of ts.
func targetNames(ts []*target) string {
	names := make([]string, len(ts))
	for i, t := range ts {
		names[i] = t.name
	}
	return strings.Join(names, ", ")
}

// buildCaddy builds ./cmd/caddy, the binary README.md tells users to run,
// into dir.
func buildCaddy(ctx context.Context, dir string) (string, error) {
	// not dir/caddy: that is where Caddy keeps its data (XDG_DATA_HOME)
	bin := filepath.Join(dir, "caddy-relay")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/caddy-relay/relay/cmd/caddy").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/caddy: %v\n%s", err, out)
	}
	return bin, nil
}

// buildInTemp makes a temporary directory and builds ./cmd/caddy into it;
// the caller removes dir when done (also when err is set and dir is not
// empty).
func buildInTemp(ctx context.Context, logf func(string, ...any)) (dir, bin string, err error) {
	if dir, err = os.MkdirTemp("", "relay-bench-"); err != nil {
		return "", "", err
	}
	logf("building ./cmd/caddy")
	bin, err = buildCaddy(ctx, dir)
	return dir, bin, err
}

// freeAddr returns a loopback address nothing listens on: free for a caddy
// site.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	return "127.0.0.1:" + port, nil
}

// wantFiles is the open-file limit the harness asks for: 10,000 idle
// streams hold two sockets each in caddy (client and upstream) and two
// here (the client's end and the in-process upstream's).
const wantFiles = 1 << 16

// raiseFileLimit lifts the open-file limit, which the caddy processes
// inherit: the hard limit to wantFiles where the process may (root may
// raise it, up to fs.nr_open), then the soft limit to the hard one.
// maxIdleStreams says how many idle streams the limit leaves room for.
func raiseFileLimit() error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	if lim.Max < wantFiles {
		raised := syscall.Rlimit{Cur: wantFiles, Max: wantFiles}
		if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &raised) == nil {
			return nil
		}
	}
	lim.Cur = lim.Max
	return syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
}

// maxIdleStreams is how many idle streams the open-file limit leaves room
// for, with a margin for everything else the processes hold open: where the
// hard limit is 20,000 and cannot be raised (no CAP_SYS_RESOURCE), 9,900.
func maxIdleStreams() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0
	}
	return max(0, (int(lim.Cur)-200)/2)
}

// describeMachine names the CPU, the cores, Go and the date.
func describeMachine() string {
	cpu := "unknown CPU"
	if info, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, line := range strings.Split(string(info), "\n") {
			if name, ok := strings.CutPrefix(line, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(name), ":"))
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d cores, %s %s/%s, %s", cpu, runtime.NumCPU(), runtime.Version(),
		runtime.GOOS, runtime.GOARCH, time.Now().UTC().Format("2006-01-02"))
}
