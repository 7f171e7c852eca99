package fakeupstream

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestPromptCacheReadsWhatItWrote(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := &PromptCache{Now: func() time.Time { return now }}
	system := strings.Repeat("You are a careful assistant. ", 200)
	body := func(system, question string) []byte {
		return fmt.Appendf(nil, `{"model":"m","max_tokens":1,"system":[{"type":"text","text":%q,"cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":%q}]}`, system, question)
	}
	u, model, stream := c.Usage(body(system, "one"))
	if model != "m" || stream || u.CacheCreationInputTokens < 1024 || u.CacheReadInputTokens != 0 || u.InputTokens == 0 {
		t.Fatalf("first: %+v", u)
	}
	written := u.CacheCreationInputTokens
	if u, _, _ := c.Usage(body(system, "another question")); u.CacheReadInputTokens != written || u.CacheCreationInputTokens != 0 {
		t.Fatalf("a change after the breakpoint: %+v, want %d read", u, written)
	}
	if u, _, _ := c.Usage(body(system+"!", "one")); u.CacheReadInputTokens != 0 || u.CacheCreationInputTokens == 0 {
		t.Fatalf("a change before the breakpoint: %+v", u)
	}
	if u, _, _ := c.Usage(body("short", "one")); u.CacheReadInputTokens != 0 || u.CacheCreationInputTokens != 0 {
		t.Fatalf("a prefix too short to cache: %+v", u)
	}
	now = now.Add(5 * time.Minute)
	if u, _, _ := c.Usage(body(system, "one")); u.CacheReadInputTokens != 0 {
		t.Fatalf("read after its 5 minutes: %+v", u)
	}
	if in, read, wrote := c.Totals(); read != written || wrote < 2*written || in == 0 {
		t.Fatalf("totals %d %d %d", in, read, wrote)
	}
}
