package relay

import "testing"

// TestLedgerDroppingAlertOnSeries runs the ledger's alert in promtool: rows
// dropped page while they drop, and stop paging once the drops stop.
func TestLedgerDroppingAlertOnSeries(t *testing.T) {
	promtoolRulesTest(t, `rule_files: [%q]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'relay_ledger_dropped_total{instance="relay-1"}'
        values: '0x10 0 50 100 150 150x20'
    alert_rule_test:
      - eval_time: 10m
        alertname: RelayLedgerDropping
        exp_alerts: []
      - eval_time: 14m
        alertname: RelayLedgerDropping
        exp_alerts:
          - exp_labels:
              severity: warning
              instance: relay-1
            exp_annotations:
              summary: "Relay relay-1 dropped 150 usage ledger rows in 5 minutes"
              description: "The ledger's database did not take its rows for longer than the queue holds (100,000 rows). Requests are served and budgets still count their spend, but GET /relay/usage and invoices miss these requests. The relay's log says when the outage began (ledger unavailable) and ended (ledger is back)."
      - eval_time: 25m
        alertname: RelayLedgerDropping
        exp_alerts: []
`)
}

// TestLedgerRowsLostAlertOnSeries runs the alert of a ledger file lost in
// promtool: it pages when rows are lost, and stops once the loss is ten
// minutes old.
func TestLedgerRowsLostAlertOnSeries(t *testing.T) {
	promtoolRulesTest(t, `rule_files: [%q]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'relay_ledger_rows_lost_total{instance="relay-1"}'
        values: '0x10 1200 1200x30'
    alert_rule_test:
      - eval_time: 10m
        alertname: RelayLedgerRowsLost
        exp_alerts: []
      - eval_time: 12m
        alertname: RelayLedgerRowsLost
        exp_alerts:
          - exp_labels:
              severity: critical
              instance: relay-1
            exp_annotations:
              summary: "Relay relay-1 lost 1200 usage ledger rows with its SQLite file"
              description: "The ledger's file was deleted or replaced while the relay ran: the rows it held are no longer in the ledger (restore them from a backup). The relay made a new file at the path and writes its rows there. The relay's log says when (ledger: its file was deleted or replaced)."
      - eval_time: 25m
        alertname: RelayLedgerRowsLost
        exp_alerts: []
`)
}
