package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
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
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+adminAddr+p.path, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: status %d", p.path, resp.StatusCode)
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
