package relay

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/pgtest"
)

func TestLedgerPostgresKilledAndRestartedMidLoad(t *testing.T) {
	pg := pgtest.Start(t)
	t.Setenv("RELAY_TEST_PG_DSN", pg.DSN())
	ok := fakeupstream.New(t, http.HandlerFunc(ledgerUpstream))
	const key = "sk-ledger-pg-0123456789"
	startRelay(t, fmt.Sprintf(`
		ledger postgres {
			dsn {env.RELAY_TEST_PG_DSN}
		}
		key %s ledger-pg
		group ledger-pg {
			channels ledger-pg-ok
		}
`, key)+channelBlock("ledger-pg-ok", ok.URL, "models claude-sonnet-4-5"))
	db, err := sql.Open("pgx", pg.DSN())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	count := func() int {
		var n int
		if err := db.QueryRow(`SELECT COUNT(*) FROM relay_usage`).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	dropped := ledgerMetric(t, "relay_ledger_dropped_total")

	// the load: clients that send messages until told to stop
	var sent, failed atomic.Int64
	var slowest atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				start := time.Now()
				r, err := do("POST", "/v1/messages", key, `{"model":"claude-sonnet-4-5","max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}`)
				sent.Add(1)
				if err != nil || r.status != 200 {
					failed.Add(1)
				}
				if d := int64(time.Since(start)); d > slowest.Load() {
					slowest.Store(d)
				}
			}
		})
	}
	waitFor(t, "rows written before the kill", 10*time.Second, func() bool { return count() > 0 })
	pg.Kill()
	before := sent.Load()
	waitFor(t, "requests served while postgres is down", 10*time.Second, func() bool { return sent.Load() > before+200 })
	pg.Restart()
	waitFor(t, "requests served after postgres is back", 10*time.Second, func() bool { return sent.Load() > before+400 })
	close(stop)
	wg.Wait()

	waitFor(t, "every request's row written once postgres is back", 15*time.Second, func() bool { return count() == int(sent.Load()) })
	if failed.Load() != 0 {
		t.Errorf("%d of %d requests failed", failed.Load(), sent.Load())
	}
	if d := time.Duration(slowest.Load()); d > 2*time.Second {
		t.Errorf("the slowest request took %v: the ledger's outage slowed requests", d)
	}
	if got := ledgerMetric(t, "relay_ledger_dropped_total") - dropped; got != 0 {
		t.Errorf("%v rows dropped within the queue's bound", got)
	}
	// the DSN is resolved, never shown
	resp, err := client.Get(adminURL + "/config/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.Contains(string(body), "host=127.0.0.1") || !strings.Contains(string(body), "{env.RELAY_TEST_PG_DSN}") {
		t.Errorf("GET /config/ shows the resolved DSN:\n%s", body)
	}
	code, usage := getUsage(t, "group_by=key")
	if code != 200 || !strings.Contains(usage, fmt.Sprintf(`"requests":%d,`, sent.Load())) {
		t.Errorf("usage from postgres: %d %s (sent %d)", code, usage, sent.Load())
	}
}
