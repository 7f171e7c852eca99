package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// bigConfigOptions is what the big-config mode loads: channels anthropic
// channels in 50 groups of 4 and keys keys, each with a rate limit.
type bigConfigOptions struct {
	channels, keys int
	keysFile       bool // the keys in a keys file, not in the config
	reloads        int
	profileDir     string // if set, profiles of the caddy process after the reloads
	logf           func(format string, args ...any)
}

// bigConfigResult is what the big-config mode measured.
type bigConfigResult struct {
	configBytes   int
	keysFileBytes int           // 0: the keys are in the config
	firstLoad     time.Duration // from starting caddy to its serving the config
	reload        time.Duration // the median of the reloads through POST /load
	rssKiB        int64         // the caddy process's resident memory after the reloads
	heapKiB       int64         // its heap in use after the reloads and a GC
}

// bigConfigJSON is a Caddy JSON config whose relay has o.channels anthropic
// channels (to an address nothing listens on: nothing is sent) in 50
// groups of 4 and o.keys keys spread over the groups, each with a rate
// limit, their secrets given as sha256 digests as the Caddyfile adapter
// writes them; served on port, with an admin endpoint at adminAddr. With
// o.keysFile the keys are in keysFile, one a line, which it writes, and the
// config names it.
func bigConfigJSON(o bigConfigOptions, port, adminAddr, keysFile string) ([]byte, error) {
	channels := make([]map[string]any, o.channels)
	for i := range channels {
		channels[i] = map[string]any{"name": "ch" + strconv.Itoa(i), "priority": 1 + i%2, "weight": 1 + i%3,
			"models":   []string{"claude-sonnet-4-5", "claude-haiku-4-5"},
			"upstream": map[string]any{"provider": "anthropic", "url": "http://127.0.0.1:1", "api_key": "sk-upstream-" + strconv.Itoa(i)}}
	}
	const groupCount, groupSize = 50, 4
	groups := make([]map[string]any, groupCount)
	for g := range groups {
		var names []string
		for j := range groupSize {
			if name := "ch" + strconv.Itoa((g*groupSize+j)%o.channels); !slices.Contains(names, name) {
				names = append(names, name)
			}
		}
		groups[g] = map[string]any{"name": "g" + strconv.Itoa(g), "channels": names}
	}
	keys := make([]map[string]any, o.keys)
	for i := range keys {
		d := sha256.Sum256(fmt.Appendf(nil, "sk-scale-%010d-abcdefghijklmnop", i))
		keys[i] = map[string]any{"secret": "sha256:" + hex.EncodeToString(d[:]), "group": "g" + strconv.Itoa(i%groupCount), "rate": "1000000/s"}
	}
	handler := map[string]any{"handler": "relay", "channels": channels, "groups": groups, "keys": keys}
	if o.keysFile {
		var lines bytes.Buffer
		enc := json.NewEncoder(&lines)
		for _, k := range keys {
			if err := enc.Encode(k); err != nil {
				return nil, err
			}
		}
		if err := os.WriteFile(keysFile, lines.Bytes(), 0o600); err != nil {
			return nil, err
		}
		delete(handler, "keys")
		handler["keys_file"] = keysFile
	}
	return json.Marshal(map[string]any{
		"admin": map[string]any{"listen": adminAddr, "config": map[string]any{"persist": false}},
		"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"scale": map[string]any{
			"listen": []string{"127.0.0.1:" + port},
			"routes": []any{map[string]any{"handle": []any{handler}}},
		}}}},
	})
}

// runBigConfig starts caddy with a big config, reloads it o.reloads times
// through the admin endpoint and measures both, and the process's memory.
func runBigConfig(ctx context.Context, o bigConfigOptions) (bigConfigResult, error) {
	var res bigConfigResult
	dir, bin, err := buildInTemp(ctx, o.logf)
	if dir != "" {
		defer os.RemoveAll(dir)
	}
	if err != nil {
		return res, err
	}
	siteAddr, err := freeAddr()
	if err != nil {
		return res, err
	}
	adminAddr, err := freeAddr()
	if err != nil {
		return res, err
	}
	_, port, _ := strings.Cut(siteAddr, ":")
	keysFile := filepath.Join(dir, "keys.jsonl")
	cfg, err := bigConfigJSON(o, port, adminAddr, keysFile)
	if err != nil {
		return res, err
	}
	res.configBytes = len(cfg)
	if info, err := os.Stat(keysFile); err == nil {
		res.keysFileBytes = int(info.Size())
	}
	file := filepath.Join(dir, "big.json")
	if err := os.WriteFile(file, cfg, 0o644); err != nil {
		return res, err
	}
	o.logf("loading %d channels and %d keys (%d MB of JSON, keys file %d MB)", o.channels, o.keys, len(cfg)>>20, res.keysFileBytes>>20)
	start := time.Now()
	proc, err := startCaddyFile(ctx, bin, dir, file)
	if err != nil {
		return res, err
	}
	defer proc.stop()
	res.firstLoad = time.Since(start)
	var reloads []time.Duration
	for i := range o.reloads {
		o.logf("reload %d of %d", i+1, o.reloads)
		start := time.Now()
		if err := postLoad(ctx, adminAddr, "application/json", cfg); err != nil {
			return res, err
		}
		reloads = append(reloads, time.Since(start))
	}
	if len(reloads) > 0 {
		slices.Sort(reloads)
		res.reload = reloads[len(reloads)/2]
	}
	if res.heapKiB, err = heapAfterGC(ctx, adminAddr); err != nil {
		return res, err
	}
	if o.profileDir != "" {
		if err := saveProfiles(ctx, adminAddr, filepath.Join(o.profileDir, "big")); err != nil {
			return res, err
		}
	}
	res.rssKiB, err = proc.rssKiB()
	return res, err
}

// startCaddyFile runs caddy with a JSON config file and returns once it
// serves it.
func startCaddyFile(ctx context.Context, bin, dir, file string) (*caddyProcess, error) {
	return startCaddyArgs(ctx, bin, dir, "run", "--config", file)
}

// postLoad posts a config to the admin endpoint's /load, as `caddy reload`
// does, and waits for it to be loaded.
func postLoad(ctx context.Context, adminAddr, contentType string, cfg []byte) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+adminAddr+"/load", strings.NewReader(string(cfg)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", contentType)
	req.Header.Set("Cache-Control", "must-revalidate") // reload even though unchanged
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("POST /load: status %d: %s", resp.StatusCode, body)
	}
	return nil
}

// heapAfterGC runs a GC in the caddy process (a heap profile with gc=1)
// and returns its heap in use, from /debug/vars.
func heapAfterGC(ctx context.Context, adminAddr string) (int64, error) {
	for _, path := range []string{"/debug/pprof/heap?gc=1", "/debug/vars"} {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+adminAddr+path, nil)
		if err != nil {
			return 0, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return 0, err
		}
		if path == "/debug/vars" {
			var vars struct {
				Memstats struct{ HeapInuse int64 } `json:"memstats"`
			}
			if err := json.Unmarshal(body, &vars); err != nil {
				return 0, err
			}
			return vars.Memstats.HeapInuse >> 10, nil
		}
	}
	return 0, nil
}

// String renders the result for the log and docs/performance.md.
func (r bigConfigResult) String() string {
	where := fmt.Sprintf("%.1f MB of JSON", float64(r.configBytes)/(1<<20))
	if r.keysFileBytes > 0 {
		where = fmt.Sprintf("%.1f MB of JSON config and a %.1f MB keys file", float64(r.configBytes)/(1<<20), float64(r.keysFileBytes)/(1<<20))
	}
	return fmt.Sprintf("%s; first load (caddy started to serving) %.2fs, reload (median) %.2fs; resident memory %d MB, heap in use after a GC %d MB",
		where, r.firstLoad.Seconds(), r.reload.Seconds(), r.rssKiB>>10, r.heapKiB>>10)
}
