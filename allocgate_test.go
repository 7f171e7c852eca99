package relay

// The allocation gate. What a request allocates, in allocations and bytes,
// does not depend on how busy the machine is, so unlike its time it can be
// held to a figure in CI: TestAllocationBaseline measures the benchmarks of
// allocGated and fails when the allocs/op or B/op of one grows more than
// allocTolerance past its line in allocBaselineFile. Time is reported in
// the test's log, never gated. docs/performance.md#the-allocation-gate says
// how to update the baseline.

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"os"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/memtest"
)

// updateAllocs makes TestAllocationBaseline write what it measures to the
// baseline instead of comparing.
var updateAllocs = flag.Bool("update-allocs", false,
	"TestAllocationBaseline writes what it measures to "+allocBaselineFile+" instead of comparing")

const (
	// allocBaselineFile is the committed baseline, one line a benchmark.
	allocBaselineFile = "testdata/allocs-baseline.txt"
	// allocTolerance is how much a figure may grow past its baseline:
	// B/op moves by a fraction of a percent between runs (pools emptied by
	// a GC, maps growing), allocs/op not at all.
	allocTolerance = 0.05
	// allocRounds is how many times each benchmark is measured; the least
	// of each figure counts, so that what another goroutine allocates
	// meanwhile (an earlier test's server winding down) counts as little
	// as it can.
	allocRounds = 3
	// allocProcs is the GOMAXPROCS of the measurement, whatever the
	// machine's cores: sync.Pool keeps a cache a P, so the bytes a request
	// allocates grow with the Ps (4% from 2 to 8 in BenchmarkServeHTTP).
	allocProcs = 2
	// allocUpdate is the command that rewrites the baseline.
	allocUpdate = "go test -run TestAllocationBaseline -count=1 -update-allocs ."
)

// allocBench is a benchmark the gate measures, and the iterations of each
// of its measurements.
type allocBench struct {
	name       string
	bench      func(*testing.B)
	iterations int
}

// allocGated are the benchmarks the gate holds to the baseline. Their
// iterations are fixed, and enough that the bytes a request allocates
// average to within a fraction of the tolerance; BenchmarkAdmitAndSelect's
// 100,000 take about as long as the others' 2,000.
var allocGated = []allocBench{
	{"BenchmarkServeHTTP", BenchmarkServeHTTP, 2000},
	{"BenchmarkServeHTTPStream", BenchmarkServeHTTPStream, 2000},
	{"BenchmarkAdmitAndSelect", BenchmarkAdmitAndSelect, 100_000},
}

// allocFigures are what one iteration of a benchmark allocates, as go test
// -benchmem reports it: allocations and bytes.
type allocFigures struct {
	allocs, bytes int64
	// perOp is the allocations per iteration before allocs truncates it
	// to a whole number: two benchmarks a fraction apart may truncate a
	// whole allocation apart
	perOp float64
}

// TestAllocationBaseline is the allocation gate: the allocs/op and B/op of
// each gated benchmark are at most allocTolerance above the baseline's.
// With -update-allocs it writes what it measured to the baseline instead.
// The race detector allocates for itself, so under it the test skips, and
// .ci/run runs it again without -race.
func TestAllocationBaseline(t *testing.T) {
	if memtest.Race {
		if *updateAllocs {
			t.Fatal("the race detector changes what code allocates: update the baseline without -race: " + allocUpdate)
		}
		t.Skip("the race detector changes what code allocates; .ci/run runs this test without -race")
	}
	if testing.Short() {
		t.Skip("starts an upstream on loopback")
	}
	measured := measureAllocs(t, allocGated)
	if *updateAllocs {
		if err := os.WriteFile(allocBaselineFile, formatAllocBaseline(allocGated, measured), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s: commit it on its own, saying why the figures moved", allocBaselineFile)
		return
	}
	text, err := os.ReadFile(allocBaselineFile)
	if err != nil {
		t.Fatalf("%v; write it with: %s", err, allocUpdate)
	}
	baseline, err := parseAllocBaseline(text)
	if err != nil {
		t.Fatalf("%s: %v", allocBaselineFile, err)
	}
	over, under := compareAllocs(baseline, measured, allocTolerance)
	for _, line := range over {
		t.Error(line)
	}
	if len(over) > 0 {
		t.Logf("if the growth is meant, update the baseline in a commit of its own that says why: %s", allocUpdate)
	}
	for _, line := range under {
		t.Logf("%s; update the baseline to keep the gain: %s", line, allocUpdate)
	}
}

// measureAllocs runs each benchmark of benches allocRounds times, for its
// iterations, with allocProcs Ps, and returns the least of each figure by
// benchmark name. It logs the time an iteration took, which it does not
// gate.
func measureAllocs(t *testing.T, benches []allocBench) map[string]allocFigures {
	t.Helper()
	benchtime := flag.Lookup("test.benchtime").Value
	defer func(was string) { _ = benchtime.Set(was) }(benchtime.String())
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(allocProcs))
	measured := make(map[string]allocFigures, len(benches))
	for _, bm := range benches {
		if err := benchtime.Set(strconv.Itoa(bm.iterations) + "x"); err != nil {
			t.Fatal(err)
		}
		var least allocFigures
		var took time.Duration
		for round := range allocRounds {
			res := testing.Benchmark(bm.bench)
			if res.N != bm.iterations {
				t.Fatalf("%s stopped after %d of its %d iterations; see why with: go test -run '^$' -bench '^%s$' .",
					bm.name, res.N, bm.iterations, bm.name)
			}
			f := allocFigures{allocs: res.AllocsPerOp(), bytes: res.AllocedBytesPerOp(), perOp: float64(res.MemAllocs) / float64(res.N)}
			op := res.T / time.Duration(res.N)
			if round == 0 {
				least, took = f, op
				continue
			}
			least = allocFigures{allocs: min(least.allocs, f.allocs), bytes: min(least.bytes, f.bytes), perOp: min(least.perOp, f.perOp)}
			took = min(took, op)
		}
		measured[bm.name] = least
		t.Logf("%s: %d allocs/op, %d B/op; %v/op (time is reported, not gated)", bm.name, least.allocs, least.bytes, took)
	}
	return measured
}

// compareAllocs holds measured to baseline: over says, a line each, which
// figure grew more than tolerance (a fraction) past its baseline, which
// benchmark of the baseline was not measured and which measured one the
// baseline lacks; under, which figure fell more than tolerance below it.
func compareAllocs(baseline, measured map[string]allocFigures, tolerance float64) (over, under []string) {
	check := func(name, unit string, base, got int64) {
		switch {
		case float64(got) > float64(base)*(1+tolerance):
			over = append(over, fmt.Sprintf("%s: %d %s, %+.1f%% over the baseline's %d (at most %+.0f%%)",
				name, got, unit, change(base, got), base, tolerance*100))
		case float64(got) < float64(base)*(1-tolerance):
			under = append(under, fmt.Sprintf("%s: %d %s, %+.1f%% under the baseline's %d", name, got, unit, change(base, got), base))
		}
	}
	for _, name := range sortedKeys(baseline) {
		base := baseline[name]
		got, ok := measured[name]
		if !ok {
			over = append(over, name+": in the baseline but not measured; remove its line or gate it again")
			continue
		}
		check(name, "allocs/op", base.allocs, got.allocs)
		check(name, "B/op", base.bytes, got.bytes)
	}
	for _, name := range sortedKeys(measured) {
		if _, ok := baseline[name]; !ok {
			over = append(over, name+": measured but not in the baseline; add it with: "+allocUpdate)
		}
	}
	return over, under
}

// change is how far got is from base, in percent of base.
func change(base, got int64) float64 {
	if base == 0 {
		return 100
	}
	return float64(got-base) / float64(base) * 100
}

// sortedKeys are the benchmark names of m, in order.
func sortedKeys(m map[string]allocFigures) []string {
	names := make([]string, 0, len(m))
	for name := range m {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// allocBaselineHeader opens the baseline: what it is, and how and when to
// update it.
var allocBaselineHeader = fmt.Sprintf(`# The allocation baseline: what one iteration of each benchmark the gate
# holds allocates, as go test -benchmem reports it (allocs/op, B/op).
# TestAllocationBaseline (allocgate_test.go) measures them again without
# the race detector (.ci/run runs it so) and fails when a figure grows more
# than %.0f%% past its line. Time is reported, never gated.
#
# Update it on purpose, in a commit of its own whose message says why the
# figures moved (what allocates now and why it must, a Go release), with
#
#   %s
#
# which writes this file again.
#
# benchmark allocs/op B/op
`, allocTolerance*100, allocUpdate)

// formatAllocBaseline renders the baseline file: its header, then a line a
// benchmark of benches, in their order, with its figures in measured.
func formatAllocBaseline(benches []allocBench, measured map[string]allocFigures) []byte {
	var b bytes.Buffer
	b.WriteString(allocBaselineHeader)
	for _, bm := range benches {
		f := measured[bm.name]
		fmt.Fprintf(&b, "%s %d %d\n", bm.name, f.allocs, f.bytes)
	}
	return b.Bytes()
}

// parseAllocBaseline reads a baseline: a line a benchmark (its name,
// allocs/op and B/op, separated by spaces); blank lines and lines that
// start with # are comments.
func parseAllocBaseline(text []byte) (map[string]allocFigures, error) {
	baseline := map[string]allocFigures{}
	sc := bufio.NewScanner(bytes.NewReader(text))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 3 {
			return nil, fmt.Errorf("line %d: want a benchmark's name, allocs/op and B/op, got %q", n, line)
		}
		allocs, err1 := strconv.ParseInt(fields[1], 10, 64)
		size, err2 := strconv.ParseInt(fields[2], 10, 64)
		if err1 != nil || err2 != nil || allocs < 0 || size < 0 {
			return nil, fmt.Errorf("line %d: allocs/op and B/op are counts, got %q", n, line)
		}
		if _, dup := baseline[fields[0]]; dup {
			return nil, fmt.Errorf("line %d: %s again", n, fields[0])
		}
		baseline[fields[0]] = allocFigures{allocs: allocs, bytes: size}
	}
	if len(baseline) == 0 {
		return nil, fmt.Errorf("no benchmark in it")
	}
	return baseline, sc.Err()
}

// TestAllocationGateCompares holds compareAllocs to the tolerance: a figure
// 6% over trips the gate, 4% over does not, one allocation more on 2 does,
// and a benchmark on one side only does too.
func TestAllocationGateCompares(t *testing.T) {
	baseline := map[string]allocFigures{
		"BenchmarkBig":   {allocs: 170, bytes: 28_000},
		"BenchmarkSmall": {allocs: 2, bytes: 192},
	}
	for _, c := range []struct {
		name        string
		measured    map[string]allocFigures
		over, under []string // the start of each line
	}{
		{"the same", map[string]allocFigures{"BenchmarkBig": {allocs: 170, bytes: 28_000}, "BenchmarkSmall": {allocs: 2, bytes: 192}}, nil, nil},
		{"4% over", map[string]allocFigures{"BenchmarkBig": {allocs: 176, bytes: 29_120}, "BenchmarkSmall": {allocs: 2, bytes: 199}}, nil, nil},
		{"6% more allocations", map[string]allocFigures{"BenchmarkBig": {allocs: 181, bytes: 28_000}, "BenchmarkSmall": {allocs: 2, bytes: 192}},
			[]string{"BenchmarkBig: 181 allocs/op, +6.5%"}, nil},
		{"6% more bytes", map[string]allocFigures{"BenchmarkBig": {allocs: 170, bytes: 29_680}, "BenchmarkSmall": {allocs: 2, bytes: 192}},
			[]string{"BenchmarkBig: 29680 B/op, +6.0%"}, nil},
		{"one allocation more of 16 bytes on a small one", map[string]allocFigures{"BenchmarkBig": {allocs: 170, bytes: 28_000}, "BenchmarkSmall": {allocs: 3, bytes: 208}},
			[]string{"BenchmarkSmall: 3 allocs/op", "BenchmarkSmall: 208 B/op"}, nil},
		{"6% fewer", map[string]allocFigures{"BenchmarkBig": {allocs: 159, bytes: 26_320}, "BenchmarkSmall": {allocs: 2, bytes: 192}},
			nil, []string{"BenchmarkBig: 159 allocs/op", "BenchmarkBig: 26320 B/op"}},
		{"a gated benchmark not measured", map[string]allocFigures{"BenchmarkBig": {allocs: 170, bytes: 28_000}},
			[]string{"BenchmarkSmall: in the baseline but not measured"}, nil},
		{"a benchmark the baseline lacks", map[string]allocFigures{"BenchmarkBig": {allocs: 170, bytes: 28_000}, "BenchmarkSmall": {allocs: 2, bytes: 192}, "BenchmarkNew": {allocs: 1, bytes: 8}},
			[]string{"BenchmarkNew: measured but not in the baseline"}, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			over, under := compareAllocs(baseline, c.measured, allocTolerance)
			if !startsEach(over, c.over) || !startsEach(under, c.under) {
				t.Errorf("over %q, under %q; want lines starting %q and %q", over, under, c.over, c.under)
			}
		})
	}
}

// startsEach reports whether each line starts with its prefix.
func startsEach(lines, prefixes []string) bool {
	if len(lines) != len(prefixes) {
		return false
	}
	for i := range lines {
		if !strings.HasPrefix(lines[i], prefixes[i]) {
			return false
		}
	}
	return true
}

// TestAllocationBaselineFile holds the baseline file's format: what
// formatAllocBaseline writes parses back to the same figures, the
// committed file parses and names exactly the gated benchmarks, and a
// malformed line is an error.
func TestAllocationBaselineFile(t *testing.T) {
	measured := map[string]allocFigures{"BenchmarkBig": {allocs: 170, bytes: 28_000}, "BenchmarkSmall": {allocs: 2, bytes: 192}}
	benches := []allocBench{{name: "BenchmarkBig"}, {name: "BenchmarkSmall"}}
	got, err := parseAllocBaseline(formatAllocBaseline(benches, measured))
	if err != nil || !reflect.DeepEqual(got, measured) {
		t.Errorf("written and read again: %v, %v; want %v", got, err, measured)
	}

	text, err := os.ReadFile(allocBaselineFile)
	if err != nil {
		t.Fatal(err)
	}
	committed, err := parseAllocBaseline(text)
	if err != nil {
		t.Fatalf("%s: %v", allocBaselineFile, err)
	}
	var gated []string
	for _, bm := range allocGated {
		gated = append(gated, bm.name)
	}
	slices.Sort(gated)
	if names := sortedKeys(committed); !slices.Equal(names, gated) {
		t.Errorf("%s has %v, the gate measures %v; write it again with: %s", allocBaselineFile, names, gated, allocUpdate)
	}
	if !bytes.HasPrefix(text, []byte(allocBaselineHeader)) {
		t.Errorf("%s lost its header; write it again with: %s", allocBaselineFile, allocUpdate)
	}

	for _, bad := range []string{
		"BenchmarkBig 170\n",
		"BenchmarkBig 170 x\n",
		"BenchmarkBig -1 28000\n",
		"BenchmarkBig 170 28000\nBenchmarkBig 171 28000\n",
		"# only a comment\n",
	} {
		if _, err := parseAllocBaseline([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// allocSink keeps what allocatingBench allocates on the heap.
var allocSink []byte

// allocatingBench is a benchmark whose iterations each make n slices of
// 64 bytes.
func allocatingBench(n int) func(*testing.B) {
	return func(b *testing.B) {
		for range b.N {
			for range n {
				allocSink = make([]byte, 64)
			}
		}
	}
}

// TestAllocationGateTrips runs the gate's measurement and comparison on
// benchmarks that allocate more than a baseline measured the same way: 3
// allocations more on 50 (6%) trip it, 2 (4%) do not.
func TestAllocationGateTrips(t *testing.T) {
	if memtest.Race {
		t.Skip("the race detector changes what code allocates; .ci/run runs this test without -race")
	}
	measure := func(n int) map[string]allocFigures {
		return measureAllocs(t, []allocBench{{"BenchmarkAllocating", allocatingBench(n), 10_000}})
	}
	baseline := measure(50)
	if got := baseline["BenchmarkAllocating"]; got.allocs != 50 || got.bytes < 50*64 || got.bytes > 50*64*101/100 {
		t.Fatalf("measured %+v, want 50 allocations of 64 bytes", got)
	}
	if over, _ := compareAllocs(baseline, measure(52), allocTolerance); len(over) != 0 {
		t.Errorf("4%% more tripped the gate: %q", over)
	}
	if over, _ := compareAllocs(baseline, measure(53), allocTolerance); len(over) != 2 {
		t.Errorf("6%% more allocations and bytes: %q, want both figures over", over)
	}
}

// TestBenchServeConfiguresNoFeature holds the gate to its claim that a
// feature left unconfigured costs a request no allocation: the relay of
// BenchmarkServeHTTP and BenchmarkServeHTTPStream configures no key limit,
// budget, end-user limit, identity, user entry, response cache, fleet or
// price, and their requests carry no dedup marker (x-stainless-retry-count,
// idempotency-key), so the baseline's figures are those of a request that
// uses none of them, and an unconfigured feature that starts allocating
// trips the gate.
func TestBenchServeConfiguresNoFeature(t *testing.T) {
	const name = "bench-serve"
	r := benchServeRelay(name, "http://127.0.0.1:9", nil)
	if !reflect.DeepEqual(r, &Relay{Keys: r.Keys, Channels: r.Channels, Groups: r.Groups}) {
		t.Errorf("the relay configures more than keys, channels and groups: %+v", r)
	}
	if len(r.Keys) != 1 || !reflect.DeepEqual(*r.Keys[0], Key{Secret: "sk-" + name, Group: name, KeyOptions: KeyOptions{Name: name}}) {
		t.Errorf("the keys configure more than a name and a group: %+v", r.Keys)
	}
	if len(r.Groups) != 1 || !reflect.DeepEqual(*r.Groups[0], Group{Name: name, Channels: []string{name}}) {
		t.Errorf("the groups configure more than a name and a channel: %+v", r.Groups)
	}
	if len(r.Channels) != 1 || !reflect.DeepEqual(*r.Channels[0], Channel{Name: name, UpstreamRaw: r.Channels[0].UpstreamRaw, Models: []string{"claude-sonnet-4-5"}}) {
		t.Errorf("the channels configure more than an upstream and a model: %+v", r.Channels)
	}
	for h := range benchServeRequest(name, benchBody).Header {
		if h != "X-Api-Key" && h != "Anthropic-Version" {
			t.Errorf("the requests carry %s", h)
		}
	}
}
