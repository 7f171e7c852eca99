package ledger

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/pgtest"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
)

func TestLedgerPostgresStore(t *testing.T) {
	pg := pgtest.Start(t)
	s, err := openPostgresStore(pg.DSN(), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	checkStore(t, s)
	// a second relay of the fleet starting on the same database migrates
	// nothing
	s2, err := openPostgresStore(pg.DSN(), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	var v int
	if err := s2.db.QueryRow(`SELECT MAX(version) FROM schema_version`).Scan(&v); err != nil || v != len(postgresDialect.migrations) {
		t.Errorf("schema_version %d %v", v, err)
	}
}

func TestLedgerPostgresRowsWaitThenDropOnlyPastTheQueueBound(t *testing.T) {
	pg := pgtest.Start(t)
	s, err := openPostgresStore(pg.DSN(), testDigest)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	l := newWriter(s, "postgres", zap.NewNop(), 20)
	dropped := testutil.ToFloat64(metricDropped)
	pg.Kill()
	var own []Row
	for i := range 50 {
		l.Add(Row{ID: fmt.Sprintf("bound-%02d", i), At: time.Now(), Key: "k"})
		if i%10 == 9 {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			own = l.take(own)
			if l.flush(ctx, &own) {
				t.Fatal("a write to a killed postgres succeeded")
			}
			cancel()
		}
	}
	if got := testutil.ToFloat64(metricDropped) - dropped; got != 30 {
		t.Errorf("%v rows dropped, want the 30 past the queue's 20", got)
	}
	pg.Restart()
	for range 2 {
		own = l.take(own)
		if !l.flush(context.Background(), &own) {
			t.Fatal("the write failed after postgres came back")
		}
	}
	var n int
	var first, last string
	if err := s.db.QueryRow(`SELECT COUNT(*), MIN(request_id), MAX(request_id) FROM relay_usage`).Scan(&n, &first, &last); err != nil || n != 20 || first != "bound-00" || last != "bound-19" {
		t.Errorf("%d rows %s..%s (%v), want the 20 that waited", n, first, last, err)
	}
}
