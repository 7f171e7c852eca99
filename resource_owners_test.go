package relay

// A group sees and touches only the batches and files it made through the
// relay: two groups share one channel (one upstream organisation), and
// neither sees, reads, cancels or deletes the other's items, nor those
// made at the upstream itself.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"mime/multipart"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/owners"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddy-relay/relay/internal/resourceid"
)

const (
	ownerKeyA    = "sk-client-owners-a-0123456789abcdef"
	ownerKeyB    = "sk-client-owners-b-0123456789abcdef"
	ownersSecret = "owners-test-resource-secret"
)

// groupsAAndB renders a relay whose groups owners-a (ownerKeyA) and owners-b
// (ownerKeyB) share the channels (name=url), with a resource_secret the
// test knows.
func groupsAAndB(t *testing.T, channels ...string) string {
	t.Setenv("RELAY_TEST_OWNERS_SECRET", ownersSecret)
	var b strings.Builder
	b.WriteString("\t\tresource_secret {env.RELAY_TEST_OWNERS_SECRET}\n")
	var names []string
	for _, c := range channels {
		name, url, _ := strings.Cut(c, "=")
		names = append(names, name)
		b.WriteString(channelBlock(name, url))
	}
	fmt.Fprintf(&b, "\t\tkey %s owners-a\n\t\tkey %s owners-b\n", ownerKeyA, ownerKeyB)
	for _, g := range []string{"owners-a", "owners-b"} {
		fmt.Fprintf(&b, "\t\tgroup %s {\n\t\t\tchannels %s\n\t\t}\n", g, strings.Join(names, " "))
	}
	return b.String()
}

// uploadAs uploads a file named name, whose content is its name, through
// the relay with key, and returns the id the client got.
func uploadAs(t *testing.T, key, name string) string {
	t.Helper()
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	w, _ := mw.CreateFormFile("file", name)
	_, _ = w.Write([]byte(name))
	_ = mw.Close()
	r := send(t, http.MethodPost, "/v1/files", key, body.String(), "Content-Type", mw.FormDataContentType(), "Anthropic-Beta", "files-api-2025-04-14")
	var f struct{ ID string }
	if err := json.Unmarshal(r.body, &f); err != nil || r.status != 200 || !strings.HasPrefix(f.ID, "file_") {
		t.Fatalf("upload %s: %d %s", name, r.status, r.body)
	}
	return f.ID
}

// batchBody is a batch of one request, custom_id name.
func batchBody(name string) string {
	return `{"requests":[{"custom_id":"` + name + `","params":{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}}]}`
}

// batchAs creates a batch of one request, custom_id name, through the
// relay with key, and returns its id.
func batchAs(t *testing.T, key, name string) string {
	t.Helper()
	r := send(t, http.MethodPost, "/v1/messages/batches", key, batchBody(name))
	var b struct{ ID string }
	if err := json.Unmarshal(r.body, &b); err != nil || r.status != 200 || !strings.HasPrefix(b.ID, "msgbatch_") {
		t.Fatalf("batch %s: %d %s", name, r.status, r.body)
	}
	return b.ID
}

// listAnswer is one page of a list, as the relay answered it.
type listAnswer struct {
	Data []struct {
		ID string `json:"id"`
	} `json:"data"`
	HasMore bool   `json:"has_more"`
	LastID  string `json:"last_id"`
}

func (l listAnswer) ids() []string {
	var ids []string
	for _, d := range l.Data {
		ids = append(ids, d.ID)
	}
	return ids
}

func listAs(t *testing.T, key, path string) listAnswer {
	t.Helper()
	r := send(t, http.MethodGet, path, key, "")
	var l listAnswer
	if err := json.Unmarshal(r.body, &l); err != nil || r.status != 200 {
		t.Fatalf("GET %s: %d %s", path, r.status, r.body)
	}
	return l
}

// pagedFiles and pagedBatches list with the official SDK's auto-paging,
// limit a page, and return the ids.
func pagedFiles(t *testing.T, key string, limit int) []string {
	t.Helper()
	var ids []string
	sdk := sdkClient(key)
	p := sdk.Beta.Files.ListAutoPaging(context.Background(), anthropic.BetaFileListParams{Limit: anthropic.Int(int64(limit))})
	for p.Next() {
		ids = append(ids, p.Current().ID)
	}
	if err := p.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

func pagedBatches(t *testing.T, key string, limit int) []string {
	t.Helper()
	var ids []string
	sdk := sdkClient(key)
	p := sdk.Messages.Batches.ListAutoPaging(context.Background(), anthropic.MessageBatchListParams{Limit: anthropic.Int(int64(limit))})
	for p.Next() {
		ids = append(ids, p.Current().ID)
	}
	if err := p.Err(); err != nil {
		t.Fatal(err)
	}
	return ids
}

// newestAt is the upstream's own id of the newest item of its list at
// path, asked of the upstream directly.
func newestAt(t *testing.T, up *fakeupstream.Upstream, path string) string {
	t.Helper()
	resp := upstreamGet(t, up.URL+path+"?limit=1")
	defer resp.Body.Close()
	var l listAnswer
	if err := json.NewDecoder(resp.Body).Decode(&l); err != nil || len(l.Data) != 1 {
		t.Fatalf("the upstream's list %s: %v", path, err)
	}
	return l.Data[0].ID
}

// wantNotFound checks the answer to an id that names nothing the group
// may see: exactly the answer to an id that does not exist.
func wantNotFound(t *testing.T, r reply, kind resourceid.Kind, id string) {
	t.Helper()
	var e errorJSON
	if err := json.Unmarshal(r.body, &e); err != nil || r.status != 404 || e.Type != "error" || e.Error.Type != "not_found_error" ||
		e.Error.Message != errResourceNotFound(kind, id).msg || e.Error.Code != "" {
		t.Errorf("want the answer to an id that does not exist (404 not_found_error %q), got %d %s", errResourceNotFound(kind, id).msg, r.status, r.body)
	}
}

// hasOwnerRecord reports whether Caddy's storage holds an owner record of the
// item up at channel.
func hasOwnerRecord(t *testing.T, kind resourceid.Kind, channel, up string) bool {
	t.Helper()
	return caddy.DefaultStorage.Exists(context.Background(), owners.StorageKey(kind, channel, up))
}

func TestAGroupSeesAndTouchesOnlyItsOwnFilesAndBatches(t *testing.T) {
	up, store := storeUpstream(t, "own")
	startRelay(t, groupsAAndB(t, "owners-x="+up.URL))
	secret := []byte(ownersSecret)

	// A's items first; then 25 of B's, newer; then one of each made at the
	// upstream itself, newest of all
	var aFiles, aBatches, bFiles, bBatches []string // newest first
	for i := range 2 {
		aFiles = slices.Insert(aFiles, 0, uploadAs(t, ownerKeyA, fmt.Sprintf("a-%d.txt", i)))
		aBatches = slices.Insert(aBatches, 0, batchAs(t, ownerKeyA, fmt.Sprintf("a-%d", i)))
	}
	for i := range 25 {
		bFiles = slices.Insert(bFiles, 0, uploadAs(t, ownerKeyB, fmt.Sprintf("b-%d.txt", i)))
		bBatches = slices.Insert(bBatches, 0, batchAs(t, ownerKeyB, fmt.Sprintf("b-%d", i)))
	}
	seedFile(t, up, "outside.txt")
	seedBatch(t, up, "outside")
	outsideFile, outsideBatch := newestAt(t, up, "/v1/files"), newestAt(t, up, "/v1/messages/batches")

	// A's first page holds A's items, behind the 26 newer of others
	if l := listAs(t, ownerKeyA, "/v1/files?limit=5"); !slices.Equal(l.ids(), aFiles) || l.HasMore {
		t.Errorf("A's first page of files: %v (has_more %v), want %v", l.ids(), l.HasMore, aFiles)
	}
	if l := listAs(t, ownerKeyA, "/v1/messages/batches?limit=5"); !slices.Equal(l.ids(), aBatches) || l.HasMore {
		t.Errorf("A's first page of batches: %v (has_more %v), want %v", l.ids(), l.HasMore, aBatches)
	}
	// the SDK's paging finds the same, and B's 25, 10 a page
	if got := pagedFiles(t, ownerKeyA, 1); !slices.Equal(got, aFiles) {
		t.Errorf("A's files, paged: %v, want %v", got, aFiles)
	}
	if got := pagedBatches(t, ownerKeyA, 1); !slices.Equal(got, aBatches) {
		t.Errorf("A's batches, paged: %v, want %v", got, aBatches)
	}
	if got := pagedFiles(t, ownerKeyB, 10); !slices.Equal(got, bFiles) {
		t.Errorf("B's files, paged: %v, want %v", got, bFiles)
	}
	if got := pagedBatches(t, ownerKeyB, 10); !slices.Equal(got, bBatches) {
		t.Errorf("B's batches, paged: %v, want %v", got, bBatches)
	}

	// ids of B's items sealed for A, as merged lists gave them before the
	// relay kept owners, and of the upstream's own items sealed for each
	upstreamID := func(kind resourceid.Kind, id string) string {
		_, up, ok := resourceid.ParseItem(secret, kind, "owners-b", id)
		if !ok {
			t.Fatalf("%s is not B's id", id)
		}
		return up
	}
	leakedFile := resourceid.Item(secret, resourceid.File, "owners-a", "owners-x", upstreamID(resourceid.File, bFiles[0]))
	leakedBatch := resourceid.Item(secret, resourceid.Batch, "owners-a", "owners-x", upstreamID(resourceid.Batch, bBatches[0]))
	hits := up.Hits()
	for _, c := range []struct{ key, id string }{
		{ownerKeyA, leakedFile}, {ownerKeyA, resourceid.Item(secret, resourceid.File, "owners-a", "owners-x", outsideFile)},
		{ownerKeyB, resourceid.Item(secret, resourceid.File, "owners-b", "owners-x", outsideFile)},
	} {
		for _, call := range []struct{ method, path string }{{"GET", ""}, {"GET", "/content"}, {"DELETE", ""}} {
			wantNotFound(t, send(t, call.method, "/v1/files/"+c.id+call.path, c.key, ""), resourceid.File, c.id)
		}
	}
	for _, c := range []struct{ key, id string }{
		{ownerKeyA, leakedBatch}, {ownerKeyA, resourceid.Item(secret, resourceid.Batch, "owners-a", "owners-x", outsideBatch)},
		{ownerKeyB, resourceid.Item(secret, resourceid.Batch, "owners-b", "owners-x", outsideBatch)},
	} {
		for _, call := range []struct{ method, path string }{{"GET", ""}, {"GET", "/results"}, {"POST", "/cancel"}, {"DELETE", ""}} {
			wantNotFound(t, send(t, call.method, "/v1/messages/batches/"+c.id+call.path, c.key, ""), resourceid.Batch, c.id)
		}
	}
	// a message, and a batch, that use B's file
	withFile := func(id string) string {
		return `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":[` +
			`{"type":"document","source":{"type":"file","file_id":"` + id + `"}},{"type":"text","text":"Summarize"}]}]}`
	}
	wantNotFound(t, send(t, http.MethodPost, "/v1/messages", ownerKeyA, withFile(leakedFile)), resourceid.File, leakedFile)
	wantNotFound(t, send(t, http.MethodPost, "/v1/messages/batches", ownerKeyA, `{"requests":[{"custom_id":"x","params":`+withFile(leakedFile)+`}]}`), resourceid.File, leakedFile)
	if up.Hits() != hits {
		t.Errorf("calls on items the group did not make reached the upstream %d times", up.Hits()-hits)
	}
	if store.Files() != 28 || store.Batches() != 28 {
		t.Fatalf("the upstream holds %d files and %d batches, want 28 of each", store.Files(), store.Batches())
	}

	// B uses its own
	if r := send(t, http.MethodGet, "/v1/files/"+bFiles[0]+"/content", ownerKeyB, ""); r.status != 200 || string(r.body) != "b-24.txt" {
		t.Errorf("B's content: %d %s", r.status, r.body)
	}
	if r := send(t, http.MethodGet, "/v1/messages/batches/"+bBatches[0]+"/results", ownerKeyB, ""); r.status != 200 || !strings.Contains(string(r.body), `"custom_id":"b-24"`) {
		t.Errorf("B's results: %d %s", r.status, r.body)
	}
	if r := send(t, http.MethodPost, "/v1/messages", ownerKeyB, withFile(bFiles[0])); r.status != 200 || !strings.Contains(string(r.body), "own saw files "+upstreamID(resourceid.File, bFiles[0])) {
		t.Errorf("B's message with its file: %d %s", r.status, r.body)
	}

	// a delete removes the record
	for _, d := range []struct {
		kind resourceid.Kind
		path string
		id   string
	}{{resourceid.File, "/v1/files/", bFiles[0]}, {resourceid.Batch, "/v1/messages/batches/", bBatches[0]}} {
		upID := upstreamID(d.kind, d.id)
		if !hasOwnerRecord(t, d.kind, "owners-x", upID) {
			t.Fatalf("no owner record of %s in Caddy's storage", d.id)
		}
		if r := send(t, http.MethodDelete, d.path+d.id, ownerKeyB, ""); r.status != 200 {
			t.Fatalf("B's delete: %d %s", r.status, r.body)
		}
		if hasOwnerRecord(t, d.kind, "owners-x", upID) {
			t.Errorf("the owner record of %s outlived its delete", d.id)
		}
		wantNotFound(t, send(t, http.MethodGet, d.path+d.id, ownerKeyB, ""), d.kind, d.id)
	}
}

func TestAListFindsTheGroupsItemsAmongOthersPageByPage(t *testing.T) {
	up, _ := storeUpstream(t, "mix")
	startRelay(t, groupsAAndB(t, "owners-mix="+up.URL))
	// A's items, each followed by 7 of B's and one made at the upstream
	var aFiles, aBatches []string
	for i := range 4 {
		aFiles = slices.Insert(aFiles, 0, uploadAs(t, ownerKeyA, fmt.Sprintf("a-%d.txt", i)))
		aBatches = slices.Insert(aBatches, 0, batchAs(t, ownerKeyA, fmt.Sprintf("a-%d", i)))
		for j := range 7 {
			uploadAs(t, ownerKeyB, fmt.Sprintf("b-%d-%d.txt", i, j))
			batchAs(t, ownerKeyB, fmt.Sprintf("b-%d-%d", i, j))
		}
		seedFile(t, up, fmt.Sprintf("outside-%d.txt", i))
		seedBatch(t, up, fmt.Sprintf("outside-%d", i))
	}
	for _, limit := range []int{1, 2, 3, 20} {
		if got := pagedFiles(t, ownerKeyA, limit); !slices.Equal(got, aFiles) {
			t.Errorf("A's files, %d a page: %v, want %v", limit, got, aFiles)
		}
		if got := pagedBatches(t, ownerKeyA, limit); !slices.Equal(got, aBatches) {
			t.Errorf("A's batches, %d a page: %v, want %v", limit, got, aBatches)
		}
	}
	// by hand: each page's cursor starts the next after the items skipped
	l := listAs(t, ownerKeyA, "/v1/messages/batches?limit=3")
	if !slices.Equal(l.ids(), aBatches[:3]) || !l.HasMore {
		t.Fatalf("first page: %v %v", l.ids(), l.HasMore)
	}
	before := len(up.Requests())
	l = listAs(t, ownerKeyA, "/v1/messages/batches?limit=3&after_id="+l.LastID)
	if !slices.Equal(l.ids(), aBatches[3:]) || l.HasMore {
		t.Fatalf("second page: %v %v", l.ids(), l.HasMore)
	}
	// it asked from just before A's last batch: one upstream page, 3 items
	reqs := up.Requests()[before:]
	if len(reqs) != 1 || !strings.Contains(reqs[0].RawQuery, "limit=3") || !strings.Contains(reqs[0].RawQuery, "after_id=") {
		t.Errorf("the second page asked the upstream %d times: %+v", len(reqs), reqs)
	}
}

func TestAListScansABoundedPartOfTheUpstreamList(t *testing.T) {
	upFar, storeFar := storeUpstream(t, "far")
	upNear, _ := storeUpstream(t, "near")
	startRelay(t, groupsAAndB(t, "owners-far="+upFar.URL, "owners-near="+upNear.URL))
	on := func(other, name string) string { // made on the channel that is not other
		adminPost(t, other, "disable")
		defer adminPost(t, other, "enable")
		return batchAs(t, ownerKeyA, name)
	}
	// oldest first: A's batch on near, A's batch on far, then more items
	// made at far's upstream than one list scans, then A's newest on near
	nearOld := on("owners-far", "near-old")
	farOld := on("owners-near", "far-old")
	storeFar.SeedBatches(listScanPageSize*(listScanPages-1) + 100)
	nearNew := on("owners-far", "near-new")

	listed := func() int {
		n := 0
		for _, r := range upFar.Requests() {
			if r.Method == http.MethodGet && r.Path == "/v1/messages/batches" {
				n++
			}
		}
		return n
	}
	// far's scan stops at its bound before far-old: near's newest shows,
	// and near's older one waits, since far may hold newer ones
	before := listed()
	l := listAs(t, ownerKeyA, "/v1/messages/batches?limit=3")
	if !slices.Equal(l.ids(), []string{nearNew}) || !l.HasMore {
		t.Fatalf("first page: %v (has_more %v), want [near-new]", l.ids(), l.HasMore)
	}
	if n := listed() - before; n != listScanPages {
		t.Errorf("the first page read %d of far's upstream pages, want %d", n, listScanPages)
	}
	// the cursor goes on past what far's scan skipped
	before = listed()
	l = listAs(t, ownerKeyA, "/v1/messages/batches?limit=3&after_id="+l.LastID)
	if !slices.Equal(l.ids(), []string{farOld, nearOld}) || l.HasMore {
		t.Fatalf("second page: %v (has_more %v), want [far-old near-old]", l.ids(), l.HasMore)
	}
	if n := listed() - before; n != 2 {
		t.Errorf("the second page read %d of far's upstream pages, want 2", n)
	}

	// a group with nothing of its own within the bound gets an empty page
	// (where the SDKs stop paging) whose cursor goes on past what was
	// scanned; the next page ends the list
	l = listAs(t, ownerKeyB, "/v1/messages/batches?limit=1")
	if len(l.Data) != 0 || !l.HasMore {
		t.Fatalf("B's first page: %v (has_more %v), want none and more", l.ids(), l.HasMore)
	}
	l = listAs(t, ownerKeyB, "/v1/messages/batches?limit=1&after_id="+l.LastID)
	if len(l.Data) != 0 || l.HasMore {
		t.Fatalf("B's second page: %v (has_more %v), want none and no more", l.ids(), l.HasMore)
	}
}

// TestAnOwnerThatCannotBeRecordedIsTakenBack: with the fleet's Redis
// frozen, a new file or batch cannot be recorded as its group's, so the
// relay deletes the file (cancels the batch) at the upstream and answers
// 503, instead of leaving an item no group can see.
func TestAnOwnerThatCannotBeRecordedIsTakenBack(t *testing.T) {
	srv := redistest.Start(t)
	up, store := storeUpstream(t, "undo")
	startRelay(t, "\t\tstorage redis {\n\t\t\taddress "+srv.Addr+"\n\t\t\tprefix undo:\n\t\t}\n"+channelBlock("owners-undo", up.URL)+keyAndGroup("g-undo", "owners-undo"))
	kept := uploadAs(t, clientKey, "kept.txt")
	if got, err := srv.Command("HGET", "undo:{c:owners-undo}:owners:files", newestAt(t, up, "/v1/files")); err != nil || got != "g-undo" {
		t.Fatalf("the owner in Redis: %q %v", got, err)
	}

	srv.Stop()
	t.Cleanup(srv.Continue)
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	w, _ := mw.CreateFormFile("file", "lost.txt")
	_, _ = w.Write([]byte("lost"))
	_ = mw.Close()
	r := send(t, http.MethodPost, "/v1/files", clientKey, body.String(), "Content-Type", mw.FormDataContentType())
	wantRelayError(t, r, 503, "relay_error", "storage_unavailable")
	if store.Files() != 1 {
		t.Errorf("the upstream holds %d files, want 1: the one whose owner was not recorded is deleted", store.Files())
	}
	r = send(t, http.MethodPost, "/v1/messages/batches", clientKey, batchBody("lost"))
	wantRelayError(t, r, 503, "relay_error", "storage_unavailable")
	resp := upstreamGet(t, upstreamBatchURL(up, newestAt(t, up, "/v1/messages/batches")))
	var b struct {
		CancelInitiatedAt *string `json:"cancel_initiated_at"`
	}
	_ = json.NewDecoder(resp.Body).Decode(&b)
	resp.Body.Close()
	if b.CancelInitiatedAt == nil {
		t.Errorf("the batch whose owner was not recorded was not cancelled")
	}

	srv.Continue()
	// once Redis answers again (its breaker lets a call through within a
	// second), the file recorded before is there
	waitFor(t, "the file recorded before Redis froze", 5*time.Second, func() bool {
		return send(t, http.MethodGet, "/v1/files/"+kept, clientKey, "").status == 200
	})
}

// upstreamGet reads url at a fake upstream as a client of its
// organisation would, outside the relay.
func upstreamGet(t *testing.T, url string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, url, nil)
	req.Header.Set("X-Api-Key", fakeupstream.Key)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func upstreamBatchURL(up *fakeupstream.Upstream, id string) string {
	return up.URL + "/v1/messages/batches/" + id
}
