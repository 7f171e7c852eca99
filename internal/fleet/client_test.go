package fleet

import (
	"context"
	"errors"
	"runtime/debug"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/sony/gobreaker/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// testClient connects to Redis as one node of a fleet, its heartbeat
// running, closed when the test ends.
func testClient(t *testing.T, cfg *Config) *Client {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	c, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	c.Go(c.Heartbeat)
	t.Cleanup(func() { c.Stop(); _ = c.Close() })
	return c
}

// waitFor waits for cond, at most bound.
func waitFor(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// quietFleet is a test fleet whose first heartbeat, which it sends as it
// starts, has answered: for two seconds nothing of its own succeeds
// between a test's operations, so the failures a test makes in a row are
// the breaker's failures in a row.
func quietFleet(t *testing.T, addr, prefix string) *Client {
	f := testClient(t, &Config{Address: []string{addr}, Prefix: prefix, Timeout: caddy.Duration(time.Second)})
	waitFor(t, "the fleet's first heartbeat", 2*time.Second, func() bool { return f.NodesUp.Load() > 0 })
	return f
}

// heldOperation starts an operation through run that has begun (it
// returns once it has) and answers, successfully, when release is closed;
// its outcome comes on slow.
func heldOperation(run func(string, func(context.Context) error) error) (release chan struct{}, slow chan error) {
	started := make(chan struct{})
	release, slow = make(chan struct{}), make(chan error, 1)
	go func() {
		slow <- run("renew", func(context.Context) error {
			close(started)
			<-release
			return nil
		})
	}()
	<-started
	return release, slow
}

// TestAnOperationThatAnswersWhileTheBreakerIsOpenDoesNotEndTheOutage: an
// operation begun after Redis was found unreachable, but before the
// breaker opened, that answers while it is open (a background one waits
// longer than the requests' time) does not say Redis is back: the
// operations after it would still be refused by the breaker and start a
// second outage. The breaker's probe ends the outage, with one line.
func TestAnOperationThatAnswersWhileTheBreakerIsOpenDoesNotEndTheOutage(t *testing.T) {
	srv := redistest.Start(t)
	f := quietFleet(t, srv.Addr, "straddle:")
	core, logs := observer.New(zapcore.InfoLevel)
	f.SetLogger(zap.New(core))
	fail := errors.New("no answer")
	if err := f.Do("admit", func(context.Context) error { return fail }); err == nil || f.Up() {
		t.Fatalf("a failed operation: %v, up %v; want failed and down", err, f.Up())
	}
	release, slow := heldOperation(f.Background)
	for range 2 { // with the first, three failures: the breaker opens
		_ = f.Do("admit", func(context.Context) error { return fail })
	}
	if st := f.BreakerState(); st != gobreaker.StateOpen {
		t.Fatalf("after 3 failures the breaker is %v, want open", st)
	}
	close(release)
	if err := <-slow; err != nil {
		t.Fatalf("the operation begun before the breaker opened: %v", err)
	}
	if f.Up() || logs.FilterMessageSnippet("storage reachable again").Len() != 0 {
		t.Fatal("an operation that answered while the breaker was open ended the outage")
	}
	waitFor(t, "the breaker lets an operation try", 3*time.Second, func() bool { return f.BreakerState() == gobreaker.StateHalfOpen })
	if err := f.Do("admit", func(context.Context) error { return nil }); err != nil || !f.Up() {
		t.Fatalf("the breaker's probe answered (err %v): up %v, want true", err, f.Up())
	}
	if n, m := logs.FilterMessageSnippet("storage unreachable").Len(), logs.FilterMessageSnippet("storage reachable again").Len(); n != 1 || m != 1 {
		t.Fatalf("%d lines say the storage is unreachable and %d that it is back, want 1 and 1", n, m)
	}
}

// TestASlowAnswerOnARequestsPathIsNotAnOutage: a request's operation that
// runs out of its time fails that request, and is counted, but neither
// opens the breaker nor declares Redis unreachable, however many in a
// row: on a saturated machine Redis answers late without being gone.
// Operations off the requests' paths that run out of theirs, which are
// longer, do both; then a request's operation fails at once, without
// being tried.
func TestASlowAnswerOnARequestsPathIsNotAnOutage(t *testing.T) {
	srv := redistest.Start(t)
	f := testClient(t, &Config{Address: []string{srv.Addr}, Prefix: "slow:", Timeout: caddy.Duration(20 * time.Millisecond)})
	var err error
	if f.BackgroundTimeout != 200*time.Millisecond {
		t.Fatalf("operations off the requests' paths wait %v, want 10 times the timeout", f.BackgroundTimeout)
	}
	core, logs := observer.New(zapcore.InfoLevel)
	f.SetLogger(zap.New(core))
	late := func(ctx context.Context) error { // Redis answers after the deadline
		<-ctx.Done()
		return ctx.Err()
	}
	errs := metricErrors.WithLabelValues("slow_admit")
	before := testutil.ToFloat64(errs)
	for i := range 5 {
		start := time.Now()
		if err := f.Do("slow_admit", late); !errors.Is(err, ErrDown) {
			t.Fatalf("a late answer: %v, want the storage unavailable", err)
		}
		if took := time.Since(start); took > time.Second {
			t.Fatalf("a request's operation waited %v; its timeout is 20ms", took)
		}
		if st := f.BreakerState(); st != gobreaker.StateClosed || !f.Up() {
			t.Fatalf("after %d late answers: breaker %v, up %v; want closed and up", i+1, st, f.Up())
		}
	}
	// a late answer in the real client too: Redis frozen for one operation
	srv.Stop()
	err = f.Do("slow_admit", func(ctx context.Context) error { return f.Redis.Get(ctx, "slow:x").Err() })
	srv.Continue()
	if !errors.Is(err, ErrDown) || f.BreakerState() != gobreaker.StateClosed || !f.Up() {
		t.Fatalf("a frozen Redis's late answer: %v, breaker %v, up %v; want a failed request, closed and up", err, f.BreakerState(), f.Up())
	}
	if got := testutil.ToFloat64(errs) - before; got != 6 {
		t.Fatalf("relay_storage_errors_total{op=slow_admit} grew by %v, want 6", got)
	}
	if n := logs.FilterMessageSnippet("storage unreachable").Len(); n != 0 {
		t.Fatalf("%d lines say the storage is unreachable after late answers", n)
	}
	if err := f.Do("slow_admit", func(ctx context.Context) error { return f.Redis.Get(ctx, "slow:x").Err() }); err != nil {
		t.Fatalf("Redis answered again: %v", err)
	}

	for range 3 { // what runs off the requests' paths finds Redis gone
		start := time.Now()
		if err := f.Background("slow_renew", late); !errors.Is(err, ErrDown) {
			t.Fatalf("a late answer off the requests' paths: %v", err)
		}
		if took := time.Since(start); took < 200*time.Millisecond {
			t.Fatalf("an operation off the requests' paths gave up after %v, want its longer timeout", took)
		}
	}
	if st := f.BreakerState(); st != gobreaker.StateOpen || f.Up() {
		t.Fatalf("after 3 late answers off the requests' paths: breaker %v, up %v; want open and down", st, f.Up())
	}
	if n := logs.FilterMessageSnippet("storage unreachable").Len(); n != 1 {
		t.Fatalf("%d lines say the storage is unreachable, want 1", n)
	}
	tried := false
	if err := f.Do("slow_admit", func(context.Context) error { tried = true; return nil }); !errors.Is(err, ErrDown) || tried {
		t.Fatalf("with the breaker open a request's operation: %v, tried %v; want failed at once", err, tried)
	}
}

func TestModuleVersion(t *testing.T) {
	const module = "github.com/caddy-relay/relay"
	vcs := []debug.BuildSetting{{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "true"}}
	for _, tt := range []struct {
		name string
		bi   *debug.BuildInfo
		want string
	}{
		{"no build info", nil, "(devel)"},
		{"a dependency (xcaddy)", &debug.BuildInfo{Main: debug.Module{Path: "caddy", Version: "(devel)"},
			Deps: []*debug.Module{{Path: module, Version: "v1.4.0"}}, Settings: vcs}, "v1.4.0"},
		{"a dependency replaced", &debug.BuildInfo{Deps: []*debug.Module{{Path: module, Version: "v1.4.0", Replace: &debug.Module{Path: "../relay", Version: ""}}}}, "v1.4.0"},
		{"the main module, stamped", &debug.BuildInfo{Main: debug.Module{Path: module, Version: "v1.5.0"}}, "v1.5.0"},
		{"the main module, its commit", &debug.BuildInfo{Main: debug.Module{Path: module, Version: "(devel)"}, Settings: vcs}, "0123456789ab+dirty"},
		{"go run", &debug.BuildInfo{Main: debug.Module{Path: module, Version: "(devel)"}}, "(devel)"},
	} {
		if got := ModuleVersion(tt.bi); got != tt.want {
			t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
		}
	}
}

// TestAnOperationBegunBeforeAnOutageDoesNotEndIt: an operation that began
// while Redis was up and answers after the relay said it is unreachable
// (its breaker opened meanwhile) says nothing of now: the relay stays down,
// with one line, until an operation begun since answers.
func TestAnOperationBegunBeforeAnOutageDoesNotEndIt(t *testing.T) {
	srv := redistest.Start(t)
	f := quietFleet(t, srv.Addr, "flap:")
	core, logs := observer.New(zapcore.InfoLevel)
	f.SetLogger(zap.New(core))
	var ups [2]atomic.Int32 // two concerns' syncs, each run once Redis is back
	for i := range ups {
		f.OnUp(func() { ups[i].Add(1) })
	}
	release, slow := heldOperation(f.Do)
	fail := errors.New("no answer")
	for range 3 { // the breaker opens
		if err := f.Do("admit", func(context.Context) error { return fail }); err == nil {
			t.Fatal("a failed operation succeeded")
		}
	}
	if f.Up() || f.BreakerState() != gobreaker.StateOpen {
		t.Fatalf("after 3 failures: up %v, breaker %v; want down and open", f.Up(), f.BreakerState())
	}
	close(release)
	if err := <-slow; err != nil {
		t.Fatalf("the operation begun before the outage: %v", err)
	}
	if f.Up() {
		t.Fatal("an operation begun before the outage ended it")
	}
	if n := logs.FilterMessageSnippet("storage reachable again").Len(); n != 0 {
		t.Fatalf("%d lines say the storage is back while its breaker is open", n)
	}
	waitFor(t, "the breaker lets an operation try", 3*time.Second, func() bool { return f.BreakerState() == gobreaker.StateHalfOpen })
	if err := f.Do("renew", func(context.Context) error { return nil }); err != nil || !f.Up() {
		t.Fatalf("an operation begun since the outage answered (err %v): up %v, want true", err, f.Up())
	}
	if n := logs.FilterMessageSnippet("storage unreachable").Len(); n != 1 {
		t.Fatalf("%d lines say the storage is unreachable, want 1", n)
	}
	if n := logs.FilterMessageSnippet("storage reachable again").Len(); n != 1 {
		t.Fatalf("%d lines say the storage is back, want 1", n)
	}
	if a, b := ups[0].Load(), ups[1].Load(); a != 1 || b != 1 {
		t.Fatalf("the syncs added with OnUp ran %d and %d times once Redis was back, want 1 and 1", a, b)
	}
}
