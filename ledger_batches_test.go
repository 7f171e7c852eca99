package relay

import (
	"database/sql"
	"fmt"
	"math"
	"path/filepath"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/redistest"
)

// ledgerCostByKey sums the ledger's cost of today by key, in nano-USD.
func ledgerCostByKey(t *testing.T, db *sql.DB) map[string]int64 {
	t.Helper()
	rows, err := db.Query(`SELECT key_name, SUM(cost_nano_usd) FROM relay_usage
		WHERE strftime('%Y-%m-%d', time/1000, 'unixepoch') = ? GROUP BY key_name`, time.Now().UTC().Format(time.DateOnly))
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var k string
		var n int64
		if err := rows.Scan(&k, &n); err != nil {
			t.Fatal(err)
		}
		out[k] = n
	}
	return out
}

// TestLedgerKeepsBatchesReconciledReadTwiceAndInAFleet reads each of two
// batches' results twice, each first by a key of the group that did not
// make it: one made by a key with a budget (its hold makes it the payer),
// one by a key without (whoever reads first pays). After every read, the
// ledger's cost by key is the spend GET /relay/keys shows, to the nano-USD;
// on one relay, and on a relay of a fleet, whose batches' holds are in
// Redis (settled by their record there).
func TestLedgerKeepsBatchesReconciledReadTwiceAndInAFleet(t *testing.T) {
	for _, mode := range []string{"single", "fleet"} {
		t.Run(mode, func(t *testing.T) {
			storage := ""
			if mode == "fleet" {
				srv := redistest.Start(t)
				storage = fmt.Sprintf("\t\tstorage redis {\n\t\t\taddress %s\n\t\t\tprefix ledger-batch:\n\t\t}\n", srv.Addr)
			}
			path := filepath.Join(t.TempDir(), "ledger.db")
			up := fakeupstream.New(t, fakeupstream.NewStore("ledger-"+mode))
			payer, free := "lb-"+mode+"-payer", "lb-"+mode+"-free"
			keyPayer, keyFree := "sk-"+payer+"-0123456789", "sk-"+free+"-0123456789"
			startRelay(t, storage+fmt.Sprintf(`
		ledger sqlite %s
		key %s lb-%s-g {
			name %s
			budget 1000usd/day
		}
		key %s lb-%s-g {
			name %s
		}
		group lb-%s-g {
			channels lb-%s-ch
		}
`, path, keyPayer, mode, payer, keyFree, mode, free, mode, mode)+channelBlock("lb-"+mode+"-ch", up.URL, "models claude-sonnet-4-5"))
			db, err := sql.Open("sqlite3", "file:"+path+"?mode=ro")
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()

			// a key's spend outlives a config (as it must, over a reload):
			// what this run's requests spent is what was spent after them
			// less what was before (a run of -count 2 finds the first's)
			before := ledgerSpend(t)
			rows := 0
			reconciled := func(what string, wantPayer float64) {
				t.Helper()
				waitFor(t, what+": every request's row in the ledger", 10*time.Second, func() bool { return ledgerRows(t, db) == rows })
				spent, ledger := ledgerSpend(t), ledgerCostByKey(t, db)
				for k := range spent {
					spent[k] -= before[k]
				}
				for _, k := range []string{payer, free} {
					if n := int64(math.Round(spent[k] * 1e9)); ledger[k] != n {
						t.Errorf("%s: key %s: ledger %d nano-USD, budgets saw %d", what, k, ledger[k], n)
					}
				}
				if math.Abs(spent[payer]-wantPayer) > 1e-12 || spent[free] != 0 {
					t.Errorf("%s: %s spent %v (want %v), %s %v (want 0)", what, payer, spent[payer], wantPayer, free, spent[free])
				}
			}
			sonnet := []string{"claude-sonnet-4-5", "claude-sonnet-4-5"}
			one := batchUSD(2, 3, 15)

			held := makeBatch(t, keyPayer, sonnet) // held by the payer's budget
			rows++
			readResults(t, keyFree, held)
			rows++
			reconciled("a batch with a hold, read by another key", one)
			readResults(t, keyPayer, held)
			rows++
			reconciled("the same, read again by its maker", one)

			unheld := makeBatch(t, keyFree, sonnet) // no budget holds it
			rows++
			readResults(t, keyPayer, unheld)
			rows++
			reconciled("a batch without a hold, read by another key", 2*one)
			readResults(t, keyFree, unheld)
			rows++
			reconciled("the same, read again by its maker", 2*one)

			var batchRows int
			_ = db.QueryRow(`SELECT COUNT(*) FROM relay_usage WHERE cause = 'batch' AND key_name = ? AND served_model = 'claude-sonnet-4-5'
				AND input_tokens = 20 AND output_tokens = 10`, payer).Scan(&batchRows)
			if batchRows != 2 {
				t.Errorf("%d rows of batch results are the payer's, want 2", batchRows)
			}
		})
	}
}

// TestLedgerBatchRowsAddUpToTheCharge: the rows of a batch's results, one
// per model, add up to the nano-USD the budgets charged for the whole,
// none negative, even where each model's cost alone rounds otherwise.
func TestLedgerBatchRowsAddUpToTheCharge(t *testing.T) {
	in := &inbound{id: "req-1", who: requester{key: &key{name: "reader", group: &group{name: "g"}}}}
	in.end.status = 200
	b := &batchCharge{}
	for i, c := range []float64{0.5e-9, 0.5e-9, 0.5e-9, 0.5e-9, 1.25e-6} { // each of the first four rounds up alone
		m := fmt.Sprintf("claude-m%d", i)
		b.models = append(b.models, batchModel{model: m, usage: usage{input: int64(i + 1)}, cost: c})
		in.end.cost += c
	}
	in.end.batch = b
	rows := recordedRows(t, func(w *ledger.Writer) { recordUsage(w, in, time.Now(), time.Millisecond, in.end.cost, 0) })
	if len(rows) != 5 {
		t.Fatalf("%d rows, want one per model", len(rows))
	}
	var sum int64
	for i, row := range rows {
		sum += row.CostNano
		wantID := "req-1"
		if i > 0 {
			wantID += "/" + row.Served
		}
		if row.CostNano < 0 || row.ID != wantID || row.Cause != "batch" || row.Key != "reader" || row.Served != row.Model || row.Input != int64(i+1) {
			t.Errorf("row %d: %+v", i, row)
		}
	}
	if want := int64(money.ToNano(in.end.cost)); sum != want {
		t.Errorf("the rows cost %d nano-USD, the budgets charged %d", sum, want)
	}
}
