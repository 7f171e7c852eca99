package relay

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// gatedUpstream answers each request once its gate opens; it records the
// order requests arrived in (by their "metadata" id) and its peak
// concurrency.
type gatedUpstream struct {
	*fakeupstream.Upstream
	mu       sync.Mutex
	order    []string
	inflight atomic.Int64
	peak     atomic.Int64
	gate     chan struct{}
	arrived  chan struct{}
}

func newGatedUpstream(t *testing.T) *gatedUpstream {
	g := &gatedUpstream{gate: make(chan struct{}), arrived: make(chan struct{}, 100)}
	g.Upstream = fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := g.inflight.Add(1)
		defer g.inflight.Add(-1)
		for p := g.peak.Load(); n > p && !g.peak.CompareAndSwap(p, n); p = g.peak.Load() {
		}
		body := mustRead(r)
		id := body[strings.Index(body, `"user_id":"`)+11:]
		g.mu.Lock()
		g.order = append(g.order, id[:strings.Index(id, `"`)])
		g.mu.Unlock()
		g.arrived <- struct{}{}
		select {
		case <-g.gate:
		case <-r.Context().Done():
			return
		}
		fakeupstream.Message("ok")(w, r)
	}))
	return g
}

func (g *gatedUpstream) arrivals() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.order...)
}

func bodyWithID(id string) string {
	return `{"model":"claude-sonnet-4-5","max_tokens":1,"metadata":{"user_id":"` + id + `"},"messages":[{"role":"user","content":"Hi"}]}`
}

// queueDepth reads relay_queue_depth from /metrics.
func queueDepth(t *testing.T, group, class string) float64 {
	mf, _ := scrape(t)
	return value(mf, "relay_queue_depth", "group="+group, "priority="+class)
}

func TestRealtimeOvertakesQueuedBatch(t *testing.T) {
	up := newGatedUpstream(t)
	startRelay(t, channelBlock("prio-ch", up.URL, "concurrency 1")+
		"\t\tkey sk-prio-batch prio {\n\t\t\tpriority batch\n\t\t}\n\t\tkey sk-prio-rt prio {\n\t\t\tpriority realtime\n\t\t}\n"+
		"\t\tgroup prio {\n\t\t\tchannels prio-ch\n\t\t}\n")

	var wg sync.WaitGroup
	statuses := make(chan int, 20)
	post := func(key, id string) {
		defer wg.Done()
		r, err := do("POST", "/v1/messages", key, bodyWithID(id))
		if err != nil {
			t.Error(err)
		}
		statuses <- r.status
	}
	wg.Add(1)
	go post("sk-prio-batch", "holder") // takes the one slot and holds it
	<-up.arrived
	for i := 1; i <= 10; i++ {
		wg.Add(1)
		go post("sk-prio-batch", fmt.Sprintf("batch-%d", i))
		waitFor(t, "batch request queued", 30*time.Second, func() bool { return queueDepth(t, "prio", "batch") == float64(i) })
	}
	wg.Add(1)
	go post("sk-prio-rt", "realtime")
	waitFor(t, "realtime request queued", 30*time.Second, func() bool { return queueDepth(t, "prio", "realtime") == 1 })

	close(up.gate) // every request answers at once from now on
	wg.Wait()
	close(statuses)
	for s := range statuses {
		if s != 200 {
			t.Errorf("a queued request got %d", s)
		}
	}
	want := []string{"holder", "realtime"}
	for i := 1; i <= 10; i++ {
		want = append(want, fmt.Sprintf("batch-%d", i))
	}
	if got := up.arrivals(); strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("served in order %v\nwant %v (realtime next, then batch oldest first)", got, want)
	}
	if p := up.peak.Load(); p != 1 {
		t.Errorf("peak concurrency %d with concurrency 1", p)
	}
}

func TestQueueLimitsAnswer429(t *testing.T) {
	up := newGatedUpstream(t)
	startRelay(t, channelBlock("ql-ch", up.URL, "concurrency 1")+
		"\t\tkey "+clientKey+" ql {\n\t\t\tpriority batch\n\t\t}\n"+
		"\t\tgroup ql {\n\t\t\tchannels ql-ch\n\t\t\tmax_queue 2\n\t\t\tmax_wait batch 6s\n\t\t}\n")
	defer close(up.gate)
	mf, _ := scrape(t) // the counters are process-wide: compare with before
	limitedBefore := max(value(mf, "relay_rate_limited_total", "key=key-"+keyNameHash(clientKey), "scope=queue"), 0)
	waitsBefore := max(value(mf, "relay_queue_wait_seconds", "group=ql", "priority=batch"), 0)

	go func() { _, _ = do("POST", "/v1/messages", clientKey, bodyWithID("holder")) }()
	<-up.arrived
	results := make(chan reply, 2)
	for i := 0; i < 2; i++ {
		go func(i int) {
			r, err := do("POST", "/v1/messages", clientKey, bodyWithID(fmt.Sprintf("q%d", i)))
			if err != nil {
				t.Error(err)
			}
			results <- r
		}(i)
		waitFor(t, "queued", 5*time.Second, func() bool { return queueDepth(t, "ql", "batch") == float64(i+1) })
	}
	// the queue is full: refused at once (max_wait leaves a loaded machine
	// room to have queued both before the first gives up)
	r := message(t, bodyWithID("overflow"))
	wantRelayError(t, r, 429, "rate_limit_error", "queue_timeout")
	if !strings.Contains(string(r.body), "queue is full") {
		t.Errorf("the third request was not refused for a full queue: %s", r.body)
	}
	if r.header.Get("Retry-After") == "" {
		t.Errorf("queue full: no retry-after")
	}
	// the queued ones give up after max_wait
	start := time.Now()
	for i := 0; i < 2; i++ {
		r := <-results
		wantRelayError(t, r, 429, "rate_limit_error", "queue_timeout")
		if r.header.Get("Retry-After") == "" || !strings.Contains(string(r.body), "max_wait") {
			t.Errorf("queue timeout: %v %s", r.header, r.body)
		}
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("max_wait 6s took %v", d)
	}
	mf, _ = scrape(t)
	if v := value(mf, "relay_rate_limited_total", "key=key-"+keyNameHash(clientKey), "scope=queue") - limitedBefore; v != 3 {
		t.Errorf("relay_rate_limited_total{scope=queue} grew by %v, want 3", v)
	}
	if v := value(mf, "relay_queue_wait_seconds", "group=ql", "priority=batch") - waitsBefore; v != 2 {
		t.Errorf("relay_queue_wait_seconds count grew by %v, want 2", v)
	}
	if up.Hits() != 1 {
		t.Errorf("refused requests reached the upstream: %d", up.Hits())
	}
}

func keyNameHash(secret string) string {
	d, _, _ := keyDigest(secret)
	return fmt.Sprintf("%x", d[:8])
}

func TestUpstreamQuotaCoolsTheModelClassUntilReset(t *testing.T) {
	reset := time.Now().Add(2 * time.Second).UTC().Truncate(time.Second).Add(time.Second)
	a := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody("m", "a", fakeupstream.Usage{}),
		"Anthropic-Ratelimit-Requests-Remaining", "0", "Anthropic-Ratelimit-Requests-Reset", reset.Format(time.RFC3339),
		"Anthropic-Ratelimit-Tokens-Remaining", "120000"))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("quota-a", a.URL, "priority 1")+channelBlock("quota-b", b.URL, "priority 2")+keyAndGroup("quota", "quota-a quota-b"))

	if r := message(t, simpleBody); a.Hits() != 1 || r.status != 200 {
		t.Fatalf("first request should use quota-a: %d", r.status)
	}
	st := channels(t)["quota-a"]
	if c := st.Classes["sonnet"]; !c.Until.Equal(reset) || c.Reason != "anthropic-ratelimit-requests-remaining: 0" || st.State != stateCooldown || st.Busy {
		t.Fatalf("quota-a after remaining 0: %+v (its model's class cooling until the reset)", st)
	}
	if r := message(t, simpleBody); a.Hits() != 1 || b.Hits() != 1 || r.status != 200 {
		t.Errorf("while its quota is spent, quota-a must be skipped: a=%d b=%d", a.Hits(), b.Hits())
	}
	waitFor(t, "quota-a free after its reset", 10*time.Second, func() bool { return channels(t)["quota-a"].State == stateHealthy })
	if time.Now().Before(reset) {
		t.Errorf("quota-a came back before its reset")
	}
	if message(t, simpleBody); a.Hits() != 2 {
		t.Errorf("after the reset quota-a must serve again: hits %d", a.Hits())
	}
}

func TestChannelConcurrencyIsNeverExceeded(t *testing.T) {
	up := newGatedUpstream(t)
	startRelay(t, channelBlock("conc2-ch", up.URL, "concurrency 2")+keyAndGroup("conc2", "conc2-ch"))
	var wg sync.WaitGroup
	statuses := make(chan int, 10)
	for i := 0; i < 10; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			r, err := do("POST", "/v1/messages", clientKey, bodyWithID(fmt.Sprint(i)))
			if err != nil {
				t.Error(err)
			}
			statuses <- r.status
		}(i)
	}
	<-up.arrived
	<-up.arrived
	waitFor(t, "the other 8 queued", 5*time.Second, func() bool { return queueDepth(t, "conc2", "normal") == 8 })
	if n := up.inflight.Load(); n != 2 {
		t.Errorf("in flight at the upstream: %d, want 2", n)
	}
	close(up.gate)
	wg.Wait()
	close(statuses)
	for s := range statuses {
		if s != 200 {
			t.Errorf("status %d", s)
		}
	}
	if p := up.peak.Load(); p != 2 || up.Hits() != 10 {
		t.Errorf("peak concurrency %d (want 2), hits %d (want 10)", p, up.Hits())
	}
}

func TestQueueOrder(t *testing.T) {
	var q waitQueue
	now := time.Now()
	var batch []*waiter
	for i := 0; i < 3; i++ {
		w, _ := q.enqueue(priorityBatch, 10, now)
		batch = append(batch, w)
	}
	normal, _ := q.enqueue(priorityNormal, 10, now)
	if q.isBest(batch[0]) || !q.isBest(normal) {
		t.Fatal("a normal waiter goes before batch waiters that came first")
	}
	if !q.ahead(priorityBatch) || !q.ahead(priorityNormal) || q.ahead(priorityRealtime) {
		t.Error("ahead() must count waiters of the same class or better only")
	}
	q.leave(normal)
	for i, w := range batch {
		if !q.isBest(w) {
			t.Fatalf("batch waiter %d should be next (FIFO within a class)", i)
		}
		q.leave(w)
	}
	for i := 0; i < 2; i++ {
		q.enqueue(priorityNormal, 2, now)
	}
	if _, ok := q.enqueue(priorityRealtime, 2, now); ok {
		t.Error("max_queue must bound the queue")
	}
}

func TestQueueWaitTimesOutAndWakes(t *testing.T) {
	var q waitQueue
	clock := &fakeClock{t: time.Now()}
	w, _ := q.enqueue(priorityNormal, 10, clock.now())
	// a wake-up makes it try again at once
	q.wakeBest()
	if retry, err := q.wait(context.Background(), w, time.Time{}, clock.now().Add(time.Hour), clock.now); !retry || err != nil {
		t.Fatalf("woken: %v %v", retry, err)
	}
	// past the deadline: the queue timeout
	if _, err := q.wait(context.Background(), w, time.Time{}, clock.now(), clock.now); !errors.Is(err, errQueueTimeout) {
		t.Fatalf("past the deadline: %v", err)
	}
	// a client that leaves ends the wait at once
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := q.wait(ctx, w, time.Time{}, clock.now().Add(time.Hour), clock.now); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled: %v", err)
	}
}

// onceThen answers the first request with first and the others with then.
func onceThen(first, then http.HandlerFunc) http.HandlerFunc {
	var n atomic.Int64
	return func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			first(w, r)
			return
		}
		then(w, r)
	}
}

func TestA429WithAKnownResetQueuesUntilIt(t *testing.T) {
	up := fakeupstream.New(t, onceThen(
		fakeupstream.Error(429, "rate_limit_error", "slow down", "Retry-After-Ms", "400"),
		fakeupstream.Message("after the reset")))
	startRelay(t, channelBlock("reset-q", up.URL)+
		"\t\tkey "+clientKey+" reset-q {\n\t\t\tpriority realtime\n\t\t}\n\t\tgroup reset-q {\n\t\t\tchannels reset-q\n\t\t}\n")
	if r := message(t, simpleBody); r.status != 429 {
		t.Fatalf("the upstream's 429 should reach the client: %d %s", r.status, r.body)
	}
	// the only channel is out until a reset 400ms away, well within the
	// realtime class's max_wait (10s): the request waits for it
	start := time.Now()
	r := message(t, simpleBody)
	if took := time.Since(start); r.status != 200 || took < 300*time.Millisecond || took > 5*time.Second {
		t.Errorf("got %d after %v, want 200 once the reset came (about 400ms): %s", r.status, took, r.body)
	}
	if up.Hits() != 2 {
		t.Errorf("upstream hits %d, want 2: nothing before the reset", up.Hits())
	}
}

func TestAnUpstreamResetBeyondMaxWaitAnswersAtOnce(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Error(429, "rate_limit_error", "slow down", "Retry-After", "60"))
	startRelay(t, channelBlock("reset-far", up.URL)+
		"\t\tkey "+clientKey+" reset-far {\n\t\t\tpriority realtime\n\t\t}\n\t\tgroup reset-far {\n\t\t\tchannels reset-far\n\t\t\tmax_wait realtime 1s\n\t\t}\n")
	message(t, simpleBody)
	start := time.Now()
	r := message(t, simpleBody)
	// in the upstream's words: it is a rate limit, not the relay's failure
	wantRelayError(t, r, 429, "rate_limit_error", "no_healthy_channel")
	if took := time.Since(start); took > 500*time.Millisecond {
		t.Errorf("a reset 60s away with max_wait 1s: answered after %v, want at once", took)
	}
	if ra, _ := strconv.Atoi(r.header.Get("Retry-After")); ra < 55 || ra > 60 {
		t.Errorf("retry-after %q, want the reset's, about 60", r.header.Get("Retry-After"))
	}
}
