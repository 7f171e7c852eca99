package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime/multipart"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/memtest"
	anthropicprovider "github.com/caddy-relay/relay/providers/anthropic"
)

// sdkClient is the official Go SDK pointed at the relay with key.
func sdkClient(key string) anthropic.Client {
	return anthropic.NewClient(option.WithBaseURL(relayURL), option.WithAPIKey(key), option.WithMaxRetries(0))
}

// storeUpstream starts a fake upstream organisation with its own files and
// batches.
func storeUpstream(t *testing.T, name string) (*fakeupstream.Upstream, *fakeupstream.Store) {
	s := fakeupstream.NewStore(name)
	return fakeupstream.New(t, s), s
}

// hitsOn counts the upstream's requests whose path starts with prefix.
func hitsOn(u *fakeupstream.Upstream, prefix string) int {
	n := 0
	for _, r := range u.Requests() {
		if strings.HasPrefix(r.Path, prefix) {
			n++
		}
	}
	return n
}

func TestFilesUploadedThroughTheSDKStayOnTheirChannel(t *testing.T) {
	upA, storeA := storeUpstream(t, "a")
	upB, storeB := storeUpstream(t, "b")
	startRelay(t, channelBlock("files-a", upA.URL)+channelBlock("files-b", upB.URL)+keyAndGroup("g", "files-a files-b"))
	sdk := anthropic.NewClient(option.WithBaseURL(relayURL), option.WithAPIKey(clientKey), option.WithMaxRetries(0),
		option.WithHeader("Anthropic-Beta", "files-api-2025-04-14"))
	ctx := context.Background()

	owners := map[string]int{}
	for i := range 20 {
		content := fmt.Sprintf("document %d", i)
		f, err := sdk.Beta.Files.Upload(ctx, anthropic.BetaFileUploadParams{File: anthropic.File(strings.NewReader(content), fmt.Sprintf("doc%d.txt", i), "text/plain")})
		if err != nil {
			t.Fatalf("upload %d: %v", i, err)
		}
		if !strings.HasPrefix(f.ID, "file_") || strings.HasPrefix(f.ID, "file_a0") || strings.HasPrefix(f.ID, "file_b0") || f.Filename != fmt.Sprintf("doc%d.txt", i) {
			t.Fatalf("upload %d: %+v: want the relay's id and the upstream's metadata", i, f)
		}
		owner, other := upA, upB
		if storeB.Files() > 0 {
			owner, other = upB, upA
			owners["b"]++
		} else {
			owners["a"]++
		}
		before := hitsOn(other, "/v1/files")
		ownerBefore := hitsOn(owner, "/v1/files/")

		meta, err := sdk.Beta.Files.GetMetadata(ctx, f.ID, anthropic.BetaFileGetMetadataParams{})
		if err != nil || meta.ID != f.ID || meta.SizeBytes != int64(len(content)) {
			t.Fatalf("metadata %d: %v %+v", i, err, meta)
		}
		resp, err := sdk.Beta.Files.Download(ctx, f.ID, anthropic.BetaFileDownloadParams{})
		if err != nil {
			t.Fatalf("download %d: %v", i, err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(got) != content {
			t.Fatalf("download %d = %q, want %q", i, got, content)
		}
		del, err := sdk.Beta.Files.Delete(ctx, f.ID, anthropic.BetaFileDeleteParams{})
		if err != nil || del.ID != f.ID {
			t.Fatalf("delete %d: %v %+v", i, err, del)
		}
		if n := hitsOn(other, "/v1/files"); n != before {
			t.Fatalf("file %d: the channel that does not hold it was asked %d times", i, n-before)
		}
		if n := hitsOn(owner, "/v1/files/") - ownerBefore; n != 3 {
			t.Fatalf("file %d: the owner was asked %d times, want 3", i, n)
		}
		last := owner.Last(t)
		if last.Method != http.MethodDelete || !strings.HasPrefix(last.Path, "/v1/files/file_") || last.Header.Get("X-Api-Key") != channelKey ||
			!strings.Contains(last.Header.Get("Anthropic-Beta"), "files-api-2025-04-14") {
			t.Fatalf("file %d: the owner's last request %s %s, beta %q", i, last.Method, last.Path, last.Header.Get("Anthropic-Beta"))
		}
	}
	if owners["a"] == 0 || owners["b"] == 0 {
		t.Errorf("20 uploads all went to one channel: %v", owners)
	}
	if storeA.Files()+storeB.Files() != 0 {
		t.Errorf("files left after the deletes: %d, %d", storeA.Files(), storeB.Files())
	}
	mf, _ := scrape(t)
	if v := max(value(mf, "relay_resource_requests_total", "channel=files-a", "op=content"), 0) + max(value(mf, "relay_resource_requests_total", "channel=files-b", "op=content"), 0); v != 20 {
		t.Errorf("relay_resource_requests_total{op=content} = %v, want 20", v)
	}
}

func TestBatchesLiveOnTheirChannelAndAreAccountedOnce(t *testing.T) {
	upA, storeA := storeUpstream(t, "a")
	upB, storeB := storeUpstream(t, "b")
	startRelay(t, channelBlock("batch-a", upA.URL)+channelBlock("batch-b", upB.URL)+keyAndGroup("g", "batch-a batch-b"))
	sdk := sdkClient(clientKey)
	ctx := context.Background()
	req := func(id string) anthropic.MessageBatchNewParamsRequest {
		return anthropic.MessageBatchNewParamsRequest{CustomID: id, Params: anthropic.MessageBatchNewParamsRequestParams{
			Model: "claude-sonnet-4-5", MaxTokens: 16, Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hi"))}}}
	}
	for i := range 6 {
		b, err := sdk.Messages.Batches.New(ctx, anthropic.MessageBatchNewParams{Requests: []anthropic.MessageBatchNewParamsRequest{req("one"), req("two")}})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		if !strings.HasPrefix(b.ID, "msgbatch_") || !strings.HasPrefix(b.ResultsURL, relayURL+"/v1/messages/batches/"+b.ID+"/results") {
			t.Fatalf("create %d: id %q, results_url %q", i, b.ID, b.ResultsURL)
		}
		owner, ownerName, other := upA, "batch-a", upB
		if storeB.Batches() > 0 {
			owner, ownerName, other = upB, "batch-b", upA
		}
		otherBefore := hitsOn(other, "/v1/messages/batches")
		mf, _ := scrape(t)
		costBefore := max(value(mf, "relay_cost_usd_total", "channel="+ownerName), 0)

		got, err := sdk.Messages.Batches.Get(ctx, b.ID, anthropic.MessageBatchGetParams{})
		if err != nil || got.ID != b.ID || got.ProcessingStatus != anthropic.MessageBatchProcessingStatusEnded {
			t.Fatalf("get %d: %v %+v", i, err, got)
		}
		for read := range 2 {
			stream := sdk.Messages.Batches.ResultsStreaming(ctx, b.ID, anthropic.MessageBatchResultsParams{})
			var ids []string
			for stream.Next() {
				ids = append(ids, stream.Current().CustomID)
			}
			if err := stream.Err(); err != nil || !slices.Equal(ids, []string{"one", "two"}) {
				t.Fatalf("results %d, read %d: %v %v", i, read, err, ids)
			}
		}
		mf, _ = scrape(t)
		// two replies of 10 input and 5 output tokens at 3 and 15 USD per
		// million, at half price, once for both reads
		want := 2 * (10*3 + 5*15) / 1e6 * 0.5
		if cost := value(mf, "relay_cost_usd_total", "channel="+ownerName) - costBefore; math.Abs(cost-want) > 1e-12 {
			t.Fatalf("batch %d cost %v, want %v (the batch price, once)", i, cost, want)
		}
		if _, err := sdk.Messages.Batches.Cancel(ctx, b.ID, anthropic.MessageBatchCancelParams{}); err != nil {
			t.Fatalf("cancel %d: %v", i, err)
		}
		del, err := sdk.Messages.Batches.Delete(ctx, b.ID, anthropic.MessageBatchDeleteParams{})
		if err != nil || del.ID != b.ID {
			t.Fatalf("delete %d: %v %+v", i, err, del)
		}
		if n := hitsOn(other, "/v1/messages/batches"); n != otherBefore {
			t.Fatalf("batch %d: the channel that does not hold it was asked", i)
		}
		if l := owner.Last(t); l.Method != http.MethodDelete {
			t.Fatalf("batch %d: the owner's last request is %s %s", i, l.Method, l.Path)
		}
		if storeA.Batches()+storeB.Batches() != 0 {
			t.Fatalf("batch %d is still stored", i)
		}
	}
	mf, _ := scrape(t)
	// a channel that took none of the six has no series (value says -1):
	// one in 32 runs, every batch goes to one channel
	if n := max(value(mf, "relay_batch_results_accounted_total", "channel=batch-a"), 0) + max(value(mf, "relay_batch_results_accounted_total", "channel=batch-b"), 0); n != 6 {
		t.Errorf("relay_batch_results_accounted_total = %v, want 6", n)
	}
}

// seedFile uploads a file straight to a fake upstream.
func seedFile(t *testing.T, u *fakeupstream.Upstream, name string) {
	t.Helper()
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	w, _ := mw.CreateFormFile("file", name)
	_, _ = w.Write([]byte(name))
	_ = mw.Close()
	seed(t, u, "/v1/files", mw.FormDataContentType(), &body)
}

// seed posts to the upstream as a client of its organisation would,
// outside the relay.
func seed(t *testing.T, u *fakeupstream.Upstream, path, contentType string, body io.Reader) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, u.URL+path, body)
	req.Header.Set("Content-Type", contentType)
	req.Header.Set("X-Api-Key", fakeupstream.Key)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("seeding %s: %v", path, err)
	}
	resp.Body.Close()
}

func seedBatch(t *testing.T, u *fakeupstream.Upstream, name string) {
	t.Helper()
	seed(t, u, "/v1/messages/batches", "application/json",
		strings.NewReader(`{"requests":[{"custom_id":"`+name+`","params":{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}}]}`))
}

func TestListsMergeTheGroupsChannelsAcrossPages(t *testing.T) {
	upA, _ := storeUpstream(t, "a")
	upB, _ := storeUpstream(t, "b")
	upC, _ := storeUpstream(t, "c") // another group's
	const otherKey = "sk-client-list-other-0123456789"
	startRelay(t, channelBlock("list-a", upA.URL)+channelBlock("list-b", upB.URL)+channelBlock("list-c", upC.URL)+
		keyAndGroup("g", "list-a list-b")+"\t\tkey "+otherKey+" other\n\t\tgroup other {\n\t\t\tchannels list-c\n\t\t}\n")
	// made through the relay in this order, one second apart: newest first
	// is the reverse
	var want []string
	for i, on := range []string{"a", "b", "b", "a", "a", "b", "a", "c", "b", "b", "a"} {
		name := fmt.Sprintf("item%02d", i)
		if on == "c" {
			uploadAs(t, otherKey, name+".txt")
			batchAs(t, otherKey, name)
			continue
		}
		other := map[string]string{"a": "list-b", "b": "list-a"}[on]
		adminPost(t, other, "disable")
		uploadAs(t, clientKey, name+".txt")
		batchAs(t, clientKey, name)
		adminPost(t, other, "enable")
		want = append([]string{name}, want...)
	}
	// and some made at the upstreams themselves, which no list shows
	seedFile(t, upA, "outside.txt")
	seedBatch(t, upB, "outside")
	sdk := sdkClient(clientKey)
	ctx := context.Background()

	var files []string
	pager := sdk.Beta.Files.ListAutoPaging(ctx, anthropic.BetaFileListParams{Limit: anthropic.Int(3)})
	for pager.Next() {
		files = append(files, strings.TrimSuffix(pager.Current().Filename, ".txt"))
	}
	if err := pager.Err(); err != nil || !slices.Equal(files, want) {
		t.Fatalf("files, 3 a page: %v\n got %v\nwant %v", err, files, want)
	}

	var batches []string
	var ids []string
	bp := sdk.Messages.Batches.ListAutoPaging(ctx, anthropic.MessageBatchListParams{Limit: anthropic.Int(4)})
	for bp.Next() {
		b := bp.Current()
		ids = append(ids, b.ID)
		stream := sdk.Messages.Batches.ResultsStreaming(ctx, b.ID, anthropic.MessageBatchResultsParams{})
		for stream.Next() {
			batches = append(batches, stream.Current().CustomID)
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := bp.Err(); err != nil || !slices.Equal(batches, want) {
		t.Fatalf("batches, 4 a page: %v\n got %v\nwant %v", err, batches, want)
	}

	// a page by hand: has_more, the cursor, the last page
	r := send(t, http.MethodGet, "/v1/messages/batches?limit=9", clientKey, "")
	var page struct {
		Data    []struct{ ID string } `json:"data"`
		HasMore bool                  `json:"has_more"`
		FirstID string                `json:"first_id"`
		LastID  string                `json:"last_id"`
	}
	if err := json.Unmarshal(r.body, &page); err != nil || r.status != 200 || len(page.Data) != 9 || !page.HasMore || page.FirstID != ids[0] {
		t.Fatalf("first page: %d %s", r.status, r.body)
	}
	r = send(t, http.MethodGet, "/v1/messages/batches?limit=9&after_id="+page.LastID, clientKey, "")
	if err := json.Unmarshal(r.body, &page); err != nil || len(page.Data) != 1 || page.HasMore || page.Data[0].ID != ids[9] || page.LastID != ids[9] {
		t.Fatalf("last page: %d %s", r.status, r.body)
	}
	// the cursor is the group's own
	wantRelayError(t, send(t, http.MethodGet, "/v1/messages/batches?before_id="+ids[3], clientKey, ""), 400, "invalid_request_error", "")
}

func TestMessagesReferencingAFileGoToItsChannel(t *testing.T) {
	upA, storeA := storeUpstream(t, "a")
	upB, _ := storeUpstream(t, "b")
	startRelay(t, channelBlock("ref-a", upA.URL, "models claude-sonnet-4-5 claude-haiku-4-5")+channelBlock("ref-b", upB.URL, "models claude-sonnet-4-5 claude-opus-4-1")+
		keyAndGroup("g", "ref-a ref-b"))
	sdk := sdkClient(clientKey)
	ctx := context.Background()
	var id, upstreamID string
	var owner, other *fakeupstream.Upstream
	for id == "" || owner != upA { // a file on ref-a, the channel that lacks opus
		f, err := sdk.Beta.Files.Upload(ctx, anthropic.BetaFileUploadParams{File: anthropic.File(strings.NewReader("%PDF"), "a.pdf", "application/pdf")})
		if err != nil {
			t.Fatal(err)
		}
		id, owner, other = f.ID, upB, upA
		if storeA.Files() > 0 {
			owner, other = upA, upB
			upstreamID = fmt.Sprintf("file_a%04d", 1)
		}
	}
	body := `{"max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"file","file_id":"` + id +
		`"}},{"type":"text","text":"Summarize"}]}],"model":"claude-sonnet-4-5"}`
	for range 10 {
		otherBefore := hitsOn(other, "/v1/messages")
		r := message(t, body, "Anthropic-Beta", "files-api-2025-04-14")
		if r.status != 200 || !strings.Contains(string(r.body), "a saw files "+upstreamID) {
			t.Fatalf("message: %d %s", r.status, r.body)
		}
		if hitsOn(other, "/v1/messages") != otherBefore {
			t.Fatal("a message with a file went to the channel that does not hold it")
		}
	}
	last := owner.Last(t)
	if strings.Contains(string(last.Body), id) || !strings.Contains(string(last.Body), `"model":"claude-sonnet-4-5"`) {
		t.Errorf("the upstream got %s", last.Body)
	}
	// a model the file's channel does not serve
	wantRelayError(t, message(t, strings.Replace(body, "claude-sonnet-4-5", "claude-opus-4-1", 1)), 400, "invalid_request_error", "")
	// an id that is not the relay's
	wantRelayError(t, message(t, strings.Replace(body, id, "file_011CNha8iCJcU1wXNR6q4V8w", 1)), 404, "not_found_error", "")
}

func TestResourceIDsRefuseTamperingOtherGroupsAndGoneChannels(t *testing.T) {
	up, _ := storeUpstream(t, "a")
	const otherKey = "sk-client-other-group-0123456789"
	cfg := func(channels string) string {
		return channelBlock("ids-a", up.URL) + channelBlock("ids-b", up.URL) + keyAndGroup("g", channels) +
			"\t\tkey " + otherKey + " other\n\t\tgroup other {\n\t\t\tchannels ids-a ids-b\n\t\t}\n"
	}
	startRelay(t, cfg("ids-a"))
	sdk := sdkClient(clientKey)
	ctx := context.Background()
	f, err := sdk.Beta.Files.Upload(ctx, anthropic.BetaFileUploadParams{File: anthropic.File(strings.NewReader("x"), "x.txt", "text/plain")})
	if err != nil {
		t.Fatal(err)
	}
	hits := up.Hits()
	tampered := []byte(f.ID)
	tampered[len(tampered)/2] ^= 1
	for _, tc := range []struct {
		name, id, key string
	}{
		{"tampered", string(tampered), clientKey},
		{"another group", f.ID, otherKey},
		{"unknown", "file_011CNha8iCJcU1wXNR6q4V8w", clientKey},
		{"not base64", "file_!!!", clientKey},
		{"truncated", f.ID[:20], clientKey},
		{"a batch's prefix", "msgbatch_" + strings.TrimPrefix(f.ID, "file_"), clientKey},
	} {
		path := "/v1/files/" + tc.id
		if strings.HasPrefix(tc.id, "msgbatch_") {
			path = "/v1/messages/batches/" + tc.id
		}
		wantRelayError(t, send(t, http.MethodGet, path, tc.key, ""), 404, "not_found_error", "")
	}
	if up.Hits() != hits {
		t.Errorf("an id the relay refused reached the upstream")
	}

	// the owner cooling (disabled here): 503, never another channel
	adminPost(t, "ids-a", "disable")
	wantRelayError(t, send(t, http.MethodGet, "/v1/files/"+f.ID, clientKey, ""), 503, "relay_error", "no_healthy_channel")
	adminPost(t, "ids-a", "enable")
	if r := send(t, http.MethodGet, "/v1/files/"+f.ID, clientKey, ""); r.status != 200 {
		t.Fatalf("after enable: %d %s", r.status, r.body)
	}

	// the owner leaves the group: the id says so
	startRelay(t, cfg("ids-b"))
	r := send(t, http.MethodGet, "/v1/files/"+f.ID, clientKey, "")
	wantRelayError(t, r, 404, "not_found_error", "")
	if !strings.Contains(string(r.body), `\"ids-a\", is no longer a channel of group \"g\"`) {
		t.Errorf("gone channel: %s", r.body)
	}
}

func TestUploadsFailOverOnlyBeforeTheirFirstByte(t *testing.T) {
	up, store := storeUpstream(t, "a")
	dead := fakeupstream.DeadURL(t)
	startRelay(t, channelBlock("up-dead", dead, "priority 1")+channelBlock("up-live", up.URL, "priority 2")+keyAndGroup("g", "up-dead up-live")+
		"\t\tmax_upload_size 1KB\n")
	sdk := sdkClient(clientKey)
	f, err := sdk.Beta.Files.Upload(context.Background(), anthropic.BetaFileUploadParams{File: anthropic.File(strings.NewReader("hello"), "h.txt", "text/plain")})
	if err != nil || store.Files() != 1 {
		t.Fatalf("upload with a dead first channel: %v", err)
	}
	_ = f
	_, err = sdk.Beta.Files.Upload(context.Background(), anthropic.BetaFileUploadParams{File: anthropic.File(strings.NewReader(strings.Repeat("x", 2000)), "big.txt", "text/plain")})
	var apiErr *anthropic.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 413 || store.Files() != 1 {
		t.Fatalf("upload over max_upload_size: %v", err)
	}
}

func TestResourceRoutesAndMethods(t *testing.T) {
	for _, tc := range []struct {
		method, path string
		kind         resourceKind
		op           resourceOp
		id           string
		status       int
	}{
		{"POST", "/v1/files", kindFile, opCreate, "", 0},
		{"GET", "/v1/files", kindFile, opList, "", 0},
		{"GET", "/v1/files/file_x", kindFile, opGet, "file_x", 0},
		{"DELETE", "/v1/files/file_x", kindFile, opDelete, "file_x", 0},
		{"GET", "/v1/files/file_x/content", kindFile, opContent, "file_x", 0},
		{"POST", "/v1/messages/batches", kindBatch, opCreate, "", 0},
		{"GET", "/v1/messages/batches/b", kindBatch, opGet, "b", 0},
		{"POST", "/v1/messages/batches/b/cancel", kindBatch, opCancel, "b", 0},
		{"GET", "/v1/messages/batches/b/results", kindBatch, opResults, "b", 0},
		{"DELETE", "/v1/messages/batches", kindBatch, 0, "", 405},
		{"GET", "/v1/files/file_x/results", kindFile, 0, "", 404},
		{"GET", "/v1/messages/batches/b/content", kindBatch, 0, "", 404},
		{"GET", "/v1/files/a/b/c", kindFile, 0, "", 404},
		{"PUT", "/v1/files/file_x", kindFile, 0, "", 405},
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

func TestItemIDsAndCursorsRoundTrip(t *testing.T) {
	secret := []byte("s3cret")
	for _, up := range []string{"file_011CNha8iCJcU1wXNR6q4V8w", "weird-id", "file_"} {
		id := itemID(secret, kindFile, "g", "channel-é", up)
		if !strings.HasPrefix(id, "file_") {
			t.Errorf("id %q lost its prefix", id)
		}
		ch, got, ok := parseItemID(secret, kindFile, "g", id)
		if !ok || ch != "channel-é" || got != up && up != "file_" {
			t.Errorf("%q: %q %q %v", up, ch, got, ok)
		}
		if _, _, ok := parseItemID(secret, kindFile, "h", id); ok {
			t.Errorf("another group's id was accepted")
		}
		if _, _, ok := parseItemID([]byte("other"), kindFile, "g", id); ok {
			t.Errorf("an id of another secret was accepted")
		}
	}
	pos := []listPos{{channel: "a", mode: posAfter, value: "msgbatch_1"}, {channel: "b", mode: posPage, value: "page_x", skip: 3}, {channel: "c", mode: posDone}}
	c := sealCursor(secret, kindBatch, "g", pos)
	got, ok := openCursor(secret, kindBatch, "g", c)
	if !ok || !slices.Equal(got, pos) {
		t.Errorf("cursor: %+v %v", got, ok)
	}
	if _, _, ok := parseItemID(secret, kindBatch, "g", c); ok {
		t.Errorf("a cursor was taken for an item")
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
	if newPricebook(r.Pricing).lookup("m").batch != 0.4 || newPricebook(nil).lookup("claude-sonnet-4-5").batch != 0.5 {
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
	if ch, up, ok := parseItemID([]byte("resource-s3cret-value"), kindBatch, "g", b.ID); !ok || ch != "secret-a" || !strings.HasPrefix(up, "msgbatch_a0001_") {
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
	r := &Relay{owners: newOwnerStore(nil, nil, time.Now)}
	ctx := context.Background()
	if err := r.owners.record(ctx, kindFile, "ch", "file_011CNha8iCJcU1wXNR6q4V8w", "g"); err != nil {
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
	id := itemID(secret, kindFile, "g", "ch", "file_011CNha8iCJcU1wXNR6q4V8w")
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
