package relay

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// TestASessionsFleetKeysExpireWithItsWindow: in a fleet, every Redis key
// of a session (its budget's spend and holds, its session_rate, its loop
// guard's run) expires at most an hour after the window of its
// session_budget ends; none is kept for the month a key's holds are.
func TestASessionsFleetKeysExpireWithItsWindow(t *testing.T) {
	srv := redistest.Start(t)
	var hits atomic.Int32
	up := fakeupstream.New(t, tenOutputTokens(&hits))
	const name = "session-ttl"
	r := &Relay{
		Fleet: &Fleet{Redis: &FleetRedis{Address: []string{srv.Addr}, Prefix: "sttl:"}},
		Keys: []*Key{{Secret: "sk-" + name + "-0123456789abcdef", Group: name,
			KeyOptions: KeyOptions{Name: name, SessionLimits: SessionLimits{SessionBudget: "5usd/1h", SessionRate: "60/m", LoopGuard: 3}}}},
		Channels: []*Channel{{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}},
		Groups:   []*Group{{Name: name, Channels: []string{name + "-ch"}}},
		Pricing:  map[string]Price{"m-hold": {Input: 0, Output: 10_000}},
	}
	provisionHandler(t, r)
	s := newCCSession("9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d")
	s.toolTurn("Read", `{"file_path":"/etc/hosts"}`, "127.0.0.1 localhost", false)
	if w, _ := serveHandler(t, r, s.request("sk-"+name+"-0123456789abcdef", 10)); w.Code != 200 {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
	windowEnd := time.Now().UTC().Truncate(time.Hour).Add(time.Hour)

	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	var keys []string
	waitFor(t, "the session's spend synced to Redis", 5*time.Second, func() bool {
		all, err := rdb.Keys(ctx, "sttl:*").Result()
		if err != nil {
			t.Fatal(err)
		}
		keys = keys[:0]
		spend := false
		for _, k := range all {
			if strings.Contains(k, "{s:session:") || strings.Contains(k, "{x:") {
				keys = append(keys, k)
				spend = spend || strings.Contains(k, "}:day:")
			}
		}
		return spend
	})
	kinds := map[string]bool{}
	for _, k := range keys {
		ttl, err := rdb.PTTL(ctx, k).Result()
		bound := time.Until(windowEnd) + time.Hour + 5*time.Second
		t.Logf("%s: expires in %v", k, ttl)
		if err != nil || ttl <= 0 || ttl > bound {
			t.Errorf("the session's key %s expires in %v (%v), want within %v: an hour after its window ends", k, ttl, err, bound.Round(time.Second))
		}
		kinds[k[strings.LastIndex(k, "}:")+2:]] = true
	}
	for _, want := range []string{"held", "loop"} {
		if !kinds[want] {
			t.Errorf("no %s key among the session's %v", want, keys)
		}
	}
}

// TestAGroupsSessionsFitIn100MB: however its principals spread their
// sessions (a few with as many as a principal keeps, or as many
// principals as a group keeps with a few each), a group keeps at most
// maxGroupSessions sessions on a node, the newest principal's all among
// them; what it keeps, each session with a session_budget, a
// session_rate and a loop guard and an id of the longest length kept as
// it is, takes under 100 MB.
func TestAGroupsSessionsFitIn100MB(t *testing.T) {
	for _, c := range []struct{ principals, each int }{
		{maxGroupSessions/maxSessions + 10, maxSessions},
		{maxSessionPrincipals, maxGroupSessions/maxSessionPrincipals + 1},
	} {
		t.Run(fmt.Sprintf("%dx%d", c.principals, c.each), func(t *testing.T) {
			var hits atomic.Int32
			name := "session-bound"
			r := sessionRelay(t, &name, SessionLimits{SessionBudget: "5usd/1h", SessionRate: "60/m", LoopGuard: 3}, tenOutputTokens(&hits))
			k := r.keys[digestOf("sk-"+name)]
			r.activate(k)
			now := r.now()
			before := liveHeap()
			ins := make([]*inbound, c.principals)
			for p := range ins {
				ins[p] = &inbound{}
				ins[p].who.key, ins[p].who.state, ins[p].who.stateID = k, k.state, fmt.Sprintf("user:principal-%05d", p)
				for i := range c.each {
					id := fmt.Sprintf("p%05d-s%05d-", p, i)
					id += strings.Repeat("x", maxIDLen-len(id)) // kept as it is, at its longest
					r.session(ins[p], id, k.sessions, now)
				}
			}
			principals := r.groups[name].state.sessions.Load()
			kept := 0
			principals.Each(func(_ string, ps *principalSessions) { kept += ps.c.Len() })
			used := liveHeap() - before
			t.Logf("%d principals of %d sessions: %d kept, %.1f MB, %.0f bytes a session", c.principals, c.each, kept, float64(used)/1e6, float64(used)/float64(kept))
			if kept > maxGroupSessions {
				t.Errorf("the group keeps %d sessions, over its bound of %d", kept, maxGroupSessions)
			}
			if used > 100e6 {
				t.Errorf("the group's sessions take %.1f MB, over 100 MB", float64(used)/1e6)
			}
			if ps, ok := principals.Peek(ins[len(ins)-1].who.stateID); !ok || ps.c.Len() != c.each {
				t.Errorf("the newest principal does not keep its %d sessions", c.each)
			}
			runtime.KeepAlive(ins)
		})
	}
}

// liveHeap is the heap's live bytes after a full collection.
func liveHeap() int64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}
