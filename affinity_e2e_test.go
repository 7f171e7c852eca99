package relay

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// cacheUsage is the usage of a Messages answer.
type cacheUsage struct {
	Input int `json:"input_tokens"`
	Read  int `json:"cache_read_input_tokens"`
	Write int `json:"cache_creation_input_tokens"`
}

// cachedReply sends body as key in session and returns the channel that
// answered and the usage it reported; the answer must be a 200.
func cachedReply(t *testing.T, key, session, body string) (string, cacheUsage) {
	t.Helper()
	r := send(t, "POST", "/v1/messages", key, body, "X-Claude-Code-Session-Id", session)
	if r.status != 200 {
		t.Fatalf("session %s: %d %s", session, r.status, r.body)
	}
	var msg struct{ Usage cacheUsage }
	if err := json.Unmarshal(r.body, &msg); err != nil {
		t.Fatal(err)
	}
	return r.header.Get("X-Relay-Channel"), msg.Usage
}

// cacheChannels starts a fake account with a prompt cache for each name,
// and renders their channel blocks.
func cacheChannels(t *testing.T, names ...string) (map[string]*fakeupstream.Upstream, map[string]*fakeupstream.PromptCache, string) {
	ups, caches, block := map[string]*fakeupstream.Upstream{}, map[string]*fakeupstream.PromptCache{}, ""
	for _, n := range names {
		caches[n] = fakeupstream.NewPromptCache()
		ups[n] = fakeupstream.New(t, caches[n])
		block += channelBlock(n, ups[n].URL)
	}
	return ups, caches, block
}

func TestAffinitySendsOtherSessionsAndKeysToTheWarmChannel(t *testing.T) {
	ups, _, block := cacheChannels(t, "aff1-a", "aff1-b")
	const one, two = "sk-aff1-one-0123456789", "sk-aff1-two-0123456789"
	startRelay(t, block+"\t\tkey "+one+" aff1\n\t\tkey "+two+" aff1\n\t\tgroup aff1 {\n\t\t\tchannels aff1-a aff1-b\n\t\t\texpose_channel\n\t\t}\n")

	warm, u := cachedReply(t, one, "s0", cachedBody(sharedSystem, userTurn("What does main.go do?")))
	if u.Write == 0 || u.Read != 0 {
		t.Fatalf("the first request: usage %+v, want a cache write", u)
	}
	// new sessions of both keys, with other questions after the
	// breakpoint: each lands where the prefix is warm, and reads it (by
	// chance, six in a row would land there one time in 64)
	for i := 1; i <= 6; i++ {
		key := []string{one, two}[i%2]
		ch, u := cachedReply(t, key, fmt.Sprintf("s%d", i), cachedBody(sharedSystem, userTurn(fmt.Sprintf("question %d", i))))
		if ch != warm || u.Read == 0 || u.Write != 0 {
			t.Fatalf("session %d: answered by %s with usage %+v, want %s reading the cache", i, ch, u, warm)
		}
	}
	// another system prompt (before the breakpoint) is another prefix
	if _, u := cachedReply(t, two, "s7", cachedBody(sharedSystem+" Use tabs.", userTurn("question"))); u.Read != 0 || u.Write == 0 {
		t.Fatalf("another system prompt read the cache: %+v", u)
	}
	// a short prompt is neither counted nor recorded
	cachedReply(t, one, "s8", cachedBody("Be brief.", userTurn("hi")))

	mf, _ := scrape(t)
	for result, want := range map[string]float64{"warm": 6, "cold": 2, "moved": -1} {
		if got := value(mf, "relay_cache_affinity_total", "group=aff1", "result="+result); got != want {
			t.Errorf("relay_cache_affinity_total{result=%q} = %v, want %v", result, got, want)
		}
	}
	if got := value(mf, "relay_cache_miss_usd_total", "group=aff1", "reason=cold"); got <= 0 {
		t.Errorf("relay_cache_miss_usd_total{reason=cold} = %v, want the cold writes' extra cost", got)
	}
	if hits := ups["aff1-a"].Hits() + ups["aff1-b"].Hits(); hits != 9 {
		t.Errorf("the upstreams saw %d requests, want 9", hits)
	}
}

func TestAffinityFollowsTheServingChannelWhenTheWarmOneCools(t *testing.T) {
	ups, caches, block := cacheChannels(t, "aff2-a", "aff2-b")
	startRelay(t, block+keyAndGroup("aff2", "aff2-a aff2-b", "expose_channel"))
	body := func(q string) string { return cachedBody(sharedSystem, userTurn(q)) }
	warm, _ := cachedReply(t, clientKey, "s1", body("one"))
	other := map[string]string{"aff2-a": "aff2-b", "aff2-b": "aff2-a"}[warm]

	// the warm channel is out: the prefix moves, and its write is counted
	if status, b := adminPost(t, warm, "disable"); status != 200 {
		t.Fatalf("disable: %d %s", status, b)
	}
	if ch, u := cachedReply(t, clientKey, "s2", body("two")); ch != other || u.Write == 0 {
		t.Fatalf("with %s disabled: answered by %s, usage %+v; want %s writing the cache", warm, ch, u, other)
	}
	// it is back, but the prefix follows the channel that served it last
	adminPost(t, warm, "enable")
	if ch, u := cachedReply(t, clientKey, "s3", body("three")); ch != other || u.Read == 0 {
		t.Fatalf("after the move: answered by %s, usage %+v; want %s reading the cache", ch, u, other)
	}
	// the warm channel fails: the request fails over to a channel whose
	// cache expired meanwhile, which writes it again
	caches[warm].Forget()
	ups[other].SetHandler(fakeupstream.Error(500, "api_error", "Internal server error"))
	if ch, u := cachedReply(t, clientKey, "s4", body("four")); ch != warm || u.Write == 0 {
		t.Fatalf("after %s failed: answered by %s, usage %+v; want %s writing the cache", other, ch, u, warm)
	}

	mf, _ := scrape(t)
	for result, want := range map[string]float64{"warm": 2, "cold": 1, "moved": 1} {
		if got := value(mf, "relay_cache_affinity_total", "group=aff2", "result="+result); got != want {
			t.Errorf("relay_cache_affinity_total{result=%q} = %v, want %v", result, got, want)
		}
	}
	for _, reason := range []string{"moved", "failover", "cold"} {
		if got := value(mf, "relay_cache_miss_usd_total", "group=aff2", "reason="+reason); got <= 0 {
			t.Errorf("relay_cache_miss_usd_total{reason=%q} = %v, want the writes' extra cost", reason, got)
		}
	}
}

// stickyApart finds two sessions that sticky routing sends to different
// channels of the two named.
func stickyApart(a, b string) (string, string) {
	chs := []*channel{{name: a, weight: 1}, {name: b, weight: 1}}
	first := rendezvous(chs, "s0")
	for i := 1; ; i++ {
		s := fmt.Sprintf("s%d", i)
		if rendezvous(chs, s) != first {
			return "s0", s
		}
	}
}

func TestCacheAffinityOffLeavesStickySessionsWhereTheyAre(t *testing.T) {
	_, _, block := cacheChannels(t, "aff3-on-a", "aff3-on-b", "aff3-off-a", "aff3-off-b")
	const on, off = "sk-aff3-on-0123456789", "sk-aff3-off-0123456789"
	startRelay(t, block+"\t\tkey "+on+" aff3-on\n\t\tkey "+off+" aff3-off\n"+
		"\t\tgroup aff3-on {\n\t\t\tchannels aff3-on-a aff3-on-b\n\t\t\tpolicy sticky\n\t\t\texpose_channel\n\t\t}\n"+
		"\t\tgroup aff3-off {\n\t\t\tchannels aff3-off-a aff3-off-b\n\t\t\tpolicy sticky\n\t\t\tcache_affinity off\n\t\t\texpose_channel\n\t\t}\n")
	for _, c := range []struct {
		key, a, b string
		together  bool
	}{{on, "aff3-on-a", "aff3-on-b", true}, {off, "aff3-off-a", "aff3-off-b", false}} {
		s1, s2 := stickyApart(c.a, c.b)
		ch1, _ := cachedReply(t, c.key, s1, cachedBody(sharedSystem, userTurn("one")))
		ch2, u := cachedReply(t, c.key, s2, cachedBody(sharedSystem, userTurn("two")))
		if (ch1 == ch2) != c.together || (u.Read > 0) != c.together {
			t.Errorf("%s: sessions on %s and %s, the second's usage %+v; together %v", c.key[:8], ch1, ch2, u, c.together)
		}
	}
	mf, _ := scrape(t)
	if got := value(mf, "relay_cache_affinity_total", "group=aff3-off"); got != -1 {
		t.Errorf("a group with cache_affinity off counted %v", got)
	}
	if got := value(mf, "relay_cache_affinity_total", "group=aff3-on", "result=warm"); got != 1 {
		t.Errorf("relay_cache_affinity_total{group=aff3-on,result=warm} = %v, want 1", got)
	}
}
