package relay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
)

// scaleGroups and scaleGroupSize shape the big configs of the scale
// benchmarks: 50 groups of 4 channels each, whatever the number of
// channels, so that what a request costs can be compared across sizes
// (selection looks at its own group's channels only).
const (
	scaleGroups    = 50
	scaleGroupSize = 4
)

// scaleSecret is the secret of the i-th key of a big config: long and
// varied enough not to be weak.
func scaleSecret(i int) string { return fmt.Sprintf("sk-scale-%010d-abcdefghijklmnop", i) }

// scaleConfig returns the channels, groups and keys of a big config: n
// channels, scaleGroups groups of scaleGroupSize channels (group g holds
// channels 4g..4g+3, modulo n) and k keys spread over the groups, each with
// a rate limit, their secrets given as sha256 digests as the Caddyfile
// adapter writes them. upstream is each channel's upstream.
func scaleConfig(n, k int, upstream func(i int) json.RawMessage) ([]*Channel, []*Group, []*Key) {
	channels := make([]*Channel, n)
	for i := range channels {
		channels[i] = &Channel{Name: "ch" + strconv.Itoa(i), UpstreamRaw: upstream(i),
			Models: []string{"claude-sonnet-4-5", "claude-haiku-4-5"}, Priority: 1 + i%2, Weight: 1 + i%3}
	}
	groups := make([]*Group, scaleGroups)
	for g := range groups {
		grp := &Group{Name: "g" + strconv.Itoa(g)}
		for j := range scaleGroupSize {
			name := "ch" + strconv.Itoa((g*scaleGroupSize+j)%n)
			if !containsString(grp.Channels, name) {
				grp.Channels = append(grp.Channels, name)
			}
		}
		groups[g] = grp
	}
	keys := make([]*Key, k)
	for i := range keys {
		d := sha256.Sum256([]byte(scaleSecret(i)))
		keys[i] = &Key{Secret: sha256Prefix + hex.EncodeToString(d[:]), Group: "g" + strconv.Itoa(i%scaleGroups),
			KeyOptions: KeyOptions{Rate: "1000000/s"}}
	}
	return channels, groups, keys
}

func containsString(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// BenchmarkAuthAndSelect measures what a request's key and channel cost as
// the config grows: authentication (the key's lookup by the sha256 of its
// secret), the key's rate limit, selection in the key's group, the
// channel's admission and the attempt's outcome, for 10 to 1,000 channels
// in 50 groups of 4 and 10 to 100,000 keys. Requests cycle over 1,024 keys
// spread over all of them. Flat ns/op across the sizes is the point.
func BenchmarkAuthAndSelect(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		for _, k := range []int{10, 1000, 100000} {
			b.Run(fmt.Sprintf("channels=%d/keys=%d", n, k), func(b *testing.B) {
				r := &Relay{}
				r.Channels, r.Groups, r.Keys = scaleConfig(n, k, func(int) json.RawMessage { return upstream("mock") })
				provisionHandler(b, r)
				reqs := make([]*http.Request, min(k, 1024))
				for i := range reqs {
					req, _ := http.NewRequest(http.MethodPost, "/v1/messages", nil)
					req.Header.Set("X-Api-Key", scaleSecret(i*k/len(reqs)))
					reqs[i] = req
				}
				policy := health.CooldownPolicy{Base: time.Second, Max: time.Minute, Auth: time.Hour}
				var triedBuf [4]*channel
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					key, rerr := r.authenticate(reqs[i%len(reqs)])
					if rerr != nil {
						b.Fatal(rerr)
					}
					now := time.Now()
					g, scope, _ := key.limits.Take(now, 100)
					if scope != limits.ScopeNone {
						b.Fatal("key refused")
					}
					sel := selection{model: "claude-sonnet-4-5", tried: triedBuf[:0], rand: defaultRand, now: now}
					ch, perr := pickErr(key.group, &sel)
					if ch == nil {
						b.Fatal(perr)
					}
					t, _ := ch.health.admit(now, 100)
					if t == nil {
						b.Fatal("channel refused")
					}
					t.finish(verdict{outcome: outcomeSuccess}, policy, now, 0, 150)
					key.limits.Done(now, g, 150)
				}
			})
		}
	}
}

// bigCaddyConfig is the JSON of a Caddy config whose relay has n anthropic
// channels (each with its own transport, to an address nothing listens
// on: nothing is sent) and k keys, served on a free loopback port, with no
// admin endpoint and nothing saved.
func bigCaddyConfig(tb testing.TB, n, k int, keysFile string) []byte {
	tb.Helper()
	channels, groups, keys := scaleConfig(n, k, func(i int) json.RawMessage {
		return upstream("anthropic", "url", "http://127.0.0.1:1", "api_key", "sk-upstream-"+strconv.Itoa(i))
	})
	handler := map[string]any{"handler": "relay", "channels": channels, "groups": groups, "keys": keys}
	if keysFile != "" { // the keys in a keys file, one a line
		var lines bytes.Buffer
		enc := json.NewEncoder(&lines)
		for _, key := range keys {
			if err := enc.Encode(key); err != nil {
				tb.Fatal(err)
			}
		}
		if err := os.WriteFile(keysFile, lines.Bytes(), 0o600); err != nil {
			tb.Fatal(err)
		}
		delete(handler, "keys")
		handler["keys_file"] = keysFile
	}
	cfg := map[string]any{
		"admin": map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
		"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"scale": map[string]any{
			"listen": []string{"127.0.0.1:0"},
			"routes": []any{map[string]any{"handle": []any{handler}}},
		}}}},
	}
	b, err := json.Marshal(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	return b
}

// BenchmarkLoadBigConfig loads a big config into a real Caddy (in this
// process), then reloads it b.N times: ns/op is one reload (the new config
// provisioned, the old one cleaned up). It reports the first load's time
// (first-load-ms), the heap the loaded config holds after a GC (heap-MB)
// and the process's resident memory (rss-MB). The config of 1,000 channels
// and 10 keys measures what the channels cost by themselves; the last one
// has its keys in a keys file.
func BenchmarkLoadBigConfig(b *testing.B) {
	for _, size := range []struct {
		channels, keys int
		file           bool
	}{{100, 1000, false}, {1000, 10, false}, {1000, 100000, false}, {1000, 100000, true}} {
		name := fmt.Sprintf("channels=%d/keys=%d", size.channels, size.keys)
		if size.file {
			name += "/keys_file"
		}
		b.Run(name, func(b *testing.B) {
			file := ""
			if size.file {
				file = filepath.Join(b.TempDir(), "keys.jsonl")
			}
			cfg := bigCaddyConfig(b, size.channels, size.keys, file)
			before := heapInuse()
			start := time.Now()
			if err := caddy.Load(cfg, true); err != nil {
				b.Fatal(err)
			}
			first := time.Since(start)
			b.Cleanup(func() { _ = caddy.Stop() })
			heap := heapInuse() - before
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := caddy.Load(cfg, true); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(first.Milliseconds()), "first-load-ms")
			b.ReportMetric(float64(heap)/(1<<20), "heap-MB")
			b.ReportMetric(float64(rssKiB())/1024, "rss-MB")
		})
	}
}

// heapInuse is the heap in use after a GC.
func heapInuse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse)
}

// rssKiB is this process's resident memory (VmRSS), 0 where /proc has none.
func rssKiB() int64 {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	return 0
}

// TestAReloadLetsGoOfTheConfigBefore: once a reload has replaced a config
// and cleaned it up, nothing the new one shares with it (its pooled
// transports, the states kept by name) keeps it in memory: with many keys
// it is hundreds of megabytes. The relay is loaded as Caddy loads it, as a
// module of a config's context.
func TestAReloadLetsGoOfTheConfigBefore(t *testing.T) {
	channels, groups, keys := scaleConfig(4, 10, func(i int) json.RawMessage {
		return upstream("anthropic", "url", "http://127.0.0.1:1", "api_key", "sk-upstream-"+strconv.Itoa(i))
	})
	raw, err := json.Marshal(map[string]any{"channels": channels, "groups": groups, "keys": keys})
	if err != nil {
		t.Fatal(err)
	}
	load := func() (*Relay, func()) {
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		m, err := ctx.LoadModuleByID("http.handlers.relay", raw)
		if err != nil {
			t.Fatal(err)
		}
		return m.(*Relay), cancel // cancel cleans up the config's modules
	}
	old, unloadOld := load()
	var freed atomic.Bool
	runtime.AddCleanup(old, func(*atomic.Bool) { freed.Store(true) }, &freed)
	old = nil
	_, unloadNew := load()
	defer unloadNew()
	unloadOld()
	waitFor(t, "the config before the reload is collected", 10*time.Second, func() bool {
		runtime.GC()
		return freed.Load()
	})
}

// BenchmarkProvisionChannels measures what a channel costs when a config
// loads: each op provisions a relay of 1,000 anthropic channels (each with
// its own transport, from the pool after the first load) in 50 groups and
// 10 keys, then cleans up the one before it, as a reload does. It reports
// the time (ns-per-channel) and the heap a loaded channel holds after a GC
// (B-per-channel), measured in a process that loaded a config before.
func BenchmarkProvisionChannels(b *testing.B) {
	const n = 1000
	load := func() (*Relay, context.CancelFunc) {
		r := &Relay{}
		r.Channels, r.Groups, r.Keys = scaleConfig(n, 10, func(i int) json.RawMessage {
			return upstream("anthropic", "url", "http://127.0.0.1:1", "api_key", "{env.SCALE_UPSTREAM_KEY}")
		})
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		if err := r.Provision(ctx); err != nil {
			b.Fatal(err)
		}
		return r, cancel
	}
	unload := func(r *Relay, cancel context.CancelFunc) { _ = r.Cleanup(); cancel() }
	b.Setenv("SCALE_UPSTREAM_KEY", "sk-upstream")
	unload(load()) // what the first config of a process sets up once
	base := heapAlloc()
	r, cancel := load()
	held := heapAlloc() - base
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		next, nextCancel := load()
		unload(r, cancel)
		r, cancel = next, nextCancel
	}
	b.StopTimer()
	unload(r, cancel)
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/n, "ns-per-channel")
	b.ReportMetric(float64(held)/n, "B-per-channel")
}

// heapAlloc is the heap allocated after a GC.
func heapAlloc() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}
