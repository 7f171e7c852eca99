package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	vegeta "github.com/tsenart/vegeta/v12/lib"
)

// reloadOptions is what the reload-under-load mode runs: rate requests a
// second for duration, half of them streams of streamLength, and a config
// reload every second.
type reloadOptions struct {
	duration     time.Duration
	rate         int
	streamLength time.Duration
	// chaos adds a second channel, never left cooling nor broken open,
	// whose upstream fails every fifth request before its content (a 529,
	// or a stream cut after message_start), which the relay must fail
	// over from invisibly (but for x-relay-attempts: 2)
	chaos bool
	logf  func(format string, args ...any)
}

// reloadResult is what the reload-under-load mode measured.
type reloadResult struct {
	requests, streams uint64   // sent, of which streams
	failed            []string // failed or cut replies, by error
	failedCount       uint64
	// requests sent again after their connection failed before any
	// response, as the Anthropic SDKs do: a kept-alive connection that
	// Caddy closes as a reload replaces its server
	retried             int64
	reloads, badReloads int      // config loads, and those that failed
	reloadErrors        []string // why they failed
	// upstream connections opened during the load, after the warm-up
	upstreamConns int64
	// goroutines of the caddy process at rest before the load (after the
	// warm-up) and after it
	goroutinesBefore, goroutinesAfter int
	// the caddy process's resident memory, sampled every 10s under load:
	// the first sample and the last
	rssFirst, rssLast int64
	chaosFailures     int64 // failures the chaos upstream served
}

// rssGrowth is how much the caddy process's resident memory may grow from
// its first sample under load to its last: the heap settles in the first
// minutes, so a long run that grows more than this is leaking.
const rssGrowth = 1.5

// retryBeforeResponse sends a request again, at most twice, when its
// round trip failed before any response (a connection reset or closed as
// the request went out), after half a second and then a second, as the
// Anthropic SDKs retry connection errors (two retries, from 0.5s, doubling):
// a reload closes every idle kept-alive connection at once, so a retry sent
// at once would take the next dying one. A reply cut after its headers is
// not retried, and fails the run.
type retryBeforeResponse struct {
	next    http.RoundTripper
	retried *atomic.Int64
}

// sdkRetries and sdkRetryDelay are the Anthropic SDKs' defaults.
const (
	sdkRetries    = 2
	sdkRetryDelay = 500 * time.Millisecond
)

// RoundTrip implements http.RoundTripper.
func (t *retryBeforeResponse) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := t.next.RoundTrip(r)
	for i := range sdkRetries {
		if err == nil || r.GetBody == nil {
			break
		}
		select {
		case <-r.Context().Done():
			return nil, err
		case <-time.After(sdkRetryDelay << i):
		}
		body, gerr := r.GetBody()
		if gerr != nil {
			return nil, err
		}
		again := r.Clone(r.Context())
		again.Body = body
		t.retried.Add(1)
		resp, err = t.next.RoundTrip(again)
	}
	return resp, err
}

// goroutineSlack is how many more goroutines the caddy process may hold
// at rest after the load than before it, besides one per reload: enough
// for the kept-alive connections of a busier moment (each holds one or
// two), not for a leak of one or more per reload.
const goroutineSlack = 40

// ok reports whether the run met its checks, and if not, why.
func (r reloadResult) ok() error {
	var why []string
	if r.failedCount > 0 {
		why = append(why, fmt.Sprintf("%d of %d requests failed or were cut: %q", r.failedCount, r.requests, r.failed))
	}
	if r.badReloads > 0 {
		why = append(why, fmt.Sprintf("%d of %d reloads failed: %q", r.badReloads, r.reloads, r.reloadErrors))
	}
	if r.reloads == 0 {
		why = append(why, "no reload happened")
	}
	if growth := r.goroutinesAfter - r.goroutinesBefore; growth > r.reloads+goroutineSlack {
		why = append(why, fmt.Sprintf("goroutines grew by %d (%d -> %d) over %d reloads", growth, r.goroutinesBefore, r.goroutinesAfter, r.reloads))
	}
	if r.upstreamConns > int64(r.requests/5)+10 {
		why = append(why, fmt.Sprintf("%d upstream connections opened for %d requests: reloads drop them", r.upstreamConns, r.requests))
	}
	if r.rssFirst > 0 && float64(r.rssLast) > rssGrowth*float64(r.rssFirst) {
		why = append(why, fmt.Sprintf("resident memory grew from %d MB to %d MB under the same load", r.rssFirst>>10, r.rssLast>>10))
	}
	if len(why) == 0 {
		return nil
	}
	return fmt.Errorf("reload under load: %s", strings.Join(why, "; "))
}

// String renders the result for the log and docs/performance.md.
func (r reloadResult) String() string {
	chaos := ""
	if r.chaosFailures > 0 {
		chaos = fmt.Sprintf(", %d upstream failures failed over", r.chaosFailures)
	}
	return fmt.Sprintf("%d requests (%d streams), %d failed or cut, %d sent again after a connection error before any response%s; %d reloads, %d failed; %d upstream connections opened; goroutines at rest %d before, %d after; resident memory under load %d MB first, %d MB last",
		r.requests, r.streams, r.failedCount, r.retried, chaos, r.reloads, r.badReloads, r.upstreamConns, r.goroutinesBefore, r.goroutinesAfter, r.rssFirst>>10, r.rssLast>>10)
}

// reloadCaddyfile is the relay of target (c) with an admin endpoint to load
// configs through, and a second key that differs from one reload to the
// next, so that every reload loads a config that changed.
const reloadCaddyfile = `{
	admin $ADMIN
	persist_config off
}
:$PORT {
	relay {
		key sk-bench bench
		key sk-bench-reload-abcdefghijklmnop-$GEN bench
		channel upstream {
			url http://$UPSTREAM
			api_key sk-upstream
		}
		group bench {
			channels upstream
		}
	}
}
`

// chaosChannel is the second channel of the chaos mode, and what its group
// becomes: a retry a request, whatever the retry budget.
const (
	chaosChannel = `		channel flaky {
			url http://$FLAKY
			api_key sk-upstream
			cooldown 1ns
			max_cooldown 1ns
			breaker {
				min_requests 1000000000
			}
		}
		group bench {`
	chaosGroup = `			channels upstream flaky
			retries 1
			retry_budget 100% 1000000/s`
)

// flakyUpstream is pacedUpstream failing every fifth request before its
// content: with a 529 overloaded error, or for a stream, by ending it
// after message_start. failures counts them.
func flakyUpstream(streamLength time.Duration, failures *atomic.Int64) http.HandlerFunc {
	paced := pacedUpstream(streamLength)
	start := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 1})[0]
	var n atomic.Int64
	return func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1)%5 != 0 {
			paced(w, r)
			return
		}
		failures.Add(1)
		body, _ := io.ReadAll(r.Body)
		if bytes.Contains(body, []byte(`"stream":true`)) {
			fakeupstream.StartStream(w)
			fakeupstream.WriteEvent(w, start)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(529)
		_, _ = io.WriteString(w, `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`)
	}
}

// pacedUpstream answers non-streaming requests at once and streams over
// streamLength: the 20 events of Fast, spread evenly, so that a stream
// spans a reload or more.
func pacedUpstream(streamLength time.Duration) http.HandlerFunc {
	fast := fakeupstream.Fast()
	deltas := make([]string, 13)
	for i := range deltas {
		deltas[i] = "tok "
	}
	events := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 2500, OutputTokens: 13}, deltas...)
	gap := streamLength / time.Duration(len(events))
	return func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !bytes.Contains(body, []byte(`"stream":true`)) {
			r.Body = io.NopCloser(bytes.NewReader(body))
			fast(w, r)
			return
		}
		fakeupstream.StartStream(w)
		for i, ev := range events {
			if i > 0 {
				select {
				case <-r.Context().Done():
					return
				case <-time.After(gap):
				}
			}
			if !fakeupstream.WriteEvent(w, ev) {
				return
			}
		}
	}
}

// runReload serves the relay of reloadCaddyfile in front of a paced
// upstream, warms it up, then sends o.rate requests a second (half of them
// streams) for o.duration while loading a changed config every second, and
// checks that no request failed, that reloads kept the upstream
// connections and that goroutines did not grow.
func runReload(ctx context.Context, o reloadOptions) (reloadResult, error) {
	var res reloadResult
	if err := raiseFileLimit(); err != nil {
		return res, err
	}
	dir, bin, err := buildInTemp(ctx, o.logf)
	if dir != "" {
		defer os.RemoveAll(dir)
	}
	if err != nil {
		return res, err
	}
	up := fakeupstream.Start(pacedUpstream(o.streamLength), false, upstreamKeys)
	defer up.Close()
	var chaosFailures atomic.Int64
	template := reloadCaddyfile
	flakyAddr := ""
	if o.chaos {
		flaky := fakeupstream.Start(flakyUpstream(o.streamLength, &chaosFailures), false, upstreamKeys)
		defer flaky.Close()
		flakyAddr = flaky.Listener.Addr().String()
		template = strings.Replace(template, "\t\tgroup bench {\n\t\t\tchannels upstream", chaosChannel+"\n"+chaosGroup, 1)
	}
	siteAddr, err := freeAddr()
	if err != nil {
		return res, err
	}
	adminAddr, err := freeAddr()
	if err != nil {
		return res, err
	}
	_, port, _ := strings.Cut(siteAddr, ":")
	config := func(gen int) string {
		return strings.NewReplacer("$ADMIN", adminAddr, "$PORT", port, "$UPSTREAM", up.Listener.Addr().String(),
			"$FLAKY", flakyAddr, "$GEN", strconv.Itoa(gen%2)).Replace(template)
	}
	proc, err := startCaddy(ctx, bin, dir, config(0))
	if err != nil {
		return res, err
	}
	defer proc.stop()
	url := "http://" + siteAddr + messagesPath

	warmUp := min(3*time.Second, o.duration)
	o.logf("warm-up: %s at %d req/s", warmUp, o.rate)
	mixedLoad(ctx, url, o.rate, warmUp, o.chaos, &reloadResult{})
	if res.goroutinesBefore, err = goroutines(ctx, adminAddr); err != nil {
		return res, err
	}
	connsBefore := up.Conns()

	o.logf("load: %s at %d req/s, a reload every second", o.duration, o.rate)
	loadDone := make(chan struct{})
	go func() {
		defer close(loadDone)
		mixedLoad(ctx, url, o.rate, o.duration, o.chaos, &res)
	}()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for gen := 1; ; gen++ {
		select {
		case <-tick.C:
			if gen%10 == 0 {
				if rss, err := proc.rssKiB(); err == nil {
					res.rssFirst = cmp.Or(res.rssFirst, rss)
					res.rssLast = rss
				}
			}
			res.reloads++
			if err := postLoad(ctx, adminAddr, "text/caddyfile", []byte(config(gen))); err != nil {
				res.badReloads++
				res.reloadErrors = append(res.reloadErrors, err.Error())
			}
			continue
		case <-loadDone:
		}
		break
	}
	res.upstreamConns = up.Conns() - connsBefore
	res.chaosFailures = chaosFailures.Load()
	if o.chaos && res.chaosFailures == 0 {
		return res, errors.New("chaos: the flaky channel served no failure")
	}
	if res.goroutinesAfter, err = goroutines(ctx, adminAddr); err != nil {
		return res, err
	}
	return res, ctx.Err()
}

// mixedLoad sends rate requests a second to url for d, half of them
// streams, and adds what it sent and what failed to res. Both halves go
// out over their own kept-alive connections, which it closes at the end,
// and it waits a moment for the caddy process to let go of them.
func mixedLoad(ctx context.Context, url string, rate int, d time.Duration, failsOver bool, res *reloadResult) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	var retried atomic.Int64
	for _, stream := range []bool{false, true} {
		wg.Go(func() {
			client := keepAliveTransport(maxFixedRateWorkers)
			defer client.CloseIdleConnections()
			rt := &retryBeforeResponse{next: client, retried: &retried}
			atk := vegeta.NewAttacker(vegeta.Client(&http.Client{Transport: rt, Timeout: vegeta.DefaultTimeout}),
				vegeta.Workers(fixedRateWorkers), vegeta.MaxWorkers(maxFixedRateWorkers))
			defer context.AfterFunc(ctx, func() { atk.Stop() })()
			tgt := vegeta.Target{Method: http.MethodPost, URL: url, Body: messageBody(stream), Header: requestHeader()}
			pacer := vegeta.Rate{Freq: max(1, rate/2), Per: time.Second}
			for r := range atk.Attack(vegeta.NewStaticTargeter(tgt), pacer, d, "reload") {
				checkReply(r, stream, failsOver)
				mu.Lock()
				res.requests++
				if stream {
					res.streams++
				}
				if r.Code != http.StatusOK {
					res.failedCount++
					if len(res.failed) < 10 {
						res.failed = append(res.failed, cmp.Or(r.Error, "status "+strconv.Itoa(int(r.Code))))
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	res.retried += retried.Load()
	select {
	case <-ctx.Done():
	case <-time.After(500 * time.Millisecond):
	}
}

// goroutines is the number of goroutines of the caddy process whose admin
// endpoint is at adminAddr.
func goroutines(ctx context.Context, adminAddr string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+adminAddr+"/debug/pprof/goroutine?debug=1", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	first, _, _ := strings.Cut(readPrefix(resp.Body, 200), "\n")
	n, err := strconv.Atoi(strings.TrimPrefix(first, "goroutine profile: total "))
	if err != nil {
		return 0, fmt.Errorf("goroutine profile: %q", first)
	}
	return n, nil
}

// readPrefix reads up to n bytes of r.
func readPrefix(r io.Reader, n int64) string {
	b, _ := io.ReadAll(io.LimitReader(r, n))
	return string(b)
}

// reloadReport is the markdown paragraph of a reload-under-load run.
func reloadReport(o reloadOptions, r reloadResult) string {
	verdict := "met"
	if err := r.ok(); err != nil {
		verdict = "**MISSED**: " + err.Error()
	}
	return fmt.Sprintf("Reload under load, %s at %d req/s (half streams of %s), a config reload every second: %s. Checks: %s.\n",
		o.duration, o.rate, o.streamLength, r, verdict)
}
