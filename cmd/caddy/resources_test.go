package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// call makes one request of the Batches or Files API to the node.
func (n *fleetNode) call(t *testing.T, method, path, contentType string, body io.Reader) (int, []byte) {
	t.Helper()
	return n.callAs(t, fleetKey, method, path, contentType, body)
}

// callAs is call with another key.
func (n *fleetNode) callAs(t *testing.T, key, method, path, contentType string, body io.Reader) (int, []byte) {
	t.Helper()
	return callSite(t, n.site, key, method, path, contentType, body)
}

// callSite makes one request of the Batches or Files API to the relay at
// site with key.
func callSite(t *testing.T, site, key, method, path, contentType string, body io.Reader) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, "http://"+site+path, body)
	req.Header.Set("X-Api-Key", key)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := fleetClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestFleetResolvesEachOthersResourceIDs: the secret that seals batch and
// file ids is generated once for the fleet (in Redis), so an id one node
// gives works on every other, and a batch's results are accounted once
// whichever nodes read them.
func TestFleetResolvesEachOthersResourceIDs(t *testing.T) {
	srv := redistest.Start(t)
	upA := fakeupstream.New(t, fakeupstream.NewStore("a"))
	upB := fakeupstream.New(t, fakeupstream.NewStore("b"))
	// each node keeps its Caddy storage apart, so only Redis can share the secret
	var nodes []*fleetNode
	for range 2 {
		t.Setenv("XDG_DATA_HOME", t.TempDir())
		nodes = append(nodes, startFleet(t, 1, fleetConfig{redisAddr: srv.Addr, prefix: "res:", channels: []string{"res-a=" + upA.URL, "res-b=" + upB.URL}})...)
	}

	for i, maker := range nodes {
		reader := nodes[1-i]
		var body bytes.Buffer
		mw := multipart.NewWriter(&body)
		w, _ := mw.CreateFormFile("file", "notes.txt")
		_, _ = w.Write([]byte("shared notes"))
		_ = mw.Close()
		status, b := maker.call(t, http.MethodPost, "/v1/files", mw.FormDataContentType(), &body)
		var file struct{ ID string }
		if err := json.Unmarshal(b, &file); status != 200 || err != nil || !strings.HasPrefix(file.ID, "file_") {
			t.Fatalf("upload on node %d: %d %s", i, status, b)
		}
		if status, b := reader.call(t, http.MethodGet, "/v1/files/"+file.ID+"/content", "", nil); status != 200 || string(b) != "shared notes" {
			t.Fatalf("content on the other node: %d %s", status, b)
		}

		status, b = maker.call(t, http.MethodPost, "/v1/messages/batches", "application/json",
			strings.NewReader(`{"requests":[{"custom_id":"r1","params":{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}}]}`))
		var batch struct{ ID string }
		if err := json.Unmarshal(b, &batch); status != 200 || err != nil || !strings.HasPrefix(batch.ID, "msgbatch_") {
			t.Fatalf("batch on node %d: %d %s", i, status, b)
		}
		for _, n := range []*fleetNode{reader, maker, reader} {
			if status, b := n.call(t, http.MethodGet, "/v1/messages/batches/"+batch.ID+"/results", "", nil); status != 200 || !strings.Contains(string(b), `"custom_id":"r1"`) {
				t.Fatalf("results: %d %s", status, b)
			}
		}
		if status, b := reader.call(t, http.MethodDelete, "/v1/files/"+file.ID, "", nil); status != 200 {
			t.Fatalf("delete on the other node: %d %s", status, b)
		}
	}
	status, b := nodes[0].call(t, http.MethodGet, "/v1/messages/batches?limit=1", "", nil)
	var page struct {
		Data    []json.RawMessage `json:"data"`
		HasMore bool              `json:"has_more"`
		LastID  string            `json:"last_id"`
	}
	if err := json.Unmarshal(b, &page); status != 200 || err != nil || len(page.Data) != 1 || !page.HasMore {
		t.Fatalf("list on node 0: %d %s", status, b)
	}
	status, b = nodes[1].call(t, http.MethodGet, "/v1/messages/batches?limit=1&after_id="+page.LastID, "", nil)
	if err := json.Unmarshal(b, &page); status != 200 || err != nil || len(page.Data) != 1 || page.HasMore {
		t.Fatalf("the next page on node 1: %d %s", status, b)
	}

	// each batch's results were read three times, on both nodes: accounted once
	accounted := 0.0
	for _, n := range nodes {
		accounted += n.metric(t, "relay_batch_results_accounted_total{")
	}
	if accounted != 2 {
		t.Errorf("batch results accounted %v times over the fleet, want 2 (two batches, once each)", accounted)
	}
}

// metric sums the node's metric lines that start with prefix.
func (n *fleetNode) metric(t *testing.T, prefix string) float64 {
	t.Helper()
	resp, err := fleetClient.Get("http://" + n.admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	sum := 0.0
	for _, line := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(line, prefix) {
			var v float64
			_, _ = fmt.Sscan(line[strings.LastIndex(line, " ")+1:], &v)
			sum += v
		}
	}
	return sum
}

// uploadTo uploads a file named name, whose content is its name, to the
// relay at site with key, and returns its id.
func uploadTo(t *testing.T, site, key, name string) string {
	t.Helper()
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	w, _ := mw.CreateFormFile("file", name)
	_, _ = w.Write([]byte(name))
	_ = mw.Close()
	status, b := callSite(t, site, key, http.MethodPost, "/v1/files", mw.FormDataContentType(), &body)
	var file struct{ ID string }
	if err := json.Unmarshal(b, &file); status != 200 || err != nil || !strings.HasPrefix(file.ID, "file_") {
		t.Fatalf("upload %s: %d %s", name, status, b)
	}
	return file.ID
}

// batchTo creates a batch of one request, custom_id name, at the relay at
// site with key, and returns its id.
func batchTo(t *testing.T, site, key, name string) string {
	t.Helper()
	status, b := callSite(t, site, key, http.MethodPost, "/v1/messages/batches", "application/json",
		strings.NewReader(`{"requests":[{"custom_id":"`+name+`","params":{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}}]}`))
	var batch struct{ ID string }
	if err := json.Unmarshal(b, &batch); status != 200 || err != nil || !strings.HasPrefix(batch.ID, "msgbatch_") {
		t.Fatalf("batch %s: %d %s", name, status, b)
	}
	return batch.ID
}

// listIDs lists path at the relay at site with key (one page) and returns
// the ids and has_more.
func listIDs(t *testing.T, site, key, path string) ([]string, bool) {
	t.Helper()
	status, b := callSite(t, site, key, http.MethodGet, path, "", nil)
	var page struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
		HasMore bool `json:"has_more"`
	}
	if err := json.Unmarshal(b, &page); status != 200 || err != nil {
		t.Fatalf("GET %s: %d %s", path, status, b)
	}
	var ids []string
	for _, d := range page.Data {
		ids = append(ids, d.ID)
	}
	return ids, page.HasMore
}

// otherKey is the key of group other, which shares the fleet's channels
// with group fleet (fleetKey).
const otherKey = "sk-fleet-other-client-0123456789"

// TestFleetKeepsEachGroupsBatchesAndFilesApart: two groups share a
// channel. What one makes on a node, the other does not see on another
// node, and each list's owners are one Redis round trip a page.
func TestFleetKeepsEachGroupsBatchesAndFilesApart(t *testing.T) {
	srv := redistest.Start(t)
	store := fakeupstream.NewStore("own")
	up := fakeupstream.New(t, store)
	cfg := fleetConfig{redisAddr: srv.Addr, prefix: "own:", channels: []string{"own=" + up.URL},
		extra: "\t\tkey " + otherKey + " other\n\t\tgroup other {\n\t\t\tchannels own\n\t\t}\n"}
	var nodes []*fleetNode
	for range 2 {
		t.Setenv("XDG_DATA_HOME", t.TempDir())
		nodes = append(nodes, startFleet(t, 1, cfg)...)
	}
	one, two := nodes[0].site, nodes[1].site

	file := uploadTo(t, one, fleetKey, "fleet.txt")
	batch := batchTo(t, one, fleetKey, "fleet")

	// the other group, on the other node, sees none of it; each list's
	// owners took one round trip to Redis
	for _, path := range []string{"/v1/files", "/v1/messages/batches"} {
		before := nodes[1].metric(t, `relay_storage_seconds_count{op="owners"}`)
		if ids, more := listIDs(t, two, otherKey, path); len(ids) != 0 || more {
			t.Errorf("group other lists %s on node 2: %v (has_more %v), want nothing", path, ids, more)
		}
		if n := nodes[1].metric(t, `relay_storage_seconds_count{op="owners"}`) - before; n != 1 {
			t.Errorf("listing %s looked owners up in Redis %v times, want once (one upstream page)", path, n)
		}
	}
	for _, path := range []string{"/v1/files/" + file, "/v1/files/" + file + "/content", "/v1/messages/batches/" + batch} {
		if status, b := nodes[1].callAs(t, otherKey, http.MethodGet, path, "", nil); status != 404 || !strings.Contains(string(b), "not_found_error") {
			t.Errorf("group other GET %s on node 2: %d %s", path, status, b)
		}
	}
	if got, err := srv.Command("HGET", "own:{c:own}:owners:files", store.NewestFile()); err != nil || got != "fleet" {
		t.Errorf("the file's owner in Redis: %q %v", got, err)
	}
	// the group that made them sees them on either node
	for _, n := range nodes {
		if ids, _ := listIDs(t, n.site, fleetKey, "/v1/files"); !slices.Equal(ids, []string{file}) {
			t.Errorf("group fleet's files on %s: %v", n.site, ids)
		}
		if ids, _ := listIDs(t, n.site, fleetKey, "/v1/messages/batches"); !slices.Equal(ids, []string{batch}) {
			t.Errorf("group fleet's batches on %s: %v", n.site, ids)
		}
	}
	if status, b := nodes[1].call(t, http.MethodGet, "/v1/files/"+file+"/content", "", nil); status != 200 || string(b) != "fleet.txt" {
		t.Errorf("content on node 2: %d %s", status, b)
	}
	// a delete on node 2 removes the record from Redis
	upFile := store.NewestFile()
	if status, b := nodes[1].call(t, http.MethodDelete, "/v1/files/"+file, "", nil); status != 200 {
		t.Fatalf("delete on node 2: %d %s", status, b)
	}
	if got, err := srv.Command("HEXISTS", "own:{c:own}:owners:files", upFile); err != nil || got != ":0" {
		t.Errorf("the record after the delete: %q %v", got, err)
	}
}

// TestResourceOwnersSurviveARestart: without a fleet, owners are kept in
// Caddy's storage: after the relay is killed and started again, the group
// that made a file and a batch still sees them, and the other group still
// does not.
func TestResourceOwnersSurviveARestart(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	up := fakeupstream.New(t, fakeupstream.NewStore("keep"))
	storage := t.TempDir()
	site, admin := freePort(t), freePort(t)
	config := filepath.Join(t.TempDir(), "Caddyfile")
	src := fmt.Sprintf(`{
	admin %s
	storage file_system %s
}
http://%s {
	relay {
		key %s mine
		key %s theirs
		channel shared {
			url %s
			api_key %s
		}
		group mine {
			channels shared
		}
		group theirs {
			channels shared
		}
	}
}
`, admin, storage, site, fleetKey, otherKey, up.URL, fakeupstream.Key)
	if err := os.WriteFile(config, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := runCaddy(t, caddyBin, config)
	file := uploadTo(t, site, fleetKey, "kept.txt")
	batch := batchTo(t, site, fleetKey, "kept")
	_ = cmd.Process.Kill() // the records are written before the answers
	_ = cmd.Wait()
	records, _ := filepath.Glob(filepath.Join(storage, "relay", "owners", "*", "*"))
	if len(records) != 2 {
		t.Errorf("owner records in Caddy's storage: %v, want one file's and one batch's", records)
	}

	runCaddy(t, caddyBin, config)
	for _, c := range []struct {
		path string
		want []string
	}{{"/v1/files", []string{file}}, {"/v1/messages/batches", []string{batch}}} {
		if ids, _ := listIDs(t, site, fleetKey, c.path); !slices.Equal(ids, c.want) {
			t.Errorf("after the restart, the maker lists %s: %v, want %v", c.path, ids, c.want)
		}
		if ids, _ := listIDs(t, site, otherKey, c.path); len(ids) != 0 {
			t.Errorf("after the restart, the other group lists %s: %v, want nothing", c.path, ids)
		}
	}
	if status, b := callSite(t, site, fleetKey, http.MethodGet, "/v1/files/"+file+"/content", "", nil); status != 200 || string(b) != "kept.txt" {
		t.Errorf("after the restart, the maker's content: %d %s", status, b)
	}
}
