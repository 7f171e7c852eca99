package ledger

import "github.com/prometheus/client_golang/prometheus"

// The ledger's metrics, which a config with a ledger registers
// (Collectors): the same counters for every writer of the process.
var (
	metricDropped = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "relay_ledger_dropped_total",
		Help: "Rows of the usage ledger dropped: the database was away (or slower than the traffic) for longer than the queue holds, or the relay stopped before it could write them. Their requests were served; their cost is in the budgets' spend and relay_cost_usd_total, not in the ledger.",
	})

	metricLost = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "relay_ledger_rows_lost_total",
		Help: "Rows of a SQLite usage ledger lost with its file: the rows the file held when the writer found it deleted or replaced under the running relay (it then made a new file at the path). A file moved to another path keeps its rows, and counts none.",
	})

	metricWritten = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "relay_ledger_rows_total",
		Help: "Rows written to the usage ledger.",
	})

	metricWriterCPU = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "relay_ledger_writer_cpu_seconds_total",
		Help: "CPU time (user and system) the usage ledger's writer used, on a thread of its own, off the request path: over relay_ledger_rows_total, the CPU a row costs to write. Linux only; 0 elsewhere.",
	})
)

// Collectors are the ledger's metrics, for the registry of a config that
// keeps a ledger: rows dropped, lost with a SQLite file, written, and the
// writer's CPU.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{metricDropped, metricLost, metricWritten, metricWriterCPU}
}
