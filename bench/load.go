package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	vegeta "github.com/tsenart/vegeta/v12/lib"
)

// messagesPath is the endpoint every workload posts to.
const messagesPath = "/v1/messages"

// kind is what a workload sends.
type kind int

const (
	nonStreaming kind = iota
	fixedRate         // non-streaming, at a constant request rate
	streaming
	idle // streams held open, for their memory
)

// workload is a kind of request at a concurrency (closed loop) or, for
// fixedRate, at a rate; for idle, the concurrency is the number of streams
// held open at once.
type workload struct {
	kind        kind
	concurrency int
	rate        int // requests a second, of fixedRate
	// h2 says, of idle, that the upstream speaks HTTP/2 over TLS, as
	// Anthropic's API, Bedrock and Vertex do, instead of plain HTTP/1.1:
	// the streams then share upstream connections.
	h2 bool
	// cpu says, of nonStreaming, that this is the CPU comparison: its own
	// rounds and their length (options.cpuRounds, cpuDuration), over the
	// targets marked cpu only, and the CPU targets of the report.
	cpu bool
}

// String names the workload in the table.
func (w workload) String() string {
	switch w.kind {
	case fixedRate:
		return "non-streaming " + strconv.Itoa(w.rate) + " req/s"
	case streaming:
		return "streaming c=" + strconv.Itoa(w.concurrency)
	case idle:
		if w.h2 {
			return strconv.Itoa(w.concurrency) + " idle streams, h2 upstream"
		}
		return strconv.Itoa(w.concurrency) + " idle streams, HTTP/1.1 upstream"
	}
	return "non-streaming c=" + strconv.Itoa(w.concurrency)
}

// Workers of a fixed-rate workload: vegeta starts with fixedRateWorkers
// and adds one, up to maxFixedRateWorkers, whenever a request is due and
// every worker waits for a reply, so that a slow reply never delays the
// next request.
const (
	fixedRateWorkers    = 64
	maxFixedRateWorkers = 1024
)

// minPace is the share of its rate a fixed-rate workload must send for its
// row to count: below it, the load generator fell behind and measured
// something else.
const minPace = 0.9

// pace returns how w sends its requests, and the workers that send them:
// closed loop, w.concurrency workers each sending its next request as soon
// as it has read its last reply; or, for fixedRate, w.rate requests a
// second whatever the replies do.
func (w workload) pace() (pacer vegeta.Pacer, workers, maxWorkers uint64) {
	if w.kind == fixedRate {
		return vegeta.Rate{Freq: w.rate, Per: time.Second}, fixedRateWorkers, maxFixedRateWorkers
	}
	n := uint64(w.concurrency)
	return vegeta.Rate{Freq: 0}, n, n
}

// Markers of a complete reply: the end of a message, the end of a stream.
var (
	messageEnd = []byte(`"stop_reason":"end_turn"`)
	streamEnd  = []byte("event: message_stop")
)

// requestHeader is sent with every request: the relay key of the targets'
// Caddyfiles and the headers the Anthropic SDKs send.
func requestHeader() http.Header {
	return http.Header{
		"X-Api-Key":         {"sk-bench"},
		"Anthropic-Version": {"2023-06-01"},
		"Content-Type":      {"application/json"},
	}
}

// messageBody is a Messages request of about 10 KB: one user message of
// filler text, streamed or not.
func messageBody(stream bool) []byte {
	type message struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	b, err := json.Marshal(struct {
		Model     string    `json:"model"`
		MaxTokens int       `json:"max_tokens"`
		Stream    bool      `json:"stream,omitempty"`
		Messages  []message `json:"messages"`
	}{
		Model:     "claude-sonnet-4-5",
		MaxTokens: 64,
		Stream:    stream,
		Messages:  []message{{Role: "user", Content: strings.Repeat("The quick brown fox jumps over the lazy dog. ", 227)}},
	})
	if err != nil {
		panic(err) // a fixed value always marshals
	}
	return b
}

// attack measures w against url with vegeta for d, paced as w.pace says.
func attack(ctx context.Context, t *target, url string, w workload, d time.Duration) row {
	pacer, workers, maxWorkers := w.pace()
	timed := &firstByteTransport{next: keepAliveTransport(int(maxWorkers))}
	defer timed.next.CloseIdleConnections()
	atk := vegeta.NewAttacker(
		vegeta.Client(&http.Client{Transport: timed, Timeout: vegeta.DefaultTimeout}),
		vegeta.Workers(workers), vegeta.MaxWorkers(maxWorkers))
	defer context.AfterFunc(ctx, func() { atk.Stop() })()

	var m vegeta.Metrics
	failedOver := 0
	for res := range atk.Attack(targeter(t, url, messageBody(w.kind == streaming)), pacer, d, w.String()) {
		checkReply(res, w.kind == streaming, t.failsOver)
		if res.Code == http.StatusOK && res.Headers.Get("X-Relay-Attempts") == "2" {
			failedOver++
		}
		m.Add(res)
	}
	m.Close()
	r := row{
		target: t, workload: w,
		reqPerSec: m.Throughput, success: m.Success,
		p50: m.Latencies.P50, p99: m.Latencies.P99, firstByte: timed.p50(),
		failedOver: float64(failedOver) / float64(max(m.Requests, 1)),
		requests:   int64(m.Requests),
		errors:     m.Errors,
	}
	if w.kind == fixedRate && m.Rate < minPace*float64(w.rate) && ctx.Err() == nil {
		r.errors = append(r.errors, fmt.Sprintf("sent only %.0f of its %d req/s", m.Rate, w.rate))
	}
	return r
}

// targeter returns the requests of a round against t: POST body to url,
// with the headers t gives each (requestHeader(), by default).
func targeter(t *target, url string, body []byte) vegeta.Targeter {
	tgt := vegeta.Target{Method: http.MethodPost, URL: url, Body: body, Header: requestHeader()}
	if t.header == nil {
		return vegeta.NewStaticTargeter(tgt)
	}
	var seq atomic.Uint64
	return func(next *vegeta.Target) error {
		if next == nil {
			return vegeta.ErrNilTarget
		}
		*next = tgt
		next.Header = t.header(seq.Add(1) - 1)
		return nil
	}
}

// checkReply fails a reply that vegeta would count as a success (any 2xx
// or 3xx) unless it is a 200 with a complete body and no x-relay-attempts
// header, or x-relay-attempts: 2 on a target that fails over.
func checkReply(r *vegeta.Result, stream bool, failsOver bool) {
	if r.Code < 200 || r.Code >= 400 {
		return // a failure already
	}
	end := messageEnd
	if stream {
		end = streamEnd
	}
	switch got := r.Headers.Get("X-Relay-Attempts"); {
	case r.Code != http.StatusOK:
		r.Error = "status " + strconv.Itoa(int(r.Code))
	case !bytes.Contains(r.Body, end):
		r.Error = "incomplete reply"
	case got != "" && (got != "2" || !failsOver):
		r.Error = fmt.Sprintf("unexpected x-relay-attempts: %s", got)
	default:
		return
	}
	r.Code = 0 // vegeta counts successes by status code
}

// keepAliveTransport keeps one connection per worker alive, as vegeta's
// -keepalive and -connections options do.
func keepAliveTransport(conns int) *http.Transport {
	return &http.Transport{
		DialContext:         (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: conns,
	}
}

// firstByteTransport times every round trip, which ends when the response
// headers arrive: for the relay, at its commit point.
type firstByteTransport struct {
	next *http.Transport
	mu   sync.Mutex
	lat  vegeta.LatencyMetrics
}

// RoundTrip implements http.RoundTripper.
func (t *firstByteTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	start := time.Now()
	resp, err := t.next.RoundTrip(r)
	if err == nil {
		t.mu.Lock()
		t.lat.Add(time.Since(start))
		t.mu.Unlock()
	}
	return resp, err
}

// p50 is the median time to the response headers, zero without any.
func (t *firstByteTransport) p50() time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.lat.Total == 0 {
		return 0
	}
	return t.lat.Quantile(0.5)
}
