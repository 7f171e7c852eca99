package relay

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"runtime/metrics"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/tidwall/gjson"
)

// FuzzInspect checks the body scan on any bytes: it never panics, and what
// it accepts is one valid JSON object whose model (the one the relay routes
// on) is what any other JSON parser reads, at the offsets a mapping splices,
// and whose web searches (what it holds) are those its tools declare.
// Long run: go test -run '^$' -fuzz FuzzInspect -fuzztime 10m .
func FuzzInspect(f *testing.F) {
	for _, seed := range []string{
		`{"model":"claude-sonnet-4-5","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`,
		`{"model":"claude-opus-4-1","max_tokens":1} {"model":"claude-sonnet-4-5"}`,
		`{"model":"a","model":"b"}`,
		`{"model":"a","mod\u0065l":"b"}`,
		`{"model":"a","x":[1,2 "model":"b"]}`,
		`{"model":"claude\u002dsonnet","metadata":{"user_id":"u"},"service_tier":"auto"}`,
		`{"model":".."}`,
		` {"speed":null,"model":"m"} `,
		`{"model":"m","tools":[{"type":"web_search_20250305"},{"t\u0079pe":"web_fetch_1"},7,{"type":null}],"mcp_servers":[]}`,
		`{"model":"m","tools":{"type":"code_execution_1"},"container":null}`,
		`{"model":"m","tools":[{"max_uses":3,"type":"web_search_20250305"},{"type":"web_search_20260209","max\u005fuses":2.5},{"type":"web_search_x","max_uses":"9"}]}`,
		`[]`, `{}`, ``, `{"model":`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		in := &inbound{ask: asked{body: body}}
		if in.inspect() != nil {
			return
		}
		if !json.Valid(body) {
			t.Fatalf("accepted a body that is not JSON: %q", body)
		}
		var v struct{ Model string }
		if err := json.Unmarshal(body, &v); err != nil || v.Model != in.ask.model {
			t.Fatalf("the relay routes %q, a JSON parser reads %q (%v)", in.ask.model, v.Model, err)
		}
		var raw string
		if err := json.Unmarshal(body[in.ask.modelStart:in.ask.modelEnd], &raw); err != nil || raw != in.ask.model {
			t.Fatalf("the model's offsets hold %q, not %q", body[in.ask.modelStart:in.ask.modelEnd], in.ask.model)
		}
		if modelIDProblem(in.ask.model) != "" {
			t.Fatalf("accepted model %q", in.ask.model)
		}
		// the features it routes on are the ones a JSON parser reads
		var top map[string]json.RawMessage
		_ = json.Unmarshal(body, &top)
		var want features.Set
		for name, v := range top {
			if string(v) != "null" {
				want |= features.OfField(name)
			}
		}
		var tools []json.RawMessage
		searches := int64(0)
		if json.Unmarshal(top["tools"], &tools) == nil {
			for _, tool := range tools {
				var fields map[string]any // keys exactly, as the API reads them
				if json.Unmarshal(tool, &fields) == nil {
					if typ, ok := fields["type"].(string); ok {
						want |= features.OfTool(typ)
						if strings.HasPrefix(typ, "web_search_") {
							uses := int64(money.DefaultWebSearches)
							if n, ok := fields["max_uses"].(float64); ok && n >= 0 {
								uses = int64(math.Ceil(min(n, money.MaxWebSearches)))
							}
							searches += uses
						}
					}
				}
			}
		}
		if in.ask.needs.Set != want {
			t.Fatalf("the relay routes on features %q, a JSON parser reads %q", in.ask.needs.Set.Names(), want.Names())
		}
		if in.ask.searches != searches {
			t.Fatalf("the relay holds %d web searches, a JSON parser reads %d", in.ask.searches, searches)
		}
	})
}

func TestSmuggledSecondModelIsRefused(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, channelBlock("hostile-smuggle", up.URL, "models claude-sonnet-4-5")+keyAndGroup("hostile-smuggle", "hostile-smuggle"))
	for name, body := range map[string]string{
		"a second object":  `{"model":"claude-opus-4-1","max_tokens":16,"messages":[]} {"model":"claude-sonnet-4-5"}`,
		"a duplicate key":  `{"model":"claude-opus-4-1","max_tokens":16,"model":"claude-sonnet-4-5","messages":[]}`,
		"an escaped twin":  `{"model":"claude-sonnet-4-5","mod\u0065l":"claude-opus-4-1","messages":[]}`,
		"a broken nesting": `{"model":"claude-sonnet-4-5","messages":[{"role":"user" "model":"claude-opus-4-1"}]}`,
	} {
		t.Run(name, func(t *testing.T) {
			wantRelayError(t, message(t, body), 400, "invalid_request_error", "")
		})
	}
	if up.Hits() != 0 {
		t.Errorf("a smuggling body reached the upstream %d times", up.Hits())
	}
}

func TestModelNamesAreCheckedBeforeAnyURL(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, fakeupstream.Message("served"))
	bedrock := strings.Replace(bedrockChannel(t, "hostile-dots", fb.URL),
		"\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n", "", 1)
	startRelay(t, bedrock+keyAndGroup("hostile-dots", "hostile-dots"))
	for _, model := range []string{"..", ".", "a/../invoke", "../../v1/x", "claude sonnet", strings.Repeat("m", 900<<10)} {
		r := message(t, `{"model":"`+model+`","max_tokens":1,"messages":[]}`)
		wantRelayError(t, r, 400, "invalid_request_error", "")
		if len(r.body) > 1024 {
			t.Errorf("the error echoes the model: %d bytes", len(r.body))
		}
	}
	if fb.Hits() != 0 {
		t.Errorf("a model that is not an id reached Bedrock %d times: %v", fb.Hits(), fb.Requests()[0].Path)
	}
	// ids as the clouds spell them still pass, signed correctly
	for _, model := range []string{"us.anthropic.claude-sonnet-4-5-20250929-v1:0", "arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/a1b2c3"} {
		if r := message(t, `{"model":"`+model+`","max_tokens":1,"messages":[]}`); r.status != 200 {
			t.Errorf("model %q: %d %s", model, r.status, r.body)
		}
	}
	if bad := fb.Refused(); len(bad) > 0 {
		t.Errorf("signatures refused: %v", bad)
	}
}

// slowRequest opens a connection to the relay and sends the headers of a
// request that declares a body of size bytes, and the first bytes of it.
func slowRequest(t *testing.T, key string, size int) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", "127.0.0.1:9080")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	_, err = fmt.Fprintf(conn, "POST /v1/messages HTTP/1.1\r\nHost: localhost:9080\r\nX-Api-Key: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", key, size)
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

// heapAllocated is every byte the process allocated on the heap so far.
func heapAllocated() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func TestSlowBodiesReserveNoMemoryAndTimeOut(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, "\t\tread_body_timeout 1s\n"+channelBlock("hostile-slow", up.URL)+keyAndGroup("hostile-slow", "hostile-slow"))

	// 40 clients each declare a 32 MiB body and send one byte of it. Before,
	// each declaration reserved its 32 MiB at once: 1.3 GB for 40 bytes.
	const clients, declared = 40, 32 << 20
	before := heapAllocated()
	var wg sync.WaitGroup
	statuses := make(chan string, clients)
	for i := 0; i < clients; i++ {
		conn := slowRequest(t, clientKey, declared)
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = conn.SetReadDeadline(time.Now().Add(15 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
			if err != nil {
				statuses <- err.Error()
				return
			}
			defer resp.Body.Close()
			var b strings.Builder
			_, _ = bufio.NewReader(resp.Body).WriteTo(&b)
			statuses <- fmt.Sprintf("%d %s", resp.StatusCode, gjson.Get(b.String(), "error.type"))
		}()
	}
	wg.Wait()
	close(statuses)
	for s := range statuses {
		if s != "408 timeout_error" {
			t.Errorf("a client that stopped sending got %q, want 408 timeout_error after read_body_timeout", s)
		}
	}
	// the bound: what 40 requests allocate in all, far below one body
	if grew := heapAllocated() - before; grew > 64<<20 {
		t.Errorf("40 slow clients made the relay allocate %d MiB, want under 64 MiB", grew>>20)
	}
	if up.Hits() != 0 {
		t.Errorf("an incomplete body reached the upstream")
	}
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("after the timeouts: %d %s", r.status, r.body)
	}
}
