package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// cachedMessage sends a Messages request with a system prompt long enough
// to cache, marked, and a question after it, in a new session; it returns
// the channel that answered and the tokens read from the cache.
func (n *fleetNode) cachedMessage(t *testing.T, session, question string) (string, int) {
	t.Helper()
	system := strings.Repeat("You are the team's coding assistant. Follow the style guide. ", 100)
	body := fmt.Sprintf(`{"model":"claude-sonnet-4-5","max_tokens":16,"system":[{"type":"text","text":%q,"cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":%q}]}`, system, question)
	req, _ := http.NewRequest(http.MethodPost, "http://"+n.site+"/v1/messages", strings.NewReader(body))
	req.Header.Set("X-Api-Key", fleetKey)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Claude-Code-Session-Id", session)
	resp, err := fleetClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var msg struct {
		Usage struct {
			Read int `json:"cache_read_input_tokens"`
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&msg); err != nil || resp.StatusCode != 200 {
		t.Fatalf("node %s, session %s: %d %v", n.site, session, resp.StatusCode, err)
	}
	return resp.Header.Get("X-Relay-Channel"), msg.Usage.Read
}

// TestFleetSharesPromptCacheAffinity runs two relay processes on one
// Redis: a prefix one node sent to a channel is warm there for the other,
// whose own table knows nothing of it.
func TestFleetSharesPromptCacheAffinity(t *testing.T) {
	srv := redistest.Start(t)
	a := fakeupstream.New(t, fakeupstream.NewPromptCache())
	b := fakeupstream.New(t, fakeupstream.NewPromptCache())
	nodes := startFleet(t, 2, fleetConfig{redisAddr: srv.Addr, prefix: "aff:", sameTier: true,
		channels: []string{"a=" + a.URL, "b=" + b.URL}, group: "\t\t\texpose_channel\n"})

	warm, read := nodes[0].cachedMessage(t, "s0", "What does main.go do?")
	if read != 0 {
		t.Fatalf("the first request read %d tokens from a cache", read)
	}
	// the record reaches Redis after the answer, off the request's path
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	var keys []string
	within(t, "the record reaches Redis", 2*time.Second, func() bool {
		keys, _ = rdb.Keys(ctx, "aff:{a:fleet}:*").Result()
		return len(keys) > 0
	})
	if v, _ := rdb.Get(ctx, keys[0]).Result(); len(keys) != 1 || !strings.HasSuffix(v, " "+warm) {
		t.Fatalf("Redis holds %q (%d keys) for the prefix, want it on %s", v, len(keys), warm)
	}
	if ttl, _ := rdb.PTTL(ctx, keys[0]).Result(); ttl <= 4*time.Minute || ttl > 5*time.Minute {
		t.Fatalf("the record expires in %v, want the cache's 5 minutes", ttl)
	}
	// new sessions on the other node land there too (by chance, six in a
	// row would one time in 64)
	for i := 1; i <= 6; i++ {
		ch, read := nodes[1].cachedMessage(t, fmt.Sprintf("s%d", i), fmt.Sprintf("question %d", i))
		if ch != warm || read == 0 {
			t.Fatalf("node 2, session %d: answered by %s reading %d tokens, want %s reading the cache", i, ch, read, warm)
		}
	}
}
