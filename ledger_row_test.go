package relay

import (
	"context"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
)

// nopStore is a ledger database that takes every row and keeps none.
type nopStore struct{}

func (nopStore) Write(context.Context, []ledger.Row) error       { return nil }
func (nopStore) Prune(context.Context, time.Time) (int64, error) { return 0, nil }
func (nopStore) Usage(context.Context, ledger.Query, func(ledger.UsageRow) error) error {
	return nil
}
func (nopStore) Close() error { return nil }

// keptStore is a ledger database that keeps what it was given.
type keptStore struct {
	nopStore
	mu   sync.Mutex
	rows []ledger.Row
}

func (s *keptStore) Write(_ context.Context, rows []ledger.Row) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rows = append(s.rows, rows...)
	return nil
}

// recordedRows are the rows record hands a writer of its own, written out
// once the writer stopped.
func recordedRows(t *testing.T, record func(w *ledger.Writer)) []ledger.Row {
	t.Helper()
	s := new(keptStore)
	w := ledger.Start(s, "test", zap.NewNop(), ledger.Queue)
	record(w)
	if err := w.Destruct(); err != nil {
		t.Fatal(err)
	}
	return s.rows
}

// ledgerMetric is the value of the ledger's counter name.
func ledgerMetric(t *testing.T, name string) float64 {
	t.Helper()
	for _, c := range ledger.Collectors() {
		descs := make(chan *prometheus.Desc, 1)
		c.Describe(descs)
		close(descs)
		for d := range descs {
			if m := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(d.String()); m != nil && m[1] == name {
				return testutil.ToFloat64(c)
			}
		}
	}
	t.Fatalf("the ledger has no metric %s", name)
	return 0
}

func TestSessionIDIsNeverStoredRaw(t *testing.T) {
	in := &inbound{ask: asked{header: http.Header{}, userID: "user_abc_account__session_5f1c"}}
	if s := in.agentSession(); s != "5f1c" {
		t.Errorf("session of metadata.user_id = %q", s)
	}
	in.ask.header.Set("X-Claude-Code-Session-Id", "cc-session-1")
	if s := in.agentSession(); s != "cc-session-1" {
		t.Errorf("the header comes first, got %q", s)
	}
	if d := sessionDigest("cc-session-1"); len(d) != 16 || strings.Contains(d, "session") {
		t.Errorf("digest %q", d)
	}
	if sessionDigest("") != "" {
		t.Error("no session, no digest")
	}
}

// A session id longer than maxIDLen (a header a client makes as long as
// it likes) is digested when its row is queued, to the digest the writer
// stores for it, so a queue waiting for a database holds no long ids; a
// shorter one is queued as it is, for the writer to digest.
func TestALongSessionIDIsDigestedWhenQueued(t *testing.T) {
	long := strings.Repeat("s", 4096)
	rows := recordedRows(t, func(w *ledger.Writer) {
		for _, sid := range []string{"cc-session-1", long} {
			in := &inbound{id: newRequestID(), who: requester{key: &key{name: "k", group: &group{name: "g"}}}, ask: asked{header: http.Header{}}}
			in.ask.header.Set("X-Claude-Code-Session-Id", sid)
			recordUsage(w, in, time.Now(), time.Millisecond, 0, 0)
		}
	})
	if len(rows) != 2 {
		t.Fatalf("%d rows, want 2", len(rows))
	}
	short, queued := rows[0], rows[1]
	if short.Session != "cc-session-1" || short.SessionDigested {
		t.Errorf("a short id is queued as %q (digested %v), want it as it is, for the writer", short.Session, short.SessionDigested)
	}
	if queued.Session != sessionDigest(long) || !queued.SessionDigested {
		t.Fatalf("a %d-byte id is queued as %d bytes (digested %v), want its digest", len(long), len(queued.Session), queued.SessionDigested)
	}
}
