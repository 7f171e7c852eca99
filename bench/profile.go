package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// profiles are what saveProfiles fetches from a caddy process's admin
// endpoint, and the file each goes to: the heap (after a GC: what is live),
// the goroutines with their stacks, and the runtime's memory statistics.
var profiles = []struct{ path, file string }{
	{"/debug/pprof/heap?gc=1", "heap.pb.gz"},
	{"/debug/pprof/goroutine?debug=1", "goroutines.txt"},
	{"/debug/vars", "vars.json"},
}

// saveProfiles writes the profiles of the caddy process whose admin
// endpoint is at adminAddr to files named prefix-<file>.
func saveProfiles(ctx context.Context, adminAddr, prefix string) error {
	if err := os.MkdirAll(prefix[:strings.LastIndexByte(prefix, '/')+1], 0o755); err != nil {
		return err
	}
	for _, p := range profiles {
		body, err := fetch(ctx, adminAddr, p.path)
		if err != nil {
			return err
		}
		if err := os.WriteFile(prefix+"-"+p.file, body, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// profileName is a file-name prefix for t: "b" for "(b) reverse_proxy".
func profileName(t *target) string {
	return strings.Trim(strings.Fields(t.name)[0], "()")
}

// cpuProfile is a CPU profile of a caddy process being taken while a round
// of load runs.
type cpuProfile struct {
	addr string
	done chan struct{}
	body []byte
	err  error
}

// startCPUProfile starts a CPU profile of the caddy process whose admin
// endpoint is at addr, for the whole seconds of d (at least one).
func startCPUProfile(ctx context.Context, addr string, d time.Duration) *cpuProfile {
	p := &cpuProfile{addr: addr, done: make(chan struct{})}
	secs := max(1, int(d/time.Second))
	go func() {
		defer close(p.done)
		p.body, p.err = fetch(ctx, addr, "/debug/pprof/profile?seconds="+strconv.Itoa(secs))
	}()
	return p
}

// save waits for the CPU profile, then writes it to prefix-cpu.pb.gz, and
// the process's allocations since it started to prefix-allocs.pb.gz (read
// with -sample_index=alloc_space or alloc_objects; divide by the requests
// the process served).
func (p *cpuProfile) save(ctx context.Context, prefix string) error {
	<-p.done
	if p.err != nil {
		return p.err
	}
	if err := os.MkdirAll(prefix[:strings.LastIndexByte(prefix, '/')+1], 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(prefix+"-cpu.pb.gz", p.body, 0o644); err != nil {
		return err
	}
	allocs, err := fetch(ctx, p.addr, "/debug/pprof/allocs")
	if err != nil {
		return err
	}
	return os.WriteFile(prefix+"-allocs.pb.gz", allocs, 0o644)
}

// fetch GETs path from the admin endpoint at addr.
func fetch(ctx context.Context, addr, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: status %d", path, resp.StatusCode)
	}
	return body, nil
}
