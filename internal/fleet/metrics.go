package fleet

import "github.com/prometheus/client_golang/prometheus"

var (
	metricUp = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "relay_storage_up",
		Help: "1 while the fleet's storage (Redis) answers, 0 while the relay serves on its own state; absent without storage.",
	})

	metricErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_storage_errors_total",
		Help: "Operations on the fleet's storage (Redis) that failed or timed out, by operation (admit, release, renew, publish, sync, heartbeat, fleet, owners).",
	}, []string{"op"})

	metricSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "relay_storage_seconds",
		Help:    "Time of operations on the fleet's storage (Redis), by operation.",
		Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25},
	}, []string{"op"})
)

// Collectors are the fleet's metrics, which a config with a fleet
// registers.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{metricUp, metricErrors, metricSeconds}
}
