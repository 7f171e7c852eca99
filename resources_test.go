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

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/caddy-relay/relay/internal/fakeupstream"
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
