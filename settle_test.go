package relay

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func TestDeltaContent(t *testing.T) {
	for _, c := range []struct {
		name, data string
		want       int64
	}{
		{"a text delta: two words and a mark", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello, world"}}`, 2*unitsWord + unitsPunct},
		{"escapes are what they stand for", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a\n\tb \"c\""}}`, 3*unitsWord + unitsNewline + unitsTab + 2*unitsPunct},
		{"a tool's input JSON", `{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"city\": \"Paris\"}"}}`, 2*unitsWord + 7*unitsPunct},
		{"thinking", `{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Let me see"}}`, 3 * unitsWord},
		{"characters outside ASCII, raw or escaped (a pair is one)", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"中文\u00e9\ud83d\ude00"}}`, 4 * unitsOther},
		{"an escaped ASCII letter is a letter", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"\u0041B"}}`, unitsWord},
		{"the key's order does not matter", `{"delta":{"text":"one two","type":"text_delta"},"index":0,"type":"content_block_delta"}`, 2 * unitsWord},
		{"a signature is not output", `{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxDYs"}}`, 0},
		{"nor a citation", `{"type":"content_block_delta","index":0,"delta":{"type":"citations_delta","citation":{"type":"char_location","cited_text":"text, \"quoted\"","document_index":0}}}`, 0},
		{"a delta that is not an object", `{"type":"content_block_delta","index":0,"delta":"text"}`, 0},
		{"no delta", `{"type":"content_block_delta","index":0}`, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := deltaContent([]byte(c.data)); got != c.want {
				t.Errorf("deltaContent = %d, want %d", got, c.want)
			}
		})
	}
}

// The estimate of a realistic answer, streamed a few words a delta, is
// within 10% of its count by the Claude tokenizer (1% as measured).
func TestOutputEstimateOfARealisticStream(t *testing.T) {
	for _, words := range []int{1, 3, 7} {
		var u usage
		for _, d := range fakeupstream.Deltas(fakeupstream.Answer, words) {
			text, _ := json.Marshal(d)
			data := `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":` + string(text) + `}}`
			u.fromEvent([]byte("content_block_delta"), []byte(data))
		}
		got, want := u.estimatedOutput(), int64(fakeupstream.AnswerTokens)
		if off := math.Abs(float64(got-want)) / float64(want); off > 0.10 {
			t.Errorf("%d words a delta: estimated %d tokens, the tokenizer counts %d (%.1f%% off)", words, got, want, 100*off)
		}
	}
}

func BenchmarkDeltaContent(b *testing.B) {
	ev := []byte(`{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":" a goroutine tries to send on an\n\tunbuffered channel"}}`)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if deltaContent(ev) == 0 {
			b.Fatal("no content")
		}
	}
}

func TestSettleGraceConfig(t *testing.T) {
	const rest = "\tkey {env.K} g\n\tchannel a {\n\t\tprovider mock\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n}"
	for src, want := range map[string]time.Duration{
		"relay {\n\tsettle_grace 0\n" + rest:     0,
		"relay {\n\tsettle_grace 750ms\n" + rest: 750 * time.Millisecond,
	} {
		r, err := parseRelay(t, src)
		if err != nil {
			t.Fatalf("%q: %v", src, err)
		}
		if r.SettleGrace == nil || time.Duration(*r.SettleGrace) != want {
			t.Errorf("%q: settle_grace %v, want %v", src, r.SettleGrace, want)
		}
	}
	if _, err := parseRelay(t, "relay {\n\tsettle_grace -1s\n"+rest); err == nil || !strings.Contains(err.Error(), "Testfile:2") {
		t.Errorf("a negative settle_grace: %v", err)
	}
	provisioned := func(grace *caddy.Duration) time.Duration {
		r := &Relay{
			SettleGrace: grace,
			Keys:        []*Key{{Secret: "sk-settle-config-0123456789", Group: "settle-config"}},
			Channels:    []*Channel{{Name: "settle-config", UpstreamRaw: upstream("mock")}},
			Groups:      []*Group{{Name: "settle-config", Channels: []string{"settle-config"}}},
		}
		provisionHandler(t, r)
		return r.settleGrace
	}
	if g := provisioned(nil); g != defaultSettleGrace {
		t.Errorf("default settle_grace %v, want %v", g, defaultSettleGrace)
	}
	if g := provisioned(new(caddy.Duration)); g != 0 {
		t.Errorf("settle_grace 0 is %v", g)
	}
}

// settleCase is a relay in Caddy whose key has a token limit, with its log
// lines observed and settle_grace's timer in the test's hands.
type settleCase struct {
	relay *Relay
	logs  *observer.ObservedLogs
	// graces receives settle_grace's timers as they are armed: what is left
	// of the grace, and the function that ends it
	graces chan armedGrace
}

type armedGrace struct {
	left time.Duration
	end  func()
}

const settleKey = "sk-settle-client-0123456789abcdef"

// startSettle loads a relay with one channel at url, a key (named name,
// in group name) with tokens 1000000/d, and the relay options given.
func startSettle(t *testing.T, name, url string, options ...string) *settleCase {
	t.Helper()
	startRelay(t, strings.Join(options, "\n")+"\n"+
		"\t\tpricing {\n\t\t\tm-settle input 3 output 15\n\t\t}\n"+
		channelBlock(name, url)+
		fmt.Sprintf("\t\tkey %s %s {\n\t\t\tname %s\n\t\t\ttokens 1000000/d\n\t\t}\n\t\tgroup %s {\n\t\t\tchannels %s\n\t\t}\n", settleKey, name, name, name, name))
	return settleOn(t, name)
}

// settleOn observes the log lines of the relay that serves key name, and
// takes settle_grace's timer in hand.
func settleOn(t *testing.T, name string) *settleCase {
	t.Helper()
	c := &settleCase{graces: make(chan armedGrace, 1)}
	for _, k := range provisionedKeys.current() {
		if k.name == name {
			c.relay = k.relay
		}
	}
	if c.relay == nil {
		t.Fatalf("no relay serves key %s", name)
	}
	// before any request: each is handed to the relay over a connection
	core, logs := observer.New(zapcore.InfoLevel)
	c.relay.logger, c.logs = zap.New(core), logs
	c.relay.graceTimer = func(left time.Duration, end func()) *time.Timer {
		c.graces <- armedGrace{left, end}
		return time.NewTimer(time.Hour) // the test ends the grace, or the answer comes first
	}
	return c
}

// line waits for the request's log line (it is written when the request
// has been accounted) and returns its fields.
func (c *settleCase) line(t *testing.T) map[string]any {
	t.Helper()
	waitFor(t, "the request's log line", 10*time.Second, func() bool { return c.logs.FilterMessage("relayed request").Len() > 0 })
	return c.logs.FilterMessage("relayed request").All()[0].ContextMap()
}

// leaveAfter sends body on a raw connection, reads the answer's events up
// to and including the first event named last, and closes the connection:
// the client leaves. It returns what the client got.
func leaveAfter(t *testing.T, body, last string, header ...string) string {
	t.Helper()
	conn := sendRaw(t, body, header...)
	defer conn.Close()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	var got strings.Builder
	for want := "event: " + last + "\n"; ; {
		line, err := br.ReadString('\n')
		got.WriteString(line)
		if err != nil {
			t.Fatalf("the stream ended before %s: %v\n%s", last, err, got.String())
		}
		if line == want {
			rest, _ := br.ReadString('\n') // its data
			blank, _ := br.ReadString('\n')
			got.WriteString(rest + blank)
			return got.String()
		}
	}
}

// sendRaw sends a Messages request with settleKey on a connection of its
// own, header pairs after the body, and returns the connection.
func sendRaw(t *testing.T, body string, header ...string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", "localhost:9080")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	var extra strings.Builder
	for i := 0; i+1 < len(header); i += 2 {
		extra.WriteString(header[i] + ": " + header[i+1] + "\r\n")
	}
	fmt.Fprintf(conn, "POST /v1/messages HTTP/1.1\r\nHost: localhost:9080\r\nX-Api-Key: %s\r\nAnthropic-Version: 2023-06-01\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s", settleKey, len(body), extra.String(), body)
	return conn
}

// answerStream is a realistic streamed answer: 1,000 input tokens, and
// fakeupstream.Answer as text deltas of three words, AnswerTokens output
// tokens. The first held events run to its content_block_stop.
func answerStream() (events []string, held int) {
	events = fakeupstream.StreamEvents("m-settle", fakeupstream.Usage{InputTokens: 1000, OutputTokens: fakeupstream.AnswerTokens},
		fakeupstream.Deltas(fakeupstream.Answer, 3)...)
	return events, len(events) - 2
}

const settleStreamBody = `{"model":"m-settle","max_tokens":1024,"stream":true,"messages":[{"role":"user","content":"Why does my Go program leak goroutines?"}]}`

// The cost, in USD, of input and output tokens at m-settle's price.
func settleCost(input, output int64) float64 { return (float64(input)*3 + float64(output)*15) / 1e6 }

// A client that reads a stream up to content_block_stop and leaves is
// billed the output the upstream reports after it left: the relay reads
// on (within settle_grace) for the message_delta, writing nothing more.
func TestAClientThatLeavesAfterTheContentIsBilledItsOutput(t *testing.T) {
	events, held := answerStream()
	release, canceled := make(chan struct{}), make(chan struct{})
	up := fakeupstream.New(t, fakeupstream.Held(events, held, release, canceled))
	c := startSettle(t, "settle-reads-on", up.URL, "\t\tsettle_grace 1m")
	outputBefore := testutil.ToFloat64(metricTokens.WithLabelValues("settle-reads-on", "settle-reads-on", labelOther, "output"))
	estimatedBefore := testutil.ToFloat64(metricEstimated.WithLabelValues("settle-reads-on"))
	start := time.Now()

	got := leaveAfter(t, settleStreamBody, "content_block_stop")
	if want := strings.Join(events[:held], ""); got != want {
		t.Fatalf("the client got\n%q\nwant\n%q", got, want)
	}
	var g armedGrace
	select {
	case g = <-c.graces: // the relay saw the client leave, and reads on
	case <-canceled:
		t.Fatal("the upstream was canceled when the client left: its output is never known")
	case <-time.After(10 * time.Second):
		t.Fatal("settle_grace did not start within 10s of the client leaving")
	}
	if g.left <= 0 || g.left > time.Minute {
		t.Errorf("the grace left %v, want at most settle_grace (1m)", g.left)
	}
	close(release) // the upstream ends its answer: message_delta says 384 output tokens

	f := c.line(t)
	for k, want := range map[string]any{"input_tokens": int64(1000), "output_tokens": int64(fakeupstream.AnswerTokens), "incomplete": true} {
		if f[k] != want {
			t.Errorf("log field %s = %#v, want %#v", k, f[k], want)
		}
	}
	if _, ok := f["estimated"]; ok {
		t.Errorf("the output was reported, not estimated: %v", f)
	}
	want := settleCost(1000, fakeupstream.AnswerTokens)
	if cost, _ := f["cost_usd"].(float64); math.Abs(cost-want) > 1e-12 {
		t.Errorf("cost_usd %v, want %v", f["cost_usd"], want)
	}
	if d := testutil.ToFloat64(metricTokens.WithLabelValues("settle-reads-on", "settle-reads-on", labelOther, "output")) - outputBefore; d != fakeupstream.AnswerTokens {
		t.Errorf("relay_tokens_total{kind=output} grew by %v, want %d", d, fakeupstream.AnswerTokens)
	}
	if d := testutil.ToFloat64(metricEstimated.WithLabelValues("settle-reads-on")) - estimatedBefore; d != 0 {
		t.Errorf("relay_estimated_usage_total grew by %v", d)
	}
	rows, _ := keyRows(t)
	row := rows["settle-reads-on"]
	if math.Abs(row.SpendUSD["month"]-want) > 1e-9 || row.EstimatedUSD != nil {
		t.Errorf("GET /relay/keys: %s, want spend %v and nothing estimated", show(row), want)
	}
	// the key's token limit was charged input and output: 1,000,000 a day
	// refills 11.6 tokens a second
	refill := int64(time.Since(start).Seconds()*1e6/86400) + 1
	if left := row.Limits.TokensRemaining; left == nil || *left < 1e6-1384-1 || *left > 1e6-1384+refill {
		t.Errorf("tokens remaining %v, want 1000000 - 1384 (and what refilled since, at most %d)", show(left), refill)
	}
	if ch := channels(t)["settle-reads-on"]; ch.State != stateHealthy {
		t.Errorf("the client's leaving cooled the channel: %s", show(ch))
	}
}

// An upstream that stalls after the client left: when settle_grace is over
// the request ends, its output estimated from the content the client was
// sent (within 10% of the real count), marked estimated in the log line,
// in GET /relay/keys and in relay_estimated_usage_total. The channel is not
// judged by it.
func TestAClientThatLeavesAStalledStreamIsBilledAnEstimate(t *testing.T) {
	events, held := answerStream()
	canceled := make(chan struct{})
	up := fakeupstream.New(t, fakeupstream.Held(events, held, nil, canceled))
	c := startSettle(t, "settle-stalls", up.URL, "\t\tsettle_grace 1m")
	estimatedBefore := testutil.ToFloat64(metricEstimated.WithLabelValues("settle-stalls"))

	leaveAfter(t, settleStreamBody, "content_block_stop")
	var g armedGrace
	select {
	case g = <-c.graces:
	case <-canceled:
		t.Fatal("the upstream was canceled when the client left, without a grace")
	case <-time.After(10 * time.Second):
		t.Fatal("settle_grace did not start within 10s of the client leaving")
	}
	select {
	case <-canceled:
		t.Fatal("the upstream was canceled before settle_grace was over")
	default:
	}
	g.end() // settle_grace is over
	select {
	case <-canceled:
	case <-time.After(10 * time.Second):
		t.Fatal("the relay still reads the upstream after settle_grace")
	}

	f := c.line(t)
	out, _ := f["output_tokens"].(int64)
	if off := math.Abs(float64(out-fakeupstream.AnswerTokens)) / fakeupstream.AnswerTokens; off > 0.10 {
		t.Errorf("output estimated at %d tokens, the upstream made %d (%.1f%% off)", out, fakeupstream.AnswerTokens, 100*off)
	}
	if f["estimated"] != true || f["input_tokens"] != int64(1000) || f["incomplete"] != true {
		t.Errorf("log line %v, want estimated, the input message_start reported, incomplete", f)
	}
	if d := testutil.ToFloat64(metricEstimated.WithLabelValues("settle-stalls")) - estimatedBefore; d != 1 {
		t.Errorf("relay_estimated_usage_total grew by %v, want 1", d)
	}
	rows, _ := keyRows(t)
	row := rows["settle-stalls"]
	cost := settleCost(1000, out)
	if math.Abs(row.SpendUSD["month"]-cost) > 1e-9 {
		t.Errorf("spend %v, want %v", row.SpendUSD["month"], cost)
	}
	for _, p := range []string{"day", "week", "month"} {
		if want := settleCost(0, out); math.Abs(row.EstimatedUSD[p]-want) > 1e-9 {
			t.Errorf("estimated_usd[%s] = %v, want the estimated output's %v: %s", p, row.EstimatedUSD[p], want, show(row))
		}
	}
	if ch := channels(t)["settle-stalls"]; ch.State != stateHealthy {
		t.Errorf("the client's leaving cooled the channel: %s", show(ch))
	}
}

// A non-streaming request whose client left before the answer: the answer
// that comes within settle_grace is billed as it reports.
func TestAClientThatLeavesBeforeAnAnswerIsBilledIt(t *testing.T) {
	got, release, canceled := make(chan struct{}), make(chan struct{}), make(chan struct{})
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mustRead(r)
		close(got)
		select {
		case <-release:
		case <-r.Context().Done():
			close(canceled)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m-settle", fakeupstream.Answer, fakeupstream.Usage{InputTokens: 1000, OutputTokens: fakeupstream.AnswerTokens}))
	}))
	c := startSettle(t, "settle-message", up.URL, "\t\tsettle_grace 1m")

	conn := sendRaw(t, `{"model":"m-settle","max_tokens":1024,"messages":[{"role":"user","content":"Why does my Go program leak goroutines?"}]}`)
	<-got
	_ = conn.Close() // the client leaves while the upstream works
	select {
	case <-c.graces:
	case <-canceled:
		t.Fatal("the upstream was canceled when the client left: its answer is never known")
	case <-time.After(10 * time.Second):
		t.Fatal("settle_grace did not start within 10s of the client leaving")
	}
	close(release)

	f := c.line(t)
	for k, want := range map[string]any{"status": int64(statusClientClosed), "input_tokens": int64(1000), "output_tokens": int64(fakeupstream.AnswerTokens), "incomplete": true} {
		if f[k] != want {
			t.Errorf("log field %s = %#v, want %#v", k, f[k], want)
		}
	}
	rows, _ := keyRows(t)
	if row := rows["settle-message"]; math.Abs(row.SpendUSD["month"]-settleCost(1000, fakeupstream.AnswerTokens)) > 1e-9 || row.EstimatedUSD != nil {
		t.Errorf("GET /relay/keys: %s", show(row))
	}
}

// settle_grace and dedup_grace both count from the client's leaving: an
// SDK's first attempt whose client left reads on for the longer of the
// two, not their sum; with settle_grace the shorter, nothing more.
func TestSettleGraceOverlapsDedupGrace(t *testing.T) {
	forgetDedups(t)
	t.Run("settle_grace the longer", func(t *testing.T) {
		events, held := answerStream()
		release, canceled := make(chan struct{}), make(chan struct{})
		up := fakeupstream.New(t, fakeupstream.Held(events, held, release, canceled))
		c := startSettle(t, "settle-dedup-longer", up.URL, "\t\tsettle_grace 1m\n\t\tdedup_grace 50ms")
		leaveAfter(t, strings.Replace(settleStreamBody, "?", "? (1)", 1), "content_block_stop", "X-Stainless-Retry-Count", "0")
		var g armedGrace
		select {
		case g = <-c.graces: // once dedup_grace is over
		case <-canceled:
			t.Fatal("the upstream was canceled at the end of dedup_grace")
		case <-time.After(10 * time.Second):
			t.Fatal("settle_grace did not start")
		}
		if g.left > time.Minute-50*time.Millisecond || g.left < time.Minute-10*time.Second {
			t.Errorf("what was left of settle_grace after dedup_grace: %v, want 1m less the 50ms (or so) that passed", g.left)
		}
		close(release)
		if f := c.line(t); f["output_tokens"] != int64(fakeupstream.AnswerTokens) {
			t.Errorf("log line %v, want the output reported", f)
		}
	})
	t.Run("dedup_grace the longer", func(t *testing.T) {
		events, held := answerStream()
		canceled := make(chan struct{})
		up := fakeupstream.New(t, fakeupstream.Held(events, held, nil, canceled))
		c := startSettle(t, "settle-dedup-shorter", up.URL, "\t\tsettle_grace 10ms\n\t\tdedup_grace 50ms")
		leaveAfter(t, strings.Replace(settleStreamBody, "?", "? (2)", 1), "content_block_stop", "X-Stainless-Retry-Count", "0")
		f := c.line(t)
		select {
		case g := <-c.graces:
			t.Errorf("a grace of %v was armed after dedup_grace, which outlasted settle_grace", g.left)
		default:
		}
		if f["estimated"] != true {
			t.Errorf("log line %v, want the output estimated", f)
		}
	})
}

// What an upstream answers after the client left is not failed over for,
// nor held against the channel: a 529 that comes within settle_grace
// neither cools the channel nor sends the request to another.
func TestAnAnswerAfterTheClientLeftIsNotFailedOver(t *testing.T) {
	got, release := make(chan struct{}), make(chan struct{})
	first := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mustRead(r)
		close(got)
		<-release
		fakeupstream.Error(529, "overloaded_error", "Overloaded")(w, r)
	}))
	second := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, "\t\tsettle_grace 1m\n"+channelBlock("settle-529", first.URL, "priority 1")+channelBlock("settle-other", second.URL, "priority 2")+
		fmt.Sprintf("\t\tkey %s settle-fo {\n\t\t\tname settle-fo\n\t\t}\n\t\tgroup settle-fo {\n\t\t\tchannels settle-529 settle-other\n\t\t}\n", settleKey))
	c := settleOn(t, "settle-fo")

	conn := sendRaw(t, simpleBody)
	<-got
	_ = conn.Close()
	select {
	case <-c.graces:
	case <-time.After(10 * time.Second):
		t.Fatal("settle_grace did not start within 10s of the client leaving")
	}
	close(release) // the upstream answers 529

	f := c.line(t)
	if attempts, _ := f["attempts"].([]any); len(attempts) != 1 || !strings.HasPrefix(fmt.Sprint(attempts[0]), "settle-529:canceled:") {
		t.Errorf("attempts %v, want one, canceled: the client had left", f["attempts"])
	}
	if n := second.Hits(); n != 0 {
		t.Errorf("the request went to another channel %d times after its client left", n)
	}
	if ch := channels(t)["settle-529"]; ch.State != stateHealthy {
		t.Errorf("an answer after the client left cooled the channel: %s", show(ch))
	}
}

// A stream the upstream breaks after part of its content (an error event,
// here) leaves its client with that content and no usage of its output:
// the output is billed as the estimate of what the client was sent, as
// for a client that leaves, and marked estimated.
func TestAStreamTheUpstreamBreaksIsBilledAnEstimate(t *testing.T) {
	events, held := answerStream()
	events = append(events[:held:held], fakeupstream.Event("error", `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`))
	up := fakeupstream.New(t, fakeupstream.Stream(events...))
	c := startSettle(t, "settle-broken", up.URL)
	estimatedBefore := testutil.ToFloat64(metricEstimated.WithLabelValues("settle-broken"))

	r := send(t, http.MethodPost, "/v1/messages", settleKey, settleStreamBody)
	if r.status != 200 || !strings.Contains(string(r.body), "event: error") {
		t.Fatalf("%d %s", r.status, r.body)
	}
	f := c.line(t)
	out, _ := f["output_tokens"].(int64)
	if off := math.Abs(float64(out-fakeupstream.AnswerTokens)) / fakeupstream.AnswerTokens; off > 0.10 {
		t.Errorf("output estimated at %d tokens, the client was sent %d (%.1f%% off)", out, fakeupstream.AnswerTokens, 100*off)
	}
	if f["estimated"] != true || f["incomplete"] != true {
		t.Errorf("log line %v, want estimated and incomplete", f)
	}
	if d := testutil.ToFloat64(metricEstimated.WithLabelValues("settle-broken")) - estimatedBefore; d != 1 {
		t.Errorf("relay_estimated_usage_total grew by %v, want 1", d)
	}
	rows, _ := keyRows(t)
	if got, want := rows["settle-broken"].SpendUSD["month"], settleCost(1000, out); math.Abs(got-want) > 1e-9 {
		t.Errorf("spend %v, want %v", got, want)
	}
}

// TestAClientThatLeavesBeforeTheAnswerPaysItsInput sends a 400 KB prompt,
// not streamed, ten times, each time leaving once the upstream has it and
// before it answers: each is charged its input estimate at the input
// price, marked estimated, against the key's budget and the channel's
// cap, where each used to cost nothing.
func TestAClientThatLeavesBeforeTheAnswerPaysItsInput(t *testing.T) {
	var got atomic.Pointer[chan struct{}]
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.ReadAll(req.Body)
		close(*got.Load())
		<-req.Context().Done()
	}))
	grace := caddy.Duration(0) // nothing to read on for: the upstream never answers
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-left-before-0123456789", Group: "left-before", KeyOptions: KeyOptions{Name: "left-before", Budgets: []string{"100usd/day"}}}},
		Channels: []*Channel{{Name: "left-before", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey), SpendCaps: []string{"100usd/day"}}},
		Groups:   []*Group{{Name: "left-before", Channels: []string{"left-before"}}},
		Pricing:  map[string]Price{"m-left": {Input: 3, Output: 15}}, SettleGrace: &grace,
	}
	provisionHandler(t, r)
	body := `{"model":"m-left","max_tokens":16,"messages":[{"role":"user","content":"` + strings.Repeat("x", 400<<10) + `"}]}`
	perRequest := float64(estimateTokens([]byte(body))) * 3e-6 // about $0.31
	for range 10 {
		ch := make(chan struct{})
		got.Store(&ch)
		ctx, cancel := context.WithCancel(context.Background())
		go func() {
			<-ch
			cancel() // the client leaves
		}()
		w := httptest.NewRecorder()
		req := caddyhttp.PrepareRequest(newRequest(body, "sk-left-before-0123456789").WithContext(ctx), caddy.NewReplacer(), w, &caddyhttp.Server{})
		if err := r.ServeHTTP(w, req, nil); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	rows, _ := keyRows(t)
	row := rows["left-before"]
	want := 10 * perRequest
	if spent := row.SpendUSD["day"]; spent < want-1e-6 || spent > want+1e-6 {
		t.Errorf("ten clients that left spent $%.6f, want $%.6f", spent, want)
	}
	if est := row.EstimatedUSD["day"]; est < want-1e-6 || est > want+1e-6 {
		t.Errorf("estimated_usd.day = %v, want %v: the input was estimated", est, want)
	}
	if row.HeldUSD != 0 {
		t.Errorf("%v still held", row.HeldUSD)
	}
	spent, _ := r.groups["left-before"].channels[0].spend.Spent(r.now())
	if spent[money.PeriodDay] < want-1e-6 || spent[money.PeriodDay] > want+1e-6 {
		t.Errorf("the channel's cap counted $%.6f, want $%.6f", spent[money.PeriodDay], want)
	}
}
