package main

import (
	"database/sql"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	_ "github.com/ncruces/go-sqlite3/driver"
)

// TestLedgerLosesAtMostTheLastSecondWhenKilled runs the built binary with
// a SQLite ledger, sends requests until it kills the process (SIGKILL,
// no graceful stop), and checks that every request answered more than the
// writer's second (and a margin for the write itself) before the kill has
// its row: the database opens after the crash, WAL recovered.
func TestLedgerLosesAtMostTheLastSecondWhenKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	dir := t.TempDir()
	db := filepath.Join(dir, "ledger.db")
	site, admin := freePort(t), freePort(t)
	const key = "sk-relay-ledger-kill-0123456789"
	cfg := fmt.Sprintf(`{
	admin %s
}

http://%s {
	relay {
		ledger sqlite %s
		key %s kill {
			name kill-test
		}
		channel kill-mock {
			provider mock
			models claude-sonnet-5-5
		}
		group kill {
			channels kill-mock
		}
	}
}
`, admin, site, db, key)
	file := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := runCaddy(t, caddyBin, file)

	type answered struct {
		id string
		at time.Time
	}
	var got []answered
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
		req, _ := http.NewRequest("POST", "http://"+site+"/v1/messages",
			strings.NewReader(`{"model":"claude-sonnet-5-5","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}`))
		req.Header.Set("X-Api-Key", key)
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("status %d", resp.StatusCode)
		}
		got = append(got, answered{resp.Header.Get("X-Relay-Request-Id"), time.Now()})
	}
	killed := time.Now()
	if err := cmd.Process.Kill(); err != nil { // SIGKILL
		t.Fatal(err)
	}
	_ = cmd.Wait()

	conn, err := sql.Open("sqlite3", "file:"+db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	written := map[string]bool{}
	rows, err := conn.Query(`SELECT request_id FROM relay_usage`)
	if err != nil {
		t.Fatalf("the ledger after the kill: %v", err)
	}
	for rows.Next() {
		var id string
		_ = rows.Scan(&id)
		written[id] = true
	}
	rows.Close()
	lost, lostEarly := 0, 0
	for _, a := range got {
		if written[a.id] {
			continue
		}
		lost++
		if killed.Sub(a.at) > 1500*time.Millisecond {
			lostEarly++
		}
	}
	t.Logf("%d requests, %d rows written, %d lost (all in the last second and a half)", len(got), len(written), lost)
	if lostEarly > 0 || len(written) == 0 {
		t.Errorf("%d of %d rows lost that were answered more than 1.5s before the kill (%d written)", lostEarly, len(got), len(written))
	}
}
