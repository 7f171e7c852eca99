package relay

import (
	"context"
	"database/sql"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/statuspage"
	"go.uber.org/zap"
)

// The keys of the Spend view's tests: spend-kb's three requests cost more
// than spend-ka's two and its row of two days ago.
const (
	spendKeyA = "sk-spend-a-0123456789"
	spendKeyB = "sk-spend-b-0123456789"
)

// What the fake upstream's answer (10 input and 5 output tokens) costs.
const (
	sonnetCost = (10*3 + 5*15) / 1e6
	haikuCost  = (10*1 + 5*5) / 1e6
	pastCost   = 0.0001 // spend-ka's row of two days ago
)

// spendRelay starts a relay with a ledger in SQLite on disk and the status
// page, and fills the ledger: real requests of two keys in two groups
// today, and a row of two days ago through the ledger's own queue. It
// returns the number of rows in the ledger.
func spendRelay(t *testing.T) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "ledger.db")
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	startRelayWith(t, statusSite, fmt.Sprintf(`
		ledger sqlite %s
		key %s spend-a {
			name spend-ka
		}
		key %s spend-b {
			name spend-kb
		}
		group spend-a {
			channels spend-up
		}
		group spend-b {
			channels spend-up
		}
`, path, spendKeyA, spendKeyB)+channelBlock("spend-up", up.URL, "models claude-sonnet-4-5 claude-haiku-4-5"))
	db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	const sonnet = `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	const haiku = `{"model":"claude-haiku-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`
	for _, s := range []struct{ key, body string }{
		{spendKeyB, sonnet}, {spendKeyB, sonnet}, {spendKeyB, sonnet}, {spendKeyA, sonnet}, {spendKeyA, haiku},
	} {
		if r := send(t, "POST", "/v1/messages", s.key, s.body); r.status != 200 {
			t.Fatalf("%d %s", r.status, r.body)
		}
	}
	l, err := ledger.Current()
	if err != nil {
		t.Fatal(err)
	}
	l.Add(ledger.Row{
		At: time.Now().UTC().AddDate(0, 0, -2), ID: "req_spend_past", Key: "spend-ka", Group: "spend-a",
		Channel: "spend-up", Model: "claude-opus-4-5", Served: "claude-opus-4-5", Cause: "ok", Status: 200,
		CostNano: int64(money.ToNano(pastCost)),
	})
	waitFor(t, "every row in the ledger", 10*time.Second, func() bool { return ledgerRows(t, db) == 6 })
}

// getSpend reads the page's Spend view.
func getSpend(t *testing.T) statuspage.SpendView {
	t.Helper()
	code, h, body := get(t, "/status/spend")
	if code != 200 || h.Get("Content-Type") != "application/json" {
		t.Fatalf("spend: %d %s %s", code, h.Get("Content-Type"), body)
	}
	var v statuspage.SpendView
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatalf("spend: %v\n%s", err, body)
	}
	return v
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

func TestStatusSpendViewFromTheLedger(t *testing.T) {
	spendRelay(t)
	v := getSpend(t)
	today := time.Now().UTC().Format(time.DateOnly)
	past := time.Now().UTC().AddDate(0, 0, -2).Format(time.DateOnly)
	if !v.Ledger || v.Notice != "" || len(v.Days) != statuspage.SpendDays || v.Days[statuspage.SpendDays-1] != today || v.Days[statuspage.SpendDays-3] != past {
		t.Fatalf("the view's days: ledger %v, notice %q, %d days %v", v.Ledger, v.Notice, len(v.Days), v.Days)
	}
	if len(v.Groups) != 2 || v.Groups[0].Name != "spend-a" || v.Groups[1].Name != "spend-b" {
		t.Fatalf("groups: %+v", v.Groups)
	}
	a, b := v.Groups[0].CostUSD, v.Groups[1].CostUSD
	if !near(a[statuspage.SpendDays-1], sonnetCost+haikuCost) || !near(a[statuspage.SpendDays-3], pastCost) || !near(b[statuspage.SpendDays-1], 3*sonnetCost) || b[statuspage.SpendDays-3] != 0 {
		t.Fatalf("costs by day: spend-a %v, spend-b %v", a, b)
	}
	if !near(v.TotalUSD, 4*sonnetCost+haikuCost+pastCost) {
		t.Errorf("total %v", v.TotalUSD)
	}
	if len(v.TopKeys) != 2 || v.TopKeys[0].Name != "spend-kb" || v.TopKeys[1].Name != "spend-ka" ||
		v.TopKeys[0].Requests != 3 || !near(v.TopKeys[1].CostUSD, sonnetCost+haikuCost+pastCost) {
		t.Errorf("top keys: %+v", v.TopKeys)
	}
	if len(v.TopModels) != 3 || v.TopModels[0].Name != "claude-sonnet-4-5" || v.TopModels[0].Requests != 4 ||
		v.TopModels[1].Name != "claude-opus-4-5" || v.TopModels[2].Name != "claude-haiku-4-5" {
		t.Errorf("top models: %+v", v.TopModels)
	}

	t.Run("the CSV has a header row and the rows by day, group, key and model", func(t *testing.T) {
		code, h, body := get(t, "/status/spend.csv")
		if code != 200 || h.Get("Content-Type") != "text/csv; charset=utf-8" || !strings.HasPrefix(h.Get("Content-Disposition"), "attachment;") {
			t.Fatalf("spend.csv: %d %v", code, h)
		}
		recs, err := csv.NewReader(strings.NewReader(body)).ReadAll()
		if err != nil {
			t.Fatal(err)
		}
		want := "day,group,key,model,requests,input_tokens,output_tokens,cache_read_tokens,cache_write_tokens,cost_usd"
		if len(recs) != 5 || strings.Join(recs[0], ",") != want {
			t.Fatalf("spend.csv:\n%s", body)
		}
		if got := strings.Join(recs[1], ","); got != past+",spend-a,spend-ka,claude-opus-4-5,1,0,0,0,0,0.0001" {
			t.Errorf("first row: %s", got)
		}
		_, _, view := get(t, "/status/spend")
		for _, secret := range []string{spendKeyA, spendKeyB, channelKey} {
			if strings.Contains(body, secret) || strings.Contains(view, secret) {
				t.Errorf("the Spend view shows the secret %s", secret)
			}
		}
	})
}

func TestStatusSpendViewWithoutALedger(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	startStatusRelay(t, "st-noledger", up.URL)
	v := getSpend(t)
	if v.Ledger || !strings.Contains(v.Notice, "no ledger is configured") {
		t.Fatalf("without a ledger: %+v", v)
	}
	if code, _, body := get(t, "/status/spend.csv"); code != http.StatusNotFound || !strings.Contains(body, "no ledger") {
		t.Errorf("spend.csv without a ledger: %d %s", code, body)
	}
}

// benchRows are n rows of 50 keys, from 8 groups, 6 channels and 3
// models, spread over a month from start.
func benchRows(n int, start time.Time, from int) []ledger.Row {
	models := []string{"claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5"}
	session := []string{"s", "", "", ""} // a quarter of the requests in a session
	rows := make([]ledger.Row, n)
	for i := range rows {
		k := from + i
		rows[i] = ledger.Row{
			ID: fmt.Sprintf("relay_%024d", k), At: start.Add(time.Duration(k%(30*24*3600)) * time.Second),
			Key: fmt.Sprintf("key-%02d", k%50), Group: fmt.Sprintf("group-%d", k%8), Channel: fmt.Sprintf("channel-%d", k%6),
			Model: models[k%3], Served: models[k%3], Status: 200, Cause: causeOK,
			Input: 1200, Output: 300, CacheRead: 8000, CacheWrite: 400, CostNano: 12_345_678,
			Session: session[k%4], Duration: 2 * time.Second, FirstByte: 400 * time.Millisecond,
		}
	}
	return rows
}

// BenchmarkStatusSpend builds the Spend view from a SQLite ledger whose
// daily rollup is as large as a month of 1M rows of benchRows' spread (600
// key, group, channel and model combinations a day, for 30 days).
func BenchmarkStatusSpend(b *testing.B) {
	s, err := ledger.OpenSQLite(filepath.Join(b.TempDir(), "ledger.db"), sessionDigest)
	if err != nil {
		b.Fatal(err)
	}
	now := time.Now().UTC()
	// the view's first day: today is the last of statuspage.SpendDays
	from := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.UTC).AddDate(0, 0, 1-statuspage.SpendDays)
	ctx := context.Background()
	const batch = 1000
	for k := 0; k < 60*batch; k += batch {
		rows := benchRows(batch, from, k)
		for i := range rows { // each run of 600 rows (every combination) on one day
			rows[i].At = from.AddDate(0, 0, (k+i)/600%statuspage.SpendDays).Add(time.Hour)
		}
		if err := s.Write(ctx, rows); err != nil {
			b.Fatal(err)
		}
	}
	l := ledger.Start(s, "bench", zap.NewNop(), ledger.Queue)
	defer l.Destruct() // closes s
	src := statusSource{ledger: l}
	b.ResetTimer()
	for b.Loop() {
		if v := statuspage.BuildSpend(ctx, src, now); v.Notice != "" || len(v.Groups) != 8 || len(v.TopKeys) != statuspage.SpendTop {
			b.Fatalf("%+v", v)
		}
	}
}
