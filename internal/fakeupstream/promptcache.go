package fakeupstream

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"net/http"
	"sync"
	"time"
)

// PromptCache is one account's prompt cache, as Anthropic's API keeps it:
// a handler that answers Messages requests with the usage the API would
// report. The prompt is read in the API's cache order (tools, then system,
// then messages, block by block); at each block marked with cache_control
// (a breakpoint; a top-level cache_control marks the last block) the
// prefix up to it may be cached. The longest prefix of a breakpoint that
// this account cached before is read (cache_read_input_tokens), the rest
// up to the last breakpoint is written (cache_creation_input_tokens), and
// the tail is plain input; every breakpoint's prefix is then cached for
// its TTL (5m, or 1h with "ttl":"1h") by the cache's clock. Prefixes
// shorter than MinTokens are not cached. Tokens are counted as a byte in
// four of the blocks' compact JSON.
type PromptCache struct {
	// MinTokens is the shortest prefix cached. Default: 1024.
	MinTokens int
	// Now is the cache's clock. Default: time.Now.
	Now func() time.Time

	mu     sync.Mutex
	cached map[[sha256.Size]byte]time.Time // prefix -> until
	// totals of what it reported
	input, read, written int
}

// NewPromptCache returns an empty cache.
func NewPromptCache() *PromptCache { return &PromptCache{} }

// Totals are the tokens the cache reported so far: plain input, read
// from the cache, written to it.
func (c *PromptCache) Totals() (input, read, written int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.input, c.read, c.written
}

// Forget empties the cache, as if every entry had expired.
func (c *PromptCache) Forget() {
	c.mu.Lock()
	c.cached = nil
	c.mu.Unlock()
}

type cacheBlock struct {
	raw  []byte // compact, without cache_control
	mark bool
	long bool
}

// promptBlocks reads the body's prompt in cache order.
func promptBlocks(body []byte) (model string, stream bool, out []cacheBlock, ok bool) {
	var req struct {
		Model        string            `json:"model"`
		Stream       bool              `json:"stream"`
		Tools        []json.RawMessage `json:"tools"`
		System       json.RawMessage   `json:"system"`
		Messages     []json.RawMessage `json:"messages"`
		CacheControl json.RawMessage   `json:"cache_control"`
	}
	if json.Unmarshal(body, &req) != nil {
		return "", false, nil, false
	}
	add := func(raw json.RawMessage) {
		var m map[string]json.RawMessage
		if json.Unmarshal(raw, &m) != nil { // a string: a block of its own
			out = append(out, cacheBlock{raw: compact(raw)})
			return
		}
		b := cacheBlock{}
		if cc, ok := m["cache_control"]; ok && !bytes.Equal(cc, []byte("null")) {
			b.mark, b.long = true, bytes.Contains(cc, []byte(`"1h"`))
			delete(m, "cache_control")
		}
		b.raw, _ = json.Marshal(m)
		out = append(out, b)
	}
	for _, t := range req.Tools {
		add(t)
	}
	if len(req.System) > 0 {
		var blocks []json.RawMessage
		if json.Unmarshal(req.System, &blocks) == nil {
			for _, b := range blocks {
				add(b)
			}
		} else {
			add(req.System)
		}
	}
	for _, raw := range req.Messages {
		var m struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		_ = json.Unmarshal(raw, &m)
		out = append(out, cacheBlock{raw: []byte("role:" + m.Role)})
		var blocks []json.RawMessage
		if json.Unmarshal(m.Content, &blocks) == nil {
			for _, b := range blocks {
				add(b)
			}
		} else {
			add(m.Content)
		}
	}
	if len(req.CacheControl) > 0 && !bytes.Equal(req.CacheControl, []byte("null")) && len(out) > 0 {
		last := &out[len(out)-1]
		last.mark, last.long = true, bytes.Contains(req.CacheControl, []byte(`"1h"`))
	}
	return req.Model, req.Stream, out, true
}

func compact(raw []byte) []byte {
	var b bytes.Buffer
	if json.Compact(&b, raw) != nil {
		return raw
	}
	return b.Bytes()
}

// Usage is what the account reports for the request body (and its model,
// "" when the body is not a Messages request, and whether it asks for a
// stream), noting its breakpoints' prefixes as cached.
func (c *PromptCache) Usage(body []byte) (u Usage, model string, stream bool) {
	model, stream, blocks, ok := promptBlocks(body)
	if !ok {
		return Usage{}, "", false
	}
	min := c.MinTokens
	if min == 0 {
		min = 1024
	}
	now := time.Now
	if c.Now != nil {
		now = c.Now
	}
	type point struct {
		sum    [sha256.Size]byte
		tokens int
		long   bool
	}
	var points []point
	h := sha256.New()
	n := 0
	for _, b := range blocks {
		h.Write(b.raw)
		h.Write([]byte{0})
		n += len(b.raw)
		if b.mark && n/4 >= min {
			var p point
			h.Sum(p.sum[:0])
			p.tokens, p.long = n/4, b.long
			points = append(points, p)
		}
	}
	total := max(n/4, 1)
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cached == nil {
		c.cached = map[[sha256.Size]byte]time.Time{}
	}
	t := now()
	u = Usage{OutputTokens: 5}
	for i := len(points) - 1; i >= 0; i-- {
		if until, ok := c.cached[points[i].sum]; ok && until.After(t) {
			u.CacheReadInputTokens = points[i].tokens
			break
		}
	}
	if len(points) > 0 {
		u.CacheCreationInputTokens = max(points[len(points)-1].tokens-u.CacheReadInputTokens, 0)
	}
	u.InputTokens = total - u.CacheReadInputTokens - u.CacheCreationInputTokens
	for _, p := range points {
		ttl := 5 * time.Minute
		if p.long {
			ttl = time.Hour
		}
		if until := t.Add(ttl); until.After(c.cached[p.sum]) {
			c.cached[p.sum] = until
		}
	}
	c.input += u.InputTokens
	c.read += u.CacheReadInputTokens
	c.written += u.CacheCreationInputTokens
	return u, model, stream
}

// ServeHTTP answers a Messages request with its usage, streamed when the
// request asks for a stream.
func (c *PromptCache) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(r.Body)
	u, model, stream := c.Usage(buf.Bytes())
	if model == "" {
		Error(400, "invalid_request_error", "the body is not a Messages request")(w, r)
		return
	}
	if stream {
		Stream(StreamEvents(model, u, "cached")...)(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Request-Id", "req_fake_cache")
	_, _ = w.Write(MessageBody(model, "cached", u))
}
