// Command bench measures what the relay costs next to a plain Caddy
// reverse_proxy to the same upstream, in one run on one machine, and prints
// the result as a markdown table.
//
// Run it from the repository root; the full run takes about eleven minutes
// (36 measured runs of 5s in each of 3 rounds, 4 of 3s in each of 8
// rounds, then the idle streams):
//
//	go run ./bench                 # the full run, table on stdout
//	go run ./bench -out bench.md   # the table also written to bench.md
//	go run ./bench -smoke          # a few seconds: short runs, few streams
//	go run ./bench -idle-only      # only the idle streams of (b) and (c)
//	go run ./bench -cpu-only       # only the CPU comparison (about two and a half minutes)
//	go run ./bench -cpu-only -baseline 2f0c701   # and the relay as built at 2f0c701
//	go run ./bench -reload 60s     # only the reload under load (see reload.go)
//	go run ./bench -big-config     # only a big config's load and reloads (bigconfig.go)
//
// It builds ./cmd/caddy once into a temporary directory, starts an
// in-process fake Anthropic upstream (internal/fakeupstream: Fast answers at
// once, Idle streams that ping every 30s) and a redis-server, and measures
// nine targets one after another, each in its own caddy process on a free
// port:
//
//	(a) direct             the fake upstream itself, no Caddy
//	(b) reverse_proxy      `reverse_proxy http://127.0.0.1:<upstream>`, Caddy's defaults
//	(c) relay, 1 channel   one channel, one key, one group
//	(d) relay, 3 channels  two priority-1 channels and a priority-2 one
//	(e) relay, failover    the priority-1 channel refuses connections (cooldown
//	                       1ns, a breaker that never opens: it is tried every
//	                       time) and a priority-2 channel answers: every
//	                       request fails over once
//	(f) relay, key limits  (c) with a rate, a token and a concurrency limit on
//	                       its key, so high that none refuses: every request
//	                       is admitted by all three and gives back to them
//	(g) relay, key limits  (f) with `storage redis`: the key's limits are kept
//	    in Redis           in the harness's redis-server, as a fleet keeps
//	                       them (on_error deny: a request Redis does not
//	                       admit in time fails)
//	(h) relay, budgets,    (c) serving identities, not a key: the identity
//	    identity and dedup comes from a request header (in production an
//	    headers            authentication handler sets it), each of the
//	                       load's 1,000 identities under `user *` with a
//	                       daily budget of its own and the group with one,
//	                       so far from spent that none refuses; every
//	                       request carries x-stainless-retry-count: 0, as
//	                       the SDKs' first attempts do, so dedup records it
//	                       (after the warm-up the harness checks that a
//	                       retry is answered without the upstream)
//	(i) relay, 1 channel,  (c) with `ledger sqlite <file>` (a file in the
//	    ledger             run's temporary directory): each request's row
//	                       handed to the ledger's queue and written to
//	                       SQLite in batches by the same process; measured
//	                       in the CPU comparison alone. After the load the
//	                       harness asks its admin endpoint for GET
//	                       /relay/usage and fails unless the ledger holds a
//	                       row for every request it sent, then reads its
//	                       /metrics for the CPU the ledger's writer spent
//	                       (on its own thread) and the rows it wrote
//
// With -baseline REV, a tenth: (c0), (c)'s config served by cmd/caddy as
// built from REV, a git revision of the repository (its tree written by git
// archive into a temporary directory, built there with the same GOFLAGS,
// removed after the build), so that a change is measured against the build
// before it in the same sitting.
//
// The redis-server runs on a free 127.0.0.1 port, in a temporary directory,
// without persistence (--save "" --appendonly no), and is killed at the
// end. Without redis-server on PATH the run fails at once, saying to
// `apt-get install -y redis-server`.
//
// Workloads, each -duration long (default 5s), -rounds times (default 3)
// with the targets taking turns in a rotating order, after a short warm-up;
// each row holds the medians of its rounds:
//
//   - non-streaming: POST /v1/messages with a 10 KB body, closed loop at
//     concurrency 1, 10 and 100;
//   - the CPU comparison (targets b, c, h, i and c0): the same at concurrency
//     50 (-cpu-concurrency), in 8 rounds (-cpu-rounds) of 3s
//     (-cpu-duration); -cpu-only measures it alone;
//   - fixed rate (targets b, c, f and g): the same request at a constant
//     -rate (default 2000 req/s), whatever the replies do: vegeta's
//     constant pacer, with workers added while every one waits for a
//     reply. A run that sent less than 90% of the rate fails;
//   - streaming: the same body with "stream":true (20 events) at concurrency
//     10; p50/p99 are to the last byte, "first byte" is until the response
//     headers, which the relay sends at its commit point;
//   - idle streams (targets b and c): -idle streams (default 10000, fewer
//     if the open-file limit cannot be raised enough: each holds two
//     sockets in caddy and two here) opened at once to an upstream that
//     pings every 30s, each read until its first content_block_delta and
//     held open; the caddy process's VmRSS growth divided by the streams
//     is the memory per idle stream. Twice: to a plain HTTP/1.1 upstream
//     (a connection a stream), and to one speaking HTTP/2 over TLS as
//     Anthropic's API, Bedrock and Vertex do (streams share connections;
//     its certificate is self-signed, which both targets' transports are
//     told to accept); each row says how many connections the upstream
//     accepted. With -profile DIR, the caddy process gets an admin
//     endpoint and its heap and goroutine profiles are saved in DIR while
//     it holds the streams, as b-* and c-* (HTTP/1.1) and b-h2-* and
//     c-h2-* (HTTP/2).
//
// The load generator is the vegeta library, closed loop but for the fixed
// rate: as many workers as the concurrency, each sending its next request
// when its last one is read, over kept-alive connections. A reply counts as
// a success only when it is a 200 with a complete body (a message with its
// stop_reason, or a stream up to message_stop) and no x-relay-attempts
// header (on target e: 2 attempts, or one when the dead channel was still
// cooling); a run with any failure prints the table and exits with status 1.
//
// The table has one row per workload and target: req/s (successful), success
// ratio, p50, p99, first byte p50, CPU per request, memory per idle stream,
// and for the relay rows their ratio to the reverse_proxy row of the same
// workload. CPU per request is the user and system CPU time of the target's
// caddy process (utime+stime of /proc/<pid>/stat, read just before and
// after each of its rounds) over the requests answered in the round; the
// row holds the median of its rounds. Below the table come the performance
// targets, each with its worst row and marked met or missed: (c) and (d)
// against (b); the failover overhead, p50 of (e) minus p50 of (c) at
// concurrency 1, with the share of (e)'s requests that did fail over (a few
// pick the good channel while the dead one cools for its 1ns); what the
// fleet costs, (g) against (f): the p50 it adds at the fixed rate and
// its throughput at the worst closed-loop concurrency; at the CPU comparison, (c)'s CPU per request
// and throughput and (h)'s CPU per request against (b), and what (i)'s
// ledger adds: its writer's CPU a row against (i)'s CPU per request (with
// (i)'s against (c)'s, reported); and with -baseline,
// (c) against (c0), CPU per request and throughput (reported). The
// harness runs on Linux (it reads /proc); it raises its open-file limit,
// which the caddy processes inherit. bench_test.go runs the -smoke mode so
// the harness cannot rot; without redis-server it leaves (g) out and says
// so in a skipped subtest, or fails under CI=true.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"strings"
	"time"
)

func main() {
	o := fullRun()
	flag.DurationVar(&o.duration, "duration", o.duration, "length of each measured run")
	flag.IntVar(&o.rounds, "rounds", o.rounds, "rounds of every workload; rows are the medians")
	flag.IntVar(&o.idleStreams, "idle", o.idleStreams, "idle streams opened at once for the memory measurement")
	flag.IntVar(&o.rate, "rate", o.rate, "req/s of the fixed-rate workload")
	flag.IntVar(&o.cpuConcurrency, "cpu-concurrency", o.cpuConcurrency, "concurrency of the CPU comparison (closed loop, non-streaming)")
	flag.IntVar(&o.cpuRounds, "cpu-rounds", o.cpuRounds, "rounds of the CPU comparison")
	flag.DurationVar(&o.cpuDuration, "cpu-duration", o.cpuDuration, "length of each measured run of the CPU comparison")
	flag.BoolVar(&o.idleOnly, "idle-only", false, "measure only the idle streams (targets b and c), not the load")
	flag.BoolVar(&o.cpuOnly, "cpu-only", false, "measure only the CPU comparison (targets b, c, h, i, and c0 with -baseline), about two and a half minutes")
	flag.StringVar(&o.baseline, "baseline", "", "also build cmd/caddy from this git revision and measure it as (c0), the same config as (c), taking turns with the others")
	flag.StringVar(&o.profileDir, "profile", "", "write heap and goroutine profiles of each caddy process holding the idle streams, and CPU and allocation profiles of each target in the last round of the CPU comparison, to this directory")
	reload := flag.Duration("reload", 0, "instead of the rest, run the reload-under-load mode for this long (60s for the full check)")
	reloadRate := flag.Int("reload-rate", 100, "req/s of the reload-under-load mode, half of them streams")
	chaos := flag.Bool("chaos", false, "in the reload-under-load mode, a second channel fails every fifth request before its content (-reload 1h -chaos is the long run)")
	bigConfig := flag.Bool("big-config", false, "instead of the rest, load a big config into caddy and reload it: -channels channels in 50 groups, -keys keys")
	bigChannels := flag.Int("channels", 1000, "channels of the -big-config mode")
	bigKeys := flag.Int("keys", 100000, "keys of the -big-config mode")
	bigReloads := flag.Int("reloads", 3, "reloads of the -big-config mode")
	keysIn := flag.String("keys-in", "file", "where the -big-config mode keeps its keys: file (a keys file) or config")
	smoke := flag.Bool("smoke", false, "a quick check of the harness itself (overrides -duration, -rounds, -idle, -rate and the -cpu-* sizes)")
	out := flag.String("out", "", "also write the markdown table to this file")
	flag.Parse()
	if *smoke {
		kept := o
		o = smokeRun()
		o.idleOnly, o.cpuOnly, o.baseline, o.profileDir = kept.idleOnly, kept.cpuOnly, kept.baseline, kept.profileDir
	}
	if o.idleOnly && o.cpuOnly {
		fmt.Fprintln(os.Stderr, "bench: -idle-only and -cpu-only measure different things: give one")
		os.Exit(2)
	}
	o.logf = log.New(os.Stderr, "bench: ", 0).Printf
	if *bigConfig {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
		if *keysIn != "file" && *keysIn != "config" {
			fmt.Fprintln(os.Stderr, "bench: -keys-in is file or config")
			os.Exit(2)
		}
		res, err := runBigConfig(ctx, bigConfigOptions{channels: *bigChannels, keys: *bigKeys, keysFile: *keysIn == "file", reloads: *bigReloads, profileDir: o.profileDir, logf: o.logf})
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		fmt.Printf("Big config, %d channels in 50 groups, %d keys in the %s: %s.\n", *bigChannels, *bigKeys, *keysIn, res)
		return
	}
	if *reload > 0 {
		ro := reloadOptions{duration: *reload, rate: *reloadRate, streamLength: 2 * time.Second, chaos: *chaos, logf: o.logf}
		if err := runReloadAndPrint(ro, *out); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(1)
		}
		return
	}
	if err := runAndPrint(o, *out); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// runAndPrint runs the benchmark until done or interrupted, prints its
// table and writes it to out, if named. It fails when a request failed.
func runAndPrint(o options, out string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := run(ctx, o)
	if err != nil {
		return err
	}
	table := rep.markdown()
	fmt.Print(table)
	if out != "" {
		if err := os.WriteFile(out, []byte(table), 0o644); err != nil {
			return err
		}
	}
	if failed := rep.failures(); len(failed) > 0 {
		return fmt.Errorf("FAILED: requests failed in %d rows:\n%s", len(failed), strings.Join(failed, "\n"))
	}
	return nil
}

// options is what one run measures.
type options struct {
	targets           []*target     // measured, in the order of the table
	duration          time.Duration // each measured attack
	rounds            int           // of every workload, targets taking turns
	concurrency       []int         // of the closed-loop non-streaming workloads
	cpuConcurrency    int           // of the CPU comparison, closed loop, non-streaming
	cpuRounds         int           // of the CPU comparison, targets taking turns
	cpuDuration       time.Duration // each measured attack of the CPU comparison
	rate              int           // req/s of the fixed-rate workload
	streamConcurrency int           // of the streaming workload
	idleStreams       int           // held open at once for the memory measurement
	idleOnly          bool          // measure the idle streams only
	cpuOnly           bool          // measure the CPU comparison only
	profileDir        string        // if set, profiles of the caddy processes holding the idle streams
	logf              func(format string, args ...any)

	// baseline, if set, is a git revision whose cmd/caddy serves (c0), a
	// copy of (c), beside the checkout's.
	baseline string
	// baselineFromCheckout serves (c0) with the checkout's own binary
	// instead of building baseline: the smoke test's, which exercises the
	// (c0) rows without the minutes of a second build.
	baselineFromCheckout bool
}

// fullRun is the full run: every target, every workload. The CPU
// comparison has more and shorter rounds than the rest: CPU per request
// moves with whatever else the machine runs, and more turns spread that
// over the targets more evenly.
func fullRun() options {
	return options{targets: targets, duration: 5 * time.Second, rounds: 3, concurrency: []int{1, 10, 100}, rate: 2000,
		cpuConcurrency: 50, cpuRounds: 8, cpuDuration: 3 * time.Second,
		streamConcurrency: 10, idleStreams: 10000}
}

// smokeRun runs every target and workload, briefly.
func smokeRun() options {
	return options{targets: targets, duration: 300 * time.Millisecond, rounds: 1, concurrency: []int{1, 4}, rate: 100,
		cpuConcurrency: 8, cpuRounds: 2, cpuDuration: 300 * time.Millisecond,
		streamConcurrency: 4, idleStreams: 20}
}

// cpuWorkload is the CPU comparison: non-streaming, closed loop at
// cpuConcurrency, in cpuRounds rounds of cpuDuration.
func (o options) cpuWorkload() workload {
	return workload{kind: nonStreaming, concurrency: o.cpuConcurrency, cpu: true}
}

// roundsOf returns how many rounds of w are measured, and how long each is.
func (o options) roundsOf(w workload) (int, time.Duration) {
	if w.cpu {
		return o.cpuRounds, o.cpuDuration
	}
	return o.rounds, o.duration
}

// workloads lists the workloads of a run in the order of the table: with
// cpuOnly, the CPU comparison alone.
func (o options) workloads() []workload {
	if o.cpuOnly {
		return []workload{o.cpuWorkload()}
	}
	var ws []workload
	for _, c := range o.concurrency {
		ws = append(ws, workload{kind: nonStreaming, concurrency: c})
	}
	return append(ws,
		o.cpuWorkload(),
		workload{kind: fixedRate, rate: o.rate},
		workload{kind: streaming, concurrency: o.streamConcurrency},
		workload{kind: idle, concurrency: o.idleStreams},
		workload{kind: idle, concurrency: o.idleStreams, h2: true})
}

// runReloadAndPrint runs the reload-under-load mode until done or
// interrupted, prints its report and writes it to out, if named. It fails
// when a check failed.
func runReloadAndPrint(o reloadOptions, out string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	res, err := runReload(ctx, o)
	if err != nil {
		return err
	}
	text := reloadReport(o, res)
	fmt.Print(text)
	if out != "" {
		if err := os.WriteFile(out, []byte(text), 0o644); err != nil {
			return err
		}
	}
	return res.ok()
}
