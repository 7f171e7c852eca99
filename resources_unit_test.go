package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/memtest"
	"github.com/caddy-relay/relay/internal/owners"
	"github.com/caddy-relay/relay/internal/resourceid"
	anthropicprovider "github.com/caddy-relay/relay/providers/anthropic"
)

func TestResourceRoutesAndMethods(t *testing.T) {
	for _, tc := range []struct {
		method, path string
		kind         resourceid.Kind
		op           resourceOp
		id           string
		status       int
	}{
		{"POST", "/v1/files", resourceid.File, opCreate, "", 0},
		{"GET", "/v1/files", resourceid.File, opList, "", 0},
		{"GET", "/v1/files/file_x", resourceid.File, opGet, "file_x", 0},
		{"DELETE", "/v1/files/file_x", resourceid.File, opDelete, "file_x", 0},
		{"GET", "/v1/files/file_x/content", resourceid.File, opContent, "file_x", 0},
		{"POST", "/v1/messages/batches", resourceid.Batch, opCreate, "", 0},
		{"GET", "/v1/messages/batches/b", resourceid.Batch, opGet, "b", 0},
		{"POST", "/v1/messages/batches/b/cancel", resourceid.Batch, opCancel, "b", 0},
		{"GET", "/v1/messages/batches/b/results", resourceid.Batch, opResults, "b", 0},
		{"DELETE", "/v1/messages/batches", resourceid.Batch, 0, "", 405},
		{"GET", "/v1/files/file_x/results", resourceid.File, 0, "", 404},
		{"GET", "/v1/messages/batches/b/content", resourceid.Batch, 0, "", 404},
		{"GET", "/v1/files/a/b/c", resourceid.File, 0, "", 404},
		{"PUT", "/v1/files/file_x", resourceid.File, 0, "", 405},
	} {
		rq, rerr := parseResource(tc.method, tc.path)
		switch {
		case tc.status != 0 && (rerr == nil || rerr.status != tc.status):
			t.Errorf("%s %s: %v, want %d", tc.method, tc.path, rerr, tc.status)
		case tc.status == 0 && (rerr != nil || rq.kind != tc.kind || rq.op != tc.op || rq.id != tc.id):
			t.Errorf("%s %s = %+v %v", tc.method, tc.path, rq, rerr)
		}
	}
	for p, want := range map[string]bool{"/v1/files": true, "/v1/files/x": true, "/v1/filesx": false, "/v1/messages/batches": true,
		"/v1/messages/batchesx": false, "/v1/messages": false} {
		if isResourcePath(p) != want {
			t.Errorf("isResourcePath(%q) = %v", p, !want)
		}
	}
}

func TestMayReferenceFiles(t *testing.T) {
	code := strings.Repeat("snake_case_name = other_name\n", 40)
	for body, want := range map[string]bool{
		`{"a":"b"}`:                        false,
		`{"file_id":"x"}`:                  true,
		`{"user_id":"file_id"}`:            true, // a value: findFileIDs looks closer
		`{"x":"` + code + `","file_id":1}`: true,
		`{"x":"` + code + `"}`:             false,
		`"file_id"`:                        true,
		`file_id"`:                         false,
	} {
		if got := mayReferenceFiles([]byte(body)); got != want {
			t.Errorf("mayReferenceFiles(%.40q) = %v", body, got)
		}
	}
}

func TestEachFileID(t *testing.T) {
	body := []byte(`{"model":"m","file_id":1,"messages":[{"content":[{"type":"document","source":{"type":"file","file_id":"file_a"}},{"type":"text","text":"\"file_id\":\"no\""},{"type":"container_upload","file_id":"file_b"}]}]}`)
	var ids []string
	err := eachFileID(body, func(start, end int) { ids = append(ids, string(body[start:end])) })
	if err != nil || strings.Join(ids, " ") != `"file_a" "file_b"` {
		t.Fatalf("%v %q", err, ids)
	}
}

// BenchmarkFileIDCheck is what the plain Messages path pays for file
// references: one scan of the body for "file_id".
func BenchmarkFileIDCheck(b *testing.B) {
	body := []byte(benchBody)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if mayReferenceFiles(body) {
			b.Fatal("found")
		}
	}
}

// BenchmarkRouteOf is the route step, which now also knows the batch and
// file paths.
func BenchmarkRouteOf(b *testing.B) {
	req, _ := http.NewRequest(http.MethodPost, "http://relay/v1/messages", nil)
	for b.Loop() {
		if rt, _ := routeOf(req); rt != routeMessages {
			b.Fatal(rt)
		}
	}
}

func TestResourceOptionsInTheCaddyfile(t *testing.T) {
	const rest = "\tchannel c {\n\t\tprovider mock\n\t}\n\tkey sk-relay-options-test-0123456789 g\n\tgroup g {\n\t\tchannels c\n\t}\n}"
	r, err := parseRelay(t, "relay {\n\tresource_secret {env.RELAY_RESOURCE_SECRET}\n\tmax_upload_size 1GB\n\tpricing {\n\t\tm input 3 output 15 batch 0.4\n\t}\n"+rest)
	if err != nil {
		t.Fatal(err)
	}
	if r.ResourceSecret != "{env.RELAY_RESOURCE_SECRET}" || r.MaxUploadSize != 1_000_000_000 || r.Pricing["m"].Batch == nil || *r.Pricing["m"].Batch != 0.4 {
		t.Errorf("parsed %q %d %+v", r.ResourceSecret, r.MaxUploadSize, r.Pricing["m"])
	}
	if newPricebook(r.Pricing).Lookup("m").Batch() != 0.4 || newPricebook(nil).Lookup("claude-sonnet-4-5").Batch() != 0.5 {
		t.Error("the batch factor is not in the rates")
	}
	for _, bad := range []string{"relay {\n\tresource_secret\n", "relay {\n\tmax_upload_size lots\n", "relay {\n\tpricing {\n\t\tm input 1 batch -1\n\t}\n"} {
		if _, err := parseRelay(t, bad+rest); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func TestResourceSecretIsResolvedAndNeverShown(t *testing.T) {
	t.Setenv("RELAY_TEST_RESOURCE_SECRET", "resource-s3cret-value")
	up, _ := storeUpstream(t, "a")
	startRelay(t, "\t\tresource_secret {env.RELAY_TEST_RESOURCE_SECRET}\n"+channelBlock("secret-a", up.URL)+keyAndGroup("g", "secret-a"))
	r := send(t, http.MethodPost, "/v1/messages/batches", clientKey, `{"requests":[{"custom_id":"x","params":{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}}]}`)
	var b struct{ ID string }
	if err := json.Unmarshal(r.body, &b); err != nil || r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if ch, up, ok := resourceid.ParseItem([]byte("resource-s3cret-value"), resourceid.Batch, "g", b.ID); !ok || ch != "secret-a" || !strings.HasPrefix(up, "msgbatch_a0001_") {
		t.Errorf("the id is not sealed with resource_secret: %q %q %v", ch, up, ok)
	}
	resp, err := client.Get(adminURL + "/config/")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Contains(string(cfg), "resource-s3cret-value") || !strings.Contains(string(cfg), "{env.RELAY_TEST_RESOURCE_SECRET}") {
		t.Errorf("GET /config/ shows the secret or lost its placeholder")
	}
}

// TestABatchOfEmptyRequestsIsReadWithinItsSize: reading the models of a
// batch costs nothing per request, whatever it holds, and at most 7 times
// its size when every request names a model of its own.
func TestABatchOfEmptyRequestsIsReadWithinItsSize(t *testing.T) {
	empty := memtest.Repeated(`{"requests":[`, `{}`, `]}`, 8<<20)
	var models []string
	var rerr *relayError
	n := memtest.Allocated(func() { models, rerr = batchModels(empty) })
	if rerr == nil || rerr.msg != "requests: field required, with params.model in each" {
		t.Fatalf("models %v, refusal %v", models, rerr)
	}
	if n > 64<<20 {
		t.Errorf("reading a batch of 8 MiB of empty requests allocated %d MB, want under 64", n>>20)
	}

	size, factor := memtest.BoundedBodies()
	one := memtest.Repeated(`{"requests":[`, `{"custom_id":"a","params":{"model":"claude-sonnet-5-5","max_tokens":1,"messages":[{"role":"user","content":"a"}]}}`, `]}`, 4*size)
	if n := memtest.Allocated(func() { models, rerr = batchModels(one) }); rerr != nil || len(models) != 1 || n > 64<<10 {
		t.Errorf("a batch of one model: %v %v, %d bytes allocated", models, rerr, n)
	}
	many := []byte(`{"requests":[`)
	for i := 0; len(many) < size; i++ {
		many = fmt.Appendf(many, `{"params":{"model":"m-%d"}},`, i)
	}
	many = append(many[:len(many)-1], `]}`...)
	n = memtest.Allocated(func() { models, rerr = batchModels(many) })
	if rerr != nil || models[0] != "m-0" || models[len(models)-1] != fmt.Sprint("m-", len(models)-1) {
		t.Fatalf("%v, models %v...", rerr, models[:2])
	}
	if memtest.PerByte(n, many) > 7*factor {
		t.Errorf("a model per request: %.1f times the body", memtest.PerByte(n, many))
	}
}

// TestFileIDsAreResolvedAsTheyAreFound: a body of many file ids is refused
// at the first that is not the group's, and one id used many times is
// checked once.
func TestFileIDsAreResolvedAsTheyAreFound(t *testing.T) {
	secret := []byte("0123456789abcdef0123456789abcdef")
	g := &group{name: "g", channels: []*channel{{name: "ch", provider: &anthropicprovider.Provider{}}}}
	r := &Relay{owners: owners.New(nil, nil, time.Now)}
	ctx := context.Background()
	if err := r.owners.Record(ctx, resourceid.File, "ch", "file_011CNha8iCJcU1wXNR6q4V8w", "g"); err != nil {
		t.Fatal(err)
	}
	bad := memtest.Repeated(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[`, `{"type":"document","source":{"type":"file","file_id":"file_x"}}`, `]}]}`, 8<<20)
	var rerr *relayError
	n := memtest.Allocated(func() { _, _, _, rerr = r.pinFiles(ctx, secret, g, bad, 0) })
	if rerr == nil || rerr.status != http.StatusNotFound {
		t.Fatalf("refusal %v", rerr)
	}
	if n > 64<<20 {
		t.Errorf("8 MiB of unknown file ids allocated %d MB, want under 64", n>>20)
	}

	size, factor := memtest.BoundedBodies()
	id := resourceid.Item(secret, resourceid.File, "g", "ch", "file_011CNha8iCJcU1wXNR6q4V8w")
	body := memtest.Repeated(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[`, `{"type":"document","source":{"type":"file","file_id":"`+id+`"}}`, `]}]}`, size)
	var out []byte
	var ch *channel
	n = memtest.Allocated(func() { out, ch, _, rerr = r.pinFiles(ctx, secret, g, body, 0) })
	if rerr != nil || ch == nil || bytes.Contains(out, []byte(id)) || !bytes.Contains(out, []byte(`"file_011CNha8iCJcU1wXNR6q4V8w"`)) {
		t.Fatalf("%v %v", rerr, ch)
	}
	if memtest.PerByte(n, body) > 4*factor {
		t.Errorf("one file id, many times: %.1f times the body", memtest.PerByte(n, body))
	}
}
