package main

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// row is one measurement: a workload against a target.
type row struct {
	target        *target
	workload      workload
	reqPerSec     float64       // successful replies per second
	success       float64       // share of successful replies (of opened streams, for idle)
	p50, p99      time.Duration // to the last byte
	firstByte     time.Duration // p50 until the response headers
	kibPerStream  float64       // resident memory per idle stream
	upstreamConns int64         // upstream connections the idle streams hold open
	failedOver    float64       // share of the requests that failed over
	requests      int64         // answered, successfully or not (in a round; in a row, in all its rounds)
	// cpuPerReq is the user and system CPU time the target's caddy process
	// used in a round, divided by the requests answered in it; zero for the
	// direct target, which has no process, and for idle streams.
	cpuPerReq time.Duration
	errors    []string // the distinct errors of failed requests
	// ledgerPerRow is, on a ledger target's CPU comparison row, the CPU
	// time its ledger's writer spent a row over the whole run, read from
	// the writer's own thread (relay_ledger_writer_cpu_seconds_total over
	// relay_ledger_rows_total); zero elsewhere.
	ledgerPerRow time.Duration
}

// report is the result of a run.
type report struct {
	options
	machine string
	rows    []row
}

// find returns the row of t and w.
func (r *report) find(t *target, w workload) (row, bool) {
	for _, x := range r.rows {
		if x.target == t && x.workload == w {
			return x, true
		}
	}
	return row{}, false
}

// failures lists the rows where a request failed, or a fixed-rate
// workload fell short of its rate, with why.
func (r *report) failures() []string {
	var failed []string
	for _, x := range r.rows {
		if x.success < 1 || len(x.errors) > 0 {
			failed = append(failed, fmt.Sprintf("%s, %s: %.2f%% success %q", x.target.name, x.workload, 100*x.success, x.errors))
		}
	}
	return failed
}

// markdown renders the machine, the table (grouped by workload, so each
// relay row sits under its reverse_proxy row) and the performance targets.
func (r *report) markdown() string {
	var b strings.Builder
	rounds := fmt.Sprintf("the medians of %d rounds of %s, the %s rows of %d rounds of %s (targets taking turns), closed loop (vegeta) but for the %d req/s rows (constant rate), 10 KB request bodies; streams: 20 events, p50/p99 to the last byte",
		r.rounds, r.duration, r.cpuWorkload(), r.cpuRounds, r.cpuDuration, r.rate)
	targets := "Targets, for (c) and (d) against (b) unless named:"
	if r.cpuOnly {
		rounds = fmt.Sprintf("the medians of %d rounds of %s (targets taking turns), closed loop (vegeta), 10 KB request bodies", r.cpuRounds, r.cpuDuration)
		targets = "Targets, against (b) unless named:"
	}
	fmt.Fprintf(&b, "Machine: %s. Each row: %s; CPU/req: the user and system CPU time of the target's caddy process in a round over the requests it answered.\n\n", r.machine, rounds)
	b.WriteString("| workload | target | req/s | success | p50 | p99 | first byte p50 | CPU/req | memory / idle stream | req/s vs reverse_proxy | p50 vs reverse_proxy | p99 vs reverse_proxy | CPU/req vs reverse_proxy |\n")
	b.WriteString("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, w := range r.workloads() {
		for _, t := range r.targets {
			if x, ok := r.find(t, w); ok {
				b.WriteString(r.line(x))
			}
		}
	}
	fmt.Fprintf(&b, "\n%s\n\n", targets)
	for _, g := range r.goals() {
		fmt.Fprintf(&b, "- %s\n", g)
	}
	return b.String()
}

// line renders one row of the table; cells a workload does not measure
// are left empty.
func (r *report) line(x row) string {
	var reqs, p50, p99, firstByte, cpu, memory, reqsVs, p50Vs, p99Vs, cpuVs string
	if x.workload.kind == idle {
		memory = fmt.Sprintf("%.1f KiB (%d upstream connections)", x.kibPerStream, x.upstreamConns)
	} else {
		reqs, p50, p99 = fmt.Sprintf("%.0f", x.reqPerSec), millis(x.p50), millis(x.p99)
	}
	if x.workload.kind == streaming {
		firstByte = millis(x.firstByte)
	}
	if x.workload.kind != idle && x.target != direct {
		cpu = micros(x.cpuPerReq)
	}
	if rp, ok := r.find(reverseProxy, x.workload); ok && x.workload.kind != idle && x.target != direct && x.target != reverseProxy {
		reqsVs = times(x.reqPerSec / rp.reqPerSec)
		p50Vs = times(float64(x.p50) / float64(rp.p50))
		p99Vs = times(float64(x.p99) / float64(rp.p99))
		cpuVs = times(float64(x.cpuPerReq) / float64(rp.cpuPerReq))
	}
	cells := []string{x.workload.String(), x.target.name, reqs, percent(x.success), p50, p99, firstByte, cpu, memory, reqsVs, p50Vs, p99Vs, cpuVs}
	return "| " + strings.Join(cells, " | ") + " |\n"
}

// pair is a relay row and the row of the same workload it is measured
// against: reverse_proxy's, or for the fleet targets (f)'s.
type pair struct{ relay, base row }

// relayPairs returns the pairs of targets (c) and (d) against (b) in the
// workloads of kind k.
func (r *report) relayPairs(k kind) []pair {
	return r.pairs(k, reverseProxy, relayOne, relayTiers)
}

// fleetPairs returns the pairs of (g) against (f) in the workloads of kind
// k: what keeping the same limits in Redis adds.
func (r *report) fleetPairs(k kind) []pair {
	return r.pairs(k, relayKeyLimits, relayRedis)
}

// pairs returns the rows of ts, each paired with the row of base, in the
// workloads of kind k where both were measured.
func (r *report) pairs(k kind, base *target, ts ...*target) []pair {
	var ps []pair
	for _, w := range r.workloads() {
		b, ok := r.find(base, w)
		if w.kind != k || !ok {
			continue
		}
		for _, t := range ts {
			if x, ok := r.find(t, w); ok {
				ps = append(ps, pair{x, b})
			}
		}
	}
	return ps
}

// worst returns the value of f on the pair where it is worst, the largest
// (or with lowerIsWorse the smallest), and names that pair.
func worst(ps []pair, f func(pair) float64, lowerIsWorse bool) (float64, string) {
	value, where := 0.0, "no rows"
	for i, p := range ps {
		if v := f(p); i == 0 || (v > value) != lowerIsWorse {
			value, where = v, p.relay.target.name+", "+p.relay.workload.String()
		}
	}
	return value, where
}

// goals checks the performance targets, each on its worst row, and adds
// the comparison with the baseline build, if any. A run of the CPU
// comparison alone checks its own targets only.
func (r *report) goals() []string {
	if r.cpuOnly {
		return append(r.cpuGoals(), r.baselineLines()...)
	}
	nonStream := r.relayPairs(nonStreaming)
	reqs, reqsAt := worst(nonStream, func(p pair) float64 { return p.relay.reqPerSec / p.base.reqPerSec }, true)
	p50, p50At := worst(nonStream, func(p pair) float64 { return float64(p.relay.p50) / float64(p.base.p50) }, false)
	p99, p99At := worst(nonStream, func(p pair) float64 { return float64(p.relay.p99) / float64(p.base.p99) }, false)
	firstByte, firstByteAt := worst(r.relayPairs(streaming), func(p pair) float64 { return float64(p.relay.firstByte - p.base.firstByte) }, false)
	mem, memAt := worst(r.relayPairs(idle), func(p pair) float64 { return p.relay.kibPerStream }, false)
	failover, failoverAt, failedOver := r.failoverOverhead()
	return append([]string{
		goal("throughput >= 0.90x reverse_proxy", times(reqs), reqsAt, reqs >= 0.90),
		goal("p50 <= 1.10x reverse_proxy", times(p50), p50At, p50 <= 1.10),
		goal("p99 <= 1.10x reverse_proxy", times(p99), p99At, p99 <= 1.10),
		goal("streaming first byte within 1 ms of reverse_proxy", signedMillis(time.Duration(firstByte)), firstByteAt, firstByte < float64(time.Millisecond)),
		goal("<= 48 KiB resident memory per idle stream", fmt.Sprintf("%.1f KiB", mem), memAt, mem <= 48),
		goal("failover overhead (p50 of (e) minus p50 of (c)) < 5 ms", millis(failover),
			fmt.Sprintf("%s, where %.2f%% of (e)'s requests failed over", failoverAt, 100*failedOver), failover < 5*time.Millisecond),
	}, slices.Concat(r.fleetGoals(), r.cpuGoals(), r.baselineLines())...)
}

// baselineLines compares (c) with (c0), the same config served by the
// baseline revision's build, at the CPU comparison workload: CPU per
// request and throughput, reported, not a target. None without -baseline.
func (r *report) baselineLines() []string {
	c0 := baselineOf(r.targets)
	if c0 == nil {
		return nil
	}
	w := r.cpuWorkload()
	name := "(c) vs (c0)"
	c, okC := r.find(relayOne, w)
	base, okBase := r.find(c0, w)
	if !okC || !okBase {
		return []string{notMeasured(name)}
	}
	return []string{fmt.Sprintf("%s: CPU/req %s, throughput %s (%s; (c0) is %s; reported, not a target)",
		name, times(float64(c.cpuPerReq)/float64(base.cpuPerReq)), times(c.reqPerSec/base.reqPerSec), w, c0.rev)}
}

// The CPU targets, at the CPU comparison workload against reverse_proxy:
// the relay with one channel must cost less CPU per request and, on the
// same cores, serve more; with budgets, identity and dedup on, it must
// still cost less.
const (
	maxCPURelay    = 0.85 // (c)'s CPU per request, at most, times (b)'s
	minReqsRelay   = 1.10 // (c)'s throughput, at least, times (b)'s
	maxCPUFeatures = 0.90 // (h)'s CPU per request, at most, times (b)'s
	// maxCPULedger is the share of (i)'s CPU per request, at most, that
	// its ledger's writer spends a row (batches into SQLite, in the same
	// process): what keeping a usage ledger adds to a request. The row
	// handed to the queue on the request's path allocates nothing and
	// takes tens of nanoseconds (BenchmarkLedgerEnqueue).
	maxCPULedger = 0.02
)

// cpuGoals checks the CPU targets: against reverse_proxy, then the
// ledger's against (c). Each is on one row, the CPU comparison workload's;
// without it (a run that left its target out), it says it was not
// measured.
func (r *report) cpuGoals() []string {
	w := r.cpuWorkload()
	cpuName := fmt.Sprintf("CPU comparison: CPU per request <= %.2fx reverse_proxy", maxCPURelay)
	reqsName := fmt.Sprintf("CPU comparison: throughput >= %.2fx reverse_proxy", minReqsRelay)
	featuresName := fmt.Sprintf("CPU comparison: CPU per request with budgets, identity and dedup headers <= %.2fx reverse_proxy", maxCPUFeatures)
	var goals []string
	if p, ok := r.pairAt(w, relayOne); ok {
		cpu, reqs, where := p.cpuRatio(), p.relay.reqPerSec/p.base.reqPerSec, p.relay.target.name+", "+w.String()
		goals = append(goals, goal(cpuName, times(cpu), where, cpu <= maxCPURelay), goal(reqsName, times(reqs), where, reqs >= minReqsRelay))
	} else {
		goals = append(goals, notMeasured(cpuName), notMeasured(reqsName))
	}
	if p, ok := r.pairAt(w, relayFeatures); ok {
		cpu := p.cpuRatio()
		goals = append(goals, goal(featuresName, times(cpu), p.relay.target.name+", "+w.String(), cpu <= maxCPUFeatures))
	} else {
		goals = append(goals, notMeasured(featuresName))
	}
	return append(goals, r.ledgerGoal())
}

// ledgerGoal checks what the usage ledger costs at the CPU comparison
// workload: its writer's CPU a row, measured on the writer's thread, as a
// share of (i)'s CPU per request. (i)'s CPU per request against (c)'s is
// reported beside it: the difference of two figures that move by more
// than the 2% between runs, it cannot hold the ledger to 2%.
func (r *report) ledgerGoal() string {
	w := r.cpuWorkload()
	name := fmt.Sprintf("ledger: the writer's CPU a row <= %.0f%% of (i)'s CPU per request", 100*maxCPULedger)
	x, okX := r.find(relayLedger, w)
	if !okX || x.ledgerPerRow <= 0 || x.cpuPerReq <= 0 {
		return notMeasured(name)
	}
	share := float64(x.ledgerPerRow) / float64(x.cpuPerReq)
	value := fmt.Sprintf("%.1f%% (%.2f µs a row of %s a request", 100*share, float64(x.ledgerPerRow)/float64(time.Microsecond), micros(x.cpuPerReq))
	if c, okC := r.find(relayOne, w); okC && c.cpuPerReq > 0 {
		value += fmt.Sprintf("; (i)/(c) CPU per request %s, reported", times(float64(x.cpuPerReq)/float64(c.cpuPerReq)))
	}
	return goal(name, value+")", x.target.name+", "+w.String(), share <= maxCPULedger)
}

// pairAt returns t's row of w paired with reverse_proxy's, if both were
// measured.
func (r *report) pairAt(w workload, t *target) (pair, bool) {
	x, okX := r.find(t, w)
	b, okB := r.find(reverseProxy, w)
	return pair{x, b}, okX && okB
}

// cpuRatio is the relay row's CPU per request over the base row's.
func (p pair) cpuRatio() float64 {
	return float64(p.relay.cpuPerReq) / float64(p.base.cpuPerReq)
}

// fleetGoals checks what keeping the key's limits in Redis costs, (g)
// against (f): the p50 it adds at the fixed rate, and the throughput it
// keeps at the worst closed-loop concurrency. Without the rows (a run
// without redis-server), each says it was not measured.
func (r *report) fleetGoals() []string {
	latencyName := fmt.Sprintf("fleet: added p50 at %d req/s, (g) minus (f) <= 0.3 ms", r.rate)
	reqsName := fmt.Sprintf("fleet: closed-loop throughput (g)/(f) >= %.2fx", minFleetThroughput)
	fixed, closed := r.fleetPairs(fixedRate), r.fleetPairs(nonStreaming)
	if len(fixed) == 0 || len(closed) == 0 {
		return []string{notMeasured(latencyName), notMeasured(reqsName)}
	}
	added, addedAt := worst(fixed, func(p pair) float64 { return float64(p.relay.p50 - p.base.p50) }, false)
	reqs, reqsAt := worst(closed, func(p pair) float64 { return p.relay.reqPerSec / p.base.reqPerSec }, true)
	return []string{
		goal(latencyName, signedMillis(time.Duration(added)), addedAt, added <= float64(300*time.Microsecond)),
		goal(reqsName, times(reqs), reqsAt+" (the worst concurrency)", reqs >= minFleetThroughput),
	}
}

// minFleetThroughput is the share of (f)'s closed-loop throughput (g) must
// keep at every concurrency: a key's limits in Redis must not make a node
// much slower than it is alone.
const minFleetThroughput = 0.90

// failoverOverhead is the p50 of (e) minus the p50 of (c) at the lowest
// non-streaming concurrency (1 in the full run), where it was measured, and
// the share of (e)'s requests there that did fail over.
func (r *report) failoverOverhead() (time.Duration, string, float64) {
	if len(r.concurrency) == 0 {
		return 0, "no rows", 0
	}
	w := workload{kind: nonStreaming, concurrency: r.concurrency[0]}
	e, okE := r.find(relayFailover, w)
	c, okC := r.find(relayOne, w)
	if !okE || !okC {
		return 0, "no rows", 0
	}
	return e.p50 - c.p50, w.String(), e.failedOver
}

// goal renders one target: its worst value, where, and whether it is met.
func goal(name, value, where string, met bool) string {
	verdict := "met"
	if !met {
		verdict = "**MISSED**"
	}
	return fmt.Sprintf("%s: %s at %s: %s", name, value, where, verdict)
}

// notMeasured renders a target that the run has no rows for.
func notMeasured(name string) string {
	return name + ": not measured (no rows)"
}

// millis renders a duration in milliseconds.
func millis(d time.Duration) string {
	return fmt.Sprintf("%.2f ms", float64(d)/float64(time.Millisecond))
}

// micros renders a duration in microseconds.
func micros(d time.Duration) string {
	return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond))
}

// signedMillis renders a difference of durations in milliseconds.
func signedMillis(d time.Duration) string {
	return fmt.Sprintf("%+.2f ms", float64(d)/float64(time.Millisecond))
}

// times renders a ratio.
func times(f float64) string { return fmt.Sprintf("%.2fx", f) }

// percent renders a success ratio, in bold when below 100%.
func percent(f float64) string {
	if f == 1 {
		return "100%"
	}
	return fmt.Sprintf("**%.2f%%**", 100*f)
}
