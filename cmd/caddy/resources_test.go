package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// call makes one request of the Batches or Files API to the node.
func (n *fleetNode) call(t *testing.T, method, path, contentType string, body io.Reader) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, "http://"+n.site+path, body)
	req.Header.Set("X-Api-Key", fleetKey)
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
		resp, err := fleetClient.Get("http://" + n.admin + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, line := range strings.Split(string(raw), "\n") {
			if strings.HasPrefix(line, "relay_batch_results_accounted_total{") {
				var v float64
				_, _ = fmt.Sscan(line[strings.LastIndex(line, " ")+1:], &v)
				accounted += v
			}
		}
	}
	if accounted != 2 {
		t.Errorf("batch results accounted %v times over the fleet, want 2 (two batches, once each)", accounted)
	}
}
