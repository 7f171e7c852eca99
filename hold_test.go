package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/money"
)

// gate is an upstream that holds every request until told to answer it:
// each request arrives on arrived, and answers when a value comes on
// answer (closed: every request answers at once), or leaves with its
// client. Each answer reports 10 output tokens.
type gate struct {
	arrived chan struct{}
	answer  chan struct{}
	open    sync.Once
	mu      sync.Mutex
	last    []byte          // the last request's body
	waiting []chan struct{} // one for each request held, in the order they came
}

func newGate() *gate { return &gate{arrived: make(chan struct{}, 100), answer: make(chan struct{})} }

// openAll lets every request through, now and from now on.
func (g *gate) openAll() { g.open.Do(func() { close(g.answer) }) }

func (g *gate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body) // read to its end: the server then notices a client that leaves
	mine := make(chan struct{})
	g.mu.Lock()
	g.last = body
	g.waiting = append(g.waiting, mine)
	g.mu.Unlock()
	g.arrived <- struct{}{}
	select {
	case <-mine:
	case <-g.answer:
	case <-r.Context().Done():
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(fakeupstream.MessageBody("m-hold", "ok", fakeupstream.Usage{OutputTokens: 10}))
}

// answerFirst answers the request held longest (a value on answer goes to
// whichever held request takes it first).
func (g *gate) answerFirst() {
	g.mu.Lock()
	defer g.mu.Unlock()
	close(g.waiting[0])
	g.waiting = g.waiting[1:]
}

// arrival waits for the next request at the gate.
func (g *gate) arrival(t *testing.T, what string) {
	t.Helper()
	select {
	case <-g.arrived:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: no request reached the upstream", what)
	}
}

// holdRelay is a relay with one key of budgets, on upstream h; the key,
// its group and its channel are named after name, made unique in the
// process (spend is kept by name), and its secret is "sk-" and that name.
// Its model m-hold costs nothing for input and $0.01 an output token: a
// request holds $0.01 per max_tokens, and a gate's answer costs $0.10.
func holdRelay(t *testing.T, name *string, budgets []string, h http.Handler, group func(*Group)) (*Relay, *money.Account) {
	t.Helper()
	*name += "-" + strconv.FormatInt(holdRelays.Add(1), 10)
	up := fakeupstream.New(t, h) // as strict as the real API
	if g, ok := h.(*gate); ok {
		t.Cleanup(g.openAll) // before the upstream closes, whatever the test did
	}
	n := *name
	key := Key{Secret: "sk-" + n, Group: n, KeyOptions: KeyOptions{Name: n, Budgets: budgets}}
	ch := &Channel{Name: n + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	g := &Group{Name: n, Channels: []string{ch.Name}}
	if group != nil {
		group(g)
	}
	r := &Relay{Keys: []*Key{&key}, Channels: []*Channel{ch}, Groups: []*Group{g},
		Pricing: map[string]Price{"m-hold": {Input: 0, Output: 10_000}}}
	provisionHandler(t, r)
	for _, k := range r.keys {
		return r, k.state.spend
	}
	t.Fatal("no key")
	return nil, nil
}

// holdRelays numbers the relays of holdRelay.
var holdRelays atomic.Int64

// holdBody is a message of m-hold asking for up to maxTokens.
func holdBody(maxTokens int) string {
	return `{"model":"m-hold","max_tokens":` + strconv.Itoa(maxTokens) + `,"messages":[{"role":"user","content":"hi"}]}`
}

// sent is a request served in the background.
type sent struct {
	w      *httptest.ResponseRecorder
	done   chan struct{}
	cancel context.CancelFunc
}

// serveAsync serves a request of key with body on r in the background.
func serveAsync(t *testing.T, r *Relay, key, body string) *sent {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &sent{done: make(chan struct{}), cancel: cancel}
	req := newRequest(body, key).WithContext(ctx)
	go func() {
		defer close(s.done)
		s.w, _ = serveHandler(t, r, req)
	}()
	return s
}

// wait waits for the request's answer.
func (s *sent) wait(t *testing.T, what string) *httptest.ResponseRecorder {
	t.Helper()
	select {
	case <-s.done:
		return s.w
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: no answer", what)
		return nil
	}
}

// heldAndSpent is what GET /relay/keys says the key holds and spent
// today.
func heldAndSpent(t *testing.T, name string) (held, spent float64) {
	t.Helper()
	rows, _ := keyRows(t)
	row, ok := rows[name]
	if !ok {
		t.Fatalf("GET /relay/keys has no key %q", name)
	}
	return row.HeldUSD, row.SpendUSD["day"]
}

// queuedOn reports whether a request waits in the key's group's queue on
// the account's budget.
func queuedOn(r *Relay, name string, a *money.Account) bool {
	return r.groups[name].state.queue.aheadOn(priorityBatch, a)
}

// budgetError reads a relay error's type, code and message.
func budgetError(t *testing.T, w *httptest.ResponseRecorder) (typ, code, msg string) {
	t.Helper()
	var body struct {
		Error struct{ Type, Code, Message string }
	}
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil {
		t.Fatalf("%d %s: %v", w.Code, w.Body, err)
	}
	return body.Error.Type, body.Error.Code, body.Error.Message
}

// TestAHoldWaitsOnlyForHoldsInFlight holds two requests' worst cases
// against a $1 budget while their upstream is slow, then sends more: a
// request whose hold would fit once the holds in flight settle waits in the
// queue, and goes when one settles; a request whose hold does not fit
// beside what was spent is refused at once, retry-after to the day's end;
// a request that leaves while it waits holds nothing.
func TestAHoldWaitsOnlyForHoldsInFlight(t *testing.T) {
	g, name := newGate(), "hold-wait"
	r, acct := holdRelay(t, &name, []string{"1usd/day"}, g, nil)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 23, 0, 0, 0, time.UTC)}
	r.now = clock.now
	key := "sk-" + name

	a := serveAsync(t, r, key, holdBody(40)) // holds $0.40
	g.arrival(t, "A")
	b := serveAsync(t, r, key, holdBody(40)) // $0.80 held: fits
	g.arrival(t, "B")
	if held, spent := heldAndSpent(t, name); held != 0.8 || spent != 0 {
		t.Fatalf("two requests in flight: held %v, spent %v; want 0.80 held, nothing spent", held, spent)
	}

	// $0.40 more would make $1.20 held: it waits for the holds in flight
	c := serveAsync(t, r, key, holdBody(40))
	waitFor(t, "C queued on the budget", 5*time.Second, func() bool { return queuedOn(r, name, acct) })
	// $1.01 alone is more than the budget: refused at once
	w, _ := serveHandler(t, r, newRequest(holdBody(101), key))
	if typ, code, msg := budgetError(t, w); w.Code != 429 || typ != "rate_limit_error" || code != "budget_exceeded" || !strings.Contains(msg, "cannot afford") {
		t.Fatalf("a request that could never fit: %d %s", w.Code, w.Body)
	}
	if w.Header().Get("Retry-After") != "3600" || w.Header().Get("X-Should-Retry") != "false" {
		t.Errorf("refused at once: retry-after %q (want 3600, to midnight), x-should-retry %q", w.Header().Get("Retry-After"), w.Header().Get("X-Should-Retry"))
	}

	// A costs $0.10: $0.10 spent and $0.40 held leave room for C
	g.answerFirst()
	if w := a.wait(t, "A"); w.Code != 200 {
		t.Fatalf("A: %d %s", w.Code, w.Body)
	}
	g.arrival(t, "C, once A settled")
	if held, spent := heldAndSpent(t, name); held != 0.8 || spent != 0.1 {
		t.Fatalf("A settled, B and C in flight: held %v, spent %v; want 0.80 and 0.10", held, spent)
	}
	// $0.10 spent and $0.91 is more than $1, whatever settles: at once
	if w, _ := serveHandler(t, r, newRequest(holdBody(91), key)); w.Code != 429 || w.Header().Get("Retry-After") != "3600" {
		t.Fatalf("a request over what is left of the budget: %d %s", w.Code, w.Body)
	}
	// one that would fit once B or C settles waits; its client leaves
	d := serveAsync(t, r, key, holdBody(50))
	waitFor(t, "D queued on the budget", 5*time.Second, func() bool { return queuedOn(r, name, acct) })
	d.cancel()
	d.wait(t, "D, whose client left")
	if held, _ := heldAndSpent(t, name); held != 0.8 || queuedOn(r, name, acct) {
		t.Fatalf("a request that left the queue: held %v (want 0.80, B's and C's), still queued %v", held, queuedOn(r, name, acct))
	}

	g.openAll()
	for which, s := range map[string]*sent{"B": b, "C": c} {
		if w := s.wait(t, which); w.Code != 200 {
			t.Fatalf("%s: %d %s", which, w.Code, w.Body)
		}
	}
	if held, spent := heldAndSpent(t, name); held != 0 || spent < 0.2999 || spent > 0.3001 {
		t.Errorf("after all: held %v, spent %v; want nothing held, 0.30 spent", held, spent)
	}
	if !acct.Idle() {
		t.Error("the account still counts a hold in flight")
	}
}

// TestAHoldBecomesTheActualCost: a request holds its worst case while it
// runs, and when it ends the hold is gone and its cost spent.
func TestAHoldBecomesTheActualCost(t *testing.T) {
	g, name := newGate(), "hold-settle"
	r, _ := holdRelay(t, &name, []string{"5usd/month"}, g, nil)
	s := serveAsync(t, r, "sk-"+name, holdBody(300)) // holds $3
	g.arrival(t, "the request")
	rows, body := keyRows(t)
	if row := rows[name]; row.HeldUSD != 3 || row.SpendUSD["month"] != 0 || !strings.Contains(body, `"held_usd":3`) {
		t.Fatalf("in flight: %s", show(row))
	}
	g.answer <- struct{}{}
	if w := s.wait(t, "the request"); w.Code != 200 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	rows, body = keyRows(t)
	if row := rows[name]; row.HeldUSD != 0 || row.SpendUSD["month"] != 0.1 || row.RemainingUSD["month"] != 4.9 || !strings.Contains(body, `"held_usd":0`) {
		t.Fatalf("settled: %s; want nothing held and $0.10 spent", show(row))
	}
}

// TestAChatCompletionWithoutALimitHoldsTheModelsMaximumOutput: a Chat
// Completions request that sets no max_tokens asks the upstream for the
// model's maximum output, and holds that.
func TestAChatCompletionWithoutALimitHoldsTheModelsMaximumOutput(t *testing.T) {
	g, name := newGate(), "hold-chat"
	r, _ := holdRelay(t, &name, []string{"1usd/day"}, g, nil)
	req := httptest.NewRequest(http.MethodPost, PathChatCompletions, strings.NewReader(`{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer sk-"+name)
	req.Header.Set("Content-Type", "application/json")
	done := make(chan struct{})
	go func() {
		defer close(done)
		serveHandler(t, r, req)
	}()
	g.arrival(t, "the chat completion")
	g.mu.Lock()
	sent := string(g.last)
	g.mu.Unlock()
	// 64,000 output tokens at $15 per million, and a few input tokens at $6
	// (the 1-hour cache write)
	held, _ := heldAndSpent(t, name)
	if !strings.Contains(sent, `"max_tokens":64000`) || held < 0.96 || held > 0.961 {
		t.Errorf("held %v for a request that asked the upstream for %s; want the model's maximum output, 64000, held ($0.96 and its input)", held, sent)
	}
	g.openAll()
	<-done
}

// TestAHoldWaitsAtMostItsMaxWait: a request held up by holds in flight
// gets 429 budget_exceeded (not queue_timeout) when its class's max_wait
// passes.
func TestAHoldWaitsAtMostItsMaxWait(t *testing.T) {
	g, name := newGate(), "hold-maxwait"
	r, _ := holdRelay(t, &name, []string{"1usd/day"}, g, func(grp *Group) {
		grp.MaxWait = map[string]caddy.Duration{"normal": caddy.Duration(50 * time.Millisecond)}
	})
	key := "sk-" + name
	first := serveAsync(t, r, key, holdBody(80))
	defer first.cancel()
	g.arrival(t, "the first request")
	start := time.Now()
	w, _ := serveHandler(t, r, newRequest(holdBody(30), key))
	typ, code, msg := budgetError(t, w)
	if w.Code != 429 || typ != "rate_limit_error" || code != "budget_exceeded" || !strings.Contains(msg, "max_wait") || !strings.Contains(msg, "hold $0.80") {
		t.Fatalf("after max_wait: %d %s", w.Code, w.Body)
	}
	if took := time.Since(start); took < 50*time.Millisecond {
		t.Errorf("answered after %v, before its max_wait of 50ms", took)
	}
	if w.Header().Get("X-Should-Retry") != "false" {
		t.Errorf("x-should-retry %q", w.Header().Get("X-Should-Retry"))
	}
}

// TestAClientThatLeavesSettlesItsHold: a stream whose client leaves in
// the middle ends its hold; what it is charged is its cost, and nothing
// stays held.
func TestAClientThatLeavesSettlesItsHold(t *testing.T) {
	release, canceled := make(chan struct{}), make(chan struct{})
	defer close(release)
	evs := fakeupstream.StreamEvents("m-hold", fakeupstream.Usage{InputTokens: 10, OutputTokens: 3}, "one ", "two ", "three")
	name := "hold-leave"
	r, acct := holdRelay(t, &name, []string{"1usd/day"}, fakeupstream.Held(evs, 4, release, canceled), nil)
	ctx, cancel := context.WithCancel(context.Background())
	req := newRequest(`{"model":"m-hold","max_tokens":50,"stream":true,"messages":[{"role":"user","content":"hi"}]}`, "sk-"+name).WithContext(ctx)
	pr, pw := io.Pipe()
	done := make(chan struct{})
	go func() {
		defer close(done)
		w := &pipeWriter{h: http.Header{}, w: pw}
		_ = r.ServeHTTP(w, prepare(req, w), nil)
		_ = pw.Close()
	}()
	buf := make([]byte, 1)
	if _, err := pr.Read(buf); err != nil { // the stream reached the client
		t.Fatal(err)
	}
	if held, _ := heldAndSpent(t, name); held != 0.5 {
		t.Fatalf("streaming: held %v, want 0.50", held)
	}
	cancel()
	go func() { _, _ = io.Copy(io.Discard, pr) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the request did not end when its client left")
	}
	held, spent := heldAndSpent(t, name)
	if held != 0 || !acct.Idle() {
		t.Fatalf("after the client left: held %v (in flight: %v); want nothing", held, !acct.Idle())
	}
	if spent <= 0 || spent > 0.5 {
		t.Errorf("after the client left: spent %v; want what it got, at most its hold", spent)
	}
}

// pipeWriter is a ResponseWriter that writes into a pipe, flushing each
// write, and fails once the pipe's reader is gone.
type pipeWriter struct {
	h    http.Header
	w    *io.PipeWriter
	code int
}

func (p *pipeWriter) Header() http.Header         { return p.h }
func (p *pipeWriter) WriteHeader(code int)        { p.code = code }
func (p *pipeWriter) Write(b []byte) (int, error) { return p.w.Write(b) }
func (p *pipeWriter) Flush()                      {}

// prepare makes req a request Caddy would hand the relay.
func prepare(req *http.Request, w http.ResponseWriter) *http.Request {
	return caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, &caddyhttp.Server{})
}

// TestABatchHoldsUntilItsResultsSettleIt makes a batch of two requests on
// a key with a budget: it holds their worst case at the batch price until
// its results are read, when the hold becomes what they cost; a batch that
// does not fit is refused before anything reaches the upstream.
func TestABatchHoldsUntilItsResultsSettleIt(t *testing.T) {
	store, name := fakeupstream.NewStore("hold"), "hold-batch"
	r, _ := holdRelay(t, &name, []string{"1usd/day"}, store, nil)
	key := "sk-" + name
	batch := func(n, maxTokens int) string {
		reqs := make([]string, n)
		for i := range reqs {
			reqs[i] = fmt.Sprintf(`{"custom_id":"r%d","params":%s}`, i, holdBody(maxTokens))
		}
		return `{"requests":[` + strings.Join(reqs, ",") + `]}`
	}
	call := func(method, path, body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, path, strings.NewReader(body))
		req.Header.Set("X-Api-Key", key)
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("Content-Type", "application/json")
		w, _ := serveHandler(t, r, req)
		return w
	}

	// 500 requests of up to 100 tokens at $0.005 a token (the batch price)
	w := call(http.MethodPost, "/v1/messages/batches", batch(500, 100))
	if typ, code, _ := budgetError(t, w); w.Code != 429 || typ != "rate_limit_error" || code != "budget_exceeded" {
		t.Fatalf("a batch of $250 on a $1 budget: %d %s", w.Code, w.Body)
	}
	if store.Batches() != 0 {
		t.Fatalf("the upstream made %d batches of a refused create", store.Batches())
	}

	// two requests of up to 10 tokens: $0.10 held
	w = call(http.MethodPost, "/v1/messages/batches", batch(2, 10))
	var made struct{ ID string }
	if err := json.Unmarshal(w.Body.Bytes(), &made); w.Code != 200 || err != nil {
		t.Fatalf("a batch that fits: %d %s", w.Code, w.Body)
	}
	if held, spent := heldAndSpent(t, name); held != 0.1 || spent != 0 {
		t.Fatalf("a batch made: held %v, spent %v; want 0.10 held", held, spent)
	}
	// its results: 5 output tokens each, $0.025 each at the batch price
	if w := call(http.MethodGet, "/v1/messages/batches/"+made.ID+"/results", ""); w.Code != 200 || !strings.Contains(w.Body.String(), `"custom_id":"r1"`) {
		t.Fatalf("results: %d %s", w.Code, w.Body)
	}
	if held, spent := heldAndSpent(t, name); held != 0 || spent < 0.0499 || spent > 0.0501 {
		t.Fatalf("results read: held %v, spent %v; want nothing held, 0.05 spent", held, spent)
	}
	// read again: accounted once
	call(http.MethodGet, "/v1/messages/batches/"+made.ID+"/results", "")
	if held, spent := heldAndSpent(t, name); held != 0 || spent < 0.0499 || spent > 0.0501 {
		t.Fatalf("results read twice: held %v, spent %v", held, spent)
	}
}
