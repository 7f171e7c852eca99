package fakeupstream

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Store is one fake upstream organisation's Files and Message Batches: it
// keeps what it is given in memory and serves it in Anthropic's shapes,
// newest first. Batches end as soon as they are created, each request
// answered with a reply of 10 input and 5 output tokens, but one whose
// custom_id starts with errored, canceled or expired, which ends so (as
// the requests of a batch canceled, or not done within 24 hours, do). POST /v1/messages
// is answered with a reply whose text lists the file ids the body
// references, so a test sees which ids reached the upstream; count_tokens
// with 10 input tokens.
//
// Files list with Anthropic's page cursor (`page`, `next_page`); batches
// with `after_id` and `before_id` (`has_more`, `first_id`, `last_id`).
type Store struct {
	// Name is part of every id the store makes, so tests tell upstreams
	// apart.
	Name string

	// Searches is the web searches each succeeded result of a batch
	// reports in its usage; 0: none (set before the store serves).
	Searches int

	mu       sync.Mutex
	files    []*storedFile // oldest first
	batches  []*storedBatch
	seq      int
	instance int64
}

type storedFile struct {
	meta    map[string]any
	content []byte
	typ     string
}

type storedBatch struct {
	obj     map[string]any
	results []byte
}

// clock orders every object of every store: each is made one second after
// the one before, so lists merged from several stores have one order.
var clock atomic.Int64

func created() time.Time {
	return time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC).Add(time.Duration(clock.Add(1)) * time.Second)
}

// NewStore returns an empty store named name.
func NewStore(name string) *Store { return &Store{Name: name, instance: stores.Add(1)} }

// stores numbers the stores of the process, so that no two make the same
// id: the relay remembers some ids for the life of the process (a batch
// whose results it accounted), and a test run again must not meet them.
var stores atomic.Int64

// Files is the number of files the store holds.
func (s *Store) Files() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.files)
}

// Batches is the number of batches the store holds.
func (s *Store) Batches() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.batches)
}

var (
	fileIDPattern = regexp.MustCompile(`"file_id"\s*:\s*"([^"]*)"`)
	itemPath      = regexp.MustCompile(`^/v1/(files|messages/batches)/([^/]+)(/content|/results|/cancel)?$`)
)

// ServeHTTP implements http.Handler.
// NewestFile is the store's own id of the file it was given last, "" for
// none.
func (s *Store) NewestFile() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.files) == 0 {
		return ""
	}
	id, _ := s.files[len(s.files)-1].meta["id"].(string)
	return id
}

func (s *Store) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch p := r.URL.Path; {
	case p == "/v1/messages" && r.Method == http.MethodPost:
		body, _ := io.ReadAll(r.Body)
		var ids []string
		for _, m := range fileIDPattern.FindAllSubmatch(body, -1) {
			ids = append(ids, string(m[1]))
		}
		var req struct {
			Model string `json:"model"`
		}
		_ = json.Unmarshal(body, &req)
		writeJSON(w, 200, json.RawMessage(MessageBody(req.Model, s.Name+" saw files "+strings.Join(ids, ","), Usage{InputTokens: 10, OutputTokens: 5})))
	case p == "/v1/messages/count_tokens" && r.Method == http.MethodPost:
		writeJSON(w, 200, map[string]int{"input_tokens": 10})
	case p == "/v1/files" && r.Method == http.MethodPost:
		s.upload(w, r)
	case p == "/v1/files" && r.Method == http.MethodGet:
		s.listFiles(w, r)
	case p == "/v1/messages/batches" && r.Method == http.MethodPost:
		s.createBatch(w, r)
	case p == "/v1/messages/batches" && r.Method == http.MethodGet:
		s.listBatches(w, r)
	default:
		m := itemPath.FindStringSubmatch(p)
		if m == nil {
			writeError(w, 404, "no such route "+p)
			return
		}
		if m[1] == "files" {
			s.file(w, r, m[2], m[3])
		} else {
			s.batch(w, r, m[2], m[3])
		}
	}
}

func (s *Store) nextID(prefix string) string {
	s.seq++
	return fmt.Sprintf("%s%s%04d_%d", prefix, s.Name, s.seq, s.instance)
}

func (s *Store) upload(w http.ResponseWriter, r *http.Request) {
	_, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || params["boundary"] == "" {
		writeError(w, 400, "expected a multipart body")
		return
	}
	mr := multipart.NewReader(r.Body, params["boundary"])
	for {
		part, err := mr.NextPart()
		if err != nil {
			writeError(w, 400, "no file part")
			return
		}
		if part.FormName() != "file" {
			continue
		}
		content, err := io.ReadAll(part)
		if err != nil {
			writeError(w, 400, "could not read the file: "+err.Error())
			return
		}
		typ := part.Header.Get("Content-Type")
		if typ == "" {
			typ = "application/octet-stream"
		}
		meta := map[string]any{"id": s.nextID("file_"), "type": "file", "filename": part.FileName(), "mime_type": typ,
			"size_bytes": len(content), "created_at": created().Format(time.RFC3339), "downloadable": true}
		s.files = append(s.files, &storedFile{meta: meta, content: content, typ: typ})
		writeJSON(w, 200, meta)
		return
	}
}

func (s *Store) file(w http.ResponseWriter, r *http.Request, id, sub string) {
	i := s.findFile(id)
	if i < 0 {
		writeError(w, 404, "File not found: "+id)
		return
	}
	f := s.files[i]
	switch {
	case sub == "" && r.Method == http.MethodGet:
		writeJSON(w, 200, f.meta)
	case sub == "" && r.Method == http.MethodDelete:
		s.files = append(s.files[:i], s.files[i+1:]...)
		writeJSON(w, 200, map[string]any{"id": id, "type": "file_deleted"})
	case sub == "/content" && r.Method == http.MethodGet:
		w.Header().Set("Content-Type", f.typ)
		w.Header().Set("Content-Length", strconv.Itoa(len(f.content)))
		_, _ = w.Write(f.content)
	default:
		writeError(w, 405, "method not allowed")
	}
}

func (s *Store) findFile(id string) int {
	for i, f := range s.files {
		if f.meta["id"] == id {
			return i
		}
	}
	return -1
}

// listFiles pages with an opaque cursor: page_ and the base64 of the id of
// the first file of the page.
func (s *Store) listFiles(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit := queryLimit(q.Get("limit"))
	start := len(s.files) - 1 // newest first
	if p := q.Get("page"); p != "" {
		raw, err := base64.RawURLEncoding.DecodeString(strings.TrimPrefix(p, "page_"))
		if err != nil || s.findFile(string(raw)) < 0 {
			writeError(w, 400, "invalid page cursor")
			return
		}
		start = s.findFile(string(raw))
	}
	data := []any{}
	i := start
	for ; i >= 0 && len(data) < limit; i-- {
		data = append(data, s.files[i].meta)
	}
	var next any
	if i >= 0 {
		next = "page_" + base64.RawURLEncoding.EncodeToString([]byte(s.files[i].meta["id"].(string)))
	}
	writeJSON(w, 200, map[string]any{"data": data, "next_page": next})
}

func (s *Store) createBatch(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Requests []struct {
			CustomID string `json:"custom_id"`
			Params   struct {
				Model string `json:"model"`
			} `json:"params"`
		} `json:"requests"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || len(req.Requests) == 0 {
		writeError(w, 400, "requests: field required")
		return
	}
	id := s.nextID("msgbatch_")
	at := created().Format(time.RFC3339)
	var results strings.Builder
	counts := map[string]int{"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
	u := Usage{InputTokens: 10, OutputTokens: 5}
	if s.Searches > 0 {
		u.ServerToolUse = &ServerToolUse{WebSearchRequests: s.Searches}
	}
	for _, q := range req.Requests {
		result := map[string]any{"type": "succeeded",
			"message": json.RawMessage(MessageBody(q.Params.Model, "batch reply from "+s.Name, u))}
		for _, end := range []string{"errored", "canceled", "expired"} {
			if strings.HasPrefix(q.CustomID, end) {
				result = map[string]any{"type": end}
			}
		}
		if result["type"] == "errored" {
			result["error"] = map[string]any{"type": "error", "error": map[string]any{"type": "invalid_request_error", "message": "errored as asked"}}
		}
		counts[result["type"].(string)]++
		line, _ := json.Marshal(map[string]any{"custom_id": q.CustomID, "result": result})
		results.Write(line)
		results.WriteByte('\n')
	}
	obj := map[string]any{"id": id, "type": "message_batch", "processing_status": "ended",
		"request_counts": counts,
		"created_at":     at, "ended_at": at, "expires_at": at, "archived_at": nil, "cancel_initiated_at": nil,
		"results_url": "https://api.anthropic.com/v1/messages/batches/" + id + "/results"}
	s.batches = append(s.batches, &storedBatch{obj: obj, results: []byte(results.String())})
	writeJSON(w, 200, obj)
}

// SeedBatches adds n ended batches of one request each, as if made
// straight at the upstream, each newer than every object made before.
func (s *Store) SeedBatches(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for range n {
		id := s.nextID("msgbatch_")
		at := created().Format(time.RFC3339)
		obj := map[string]any{"id": id, "type": "message_batch", "processing_status": "ended",
			"request_counts": map[string]int{"processing": 0, "succeeded": 1, "errored": 0, "canceled": 0, "expired": 0},
			"created_at":     at, "ended_at": at, "expires_at": at, "archived_at": nil, "cancel_initiated_at": nil,
			"results_url": "https://api.anthropic.com/v1/messages/batches/" + id + "/results"}
		s.batches = append(s.batches, &storedBatch{obj: obj})
	}
}

func (s *Store) findBatch(id string) int {
	for i, b := range s.batches {
		if b.obj["id"] == id {
			return i
		}
	}
	return -1
}

func (s *Store) batch(w http.ResponseWriter, r *http.Request, id, sub string) {
	i := s.findBatch(id)
	if i < 0 {
		writeError(w, 404, "Batch not found: "+id)
		return
	}
	b := s.batches[i]
	switch {
	case sub == "" && r.Method == http.MethodGet:
		writeJSON(w, 200, b.obj)
	case sub == "" && r.Method == http.MethodDelete:
		s.batches = append(s.batches[:i], s.batches[i+1:]...)
		writeJSON(w, 200, map[string]any{"id": id, "type": "message_batch_deleted"})
	case sub == "/cancel" && r.Method == http.MethodPost:
		b.obj["cancel_initiated_at"] = b.obj["created_at"]
		writeJSON(w, 200, b.obj)
	case sub == "/results" && r.Method == http.MethodGet:
		w.Header().Set("Content-Type", "application/binary")
		_, _ = w.Write(b.results)
	default:
		writeError(w, 405, "method not allowed")
	}
}

// listBatches pages as Anthropic's Page: after_id (older than), before_id
// (newer than), limit.
func (s *Store) listBatches(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	limit := queryLimit(q.Get("limit"))
	newest := make([]*storedBatch, 0, len(s.batches))
	for i := len(s.batches) - 1; i >= 0; i-- {
		newest = append(newest, s.batches[i])
	}
	lo, hi := 0, len(newest) // the window the cursors leave
	if a := q.Get("after_id"); a != "" {
		lo = len(newest)
		for i, b := range newest {
			if b.obj["id"] == a {
				lo = i + 1
			}
		}
	}
	var page []*storedBatch
	hasMore := false
	if bid := q.Get("before_id"); bid != "" {
		for i, b := range newest {
			if b.obj["id"] == bid {
				hi = i
			}
		}
		page = newest[max(lo, hi-limit):hi]
		hasMore = hi-limit > lo
	} else {
		page = newest[lo:min(hi, lo+limit)]
		hasMore = lo+limit < hi
	}
	data := []any{}
	var first, last any
	for _, b := range page {
		data = append(data, b.obj)
	}
	if len(page) > 0 {
		first, last = page[0].obj["id"], page[len(page)-1].obj["id"]
	}
	writeJSON(w, 200, map[string]any{"data": data, "has_more": hasMore, "first_id": first, "last_id": last})
}

func queryLimit(v string) int {
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		return 20
	}
	return min(n, 1000)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Request-Id", "req_fake")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func writeError(w http.ResponseWriter, status int, msg string) {
	typ := "invalid_request_error"
	if status == 404 {
		typ = "not_found_error"
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(ErrorBody(typ, msg))
}
