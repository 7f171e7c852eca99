package relay

import (
	"errors"
	"time"

	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/prometheus/client_golang/prometheus"
)

// The relay's metrics. The collectors are created once, for the process,
// and registered in the registry of every config Caddy loads (each load
// brings a new registry), so their values carry on across reloads.
var (
	metricRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_requests_total",
		Help: "Requests answered, by group, the channel that answered (none for the relay's own errors), model, HTTP status and cause: ok, client (a bad request, an unknown model, a limit, a client that left), upstream (an upstream's failure passed on, or a stream it broke), relay (no healthy channel, a queue that timed out).",
	}, []string{"group", "channel", "model", "code", "cause"})

	metricDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "relay_request_duration_seconds",
		Help:    "Time from a request's arrival to the end of its answer, by group and model.",
		Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600},
	}, []string{"group", "model"})

	metricFirstByte = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "relay_upstream_first_byte_seconds",
		Help:    "Time from sending an attempt to its upstream's response headers, by channel.",
		Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60},
	}, []string{"channel"})

	metricAttempts = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_attempts_total",
		Help: "Attempts on upstream channels, by channel and outcome (success, client_error, auth, rate_limited, overloaded, transient, canceled).",
	}, []string{"channel", "outcome"})

	metricFailovers = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_failovers_total",
		Help: "Attempts made after a request's first one failed, by group.",
	}, []string{"group"})

	metricTokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_tokens_total",
		Help: "Tokens the upstreams reported, by group, channel, model and kind (input, output, cache_read, cache_write). The cache hit ratio is cache_read / (input + cache_read + cache_write).",
	}, []string{"group", "channel", "model", "kind"})

	metricCost = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_cost_usd_total",
		Help: "Cost of the tokens at the configured prices times the price factor of the channel that served them, in US dollars, by group, that channel and model.",
	}, []string{"group", "channel", "model"})

	metricWasted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_wasted_tokens_total",
		Help: "Input tokens (input, cache read and cache write; the request's estimate when the upstream reported none) that an upstream processed in attempts the relay abandoned, by channel and reason: failover (the upstream had the request, a timeout or a stream that broke before its content, and another attempt followed) or canceled (the client left before the attempt's answer reached it). The client is never charged for them.",
	}, []string{"channel", "reason"})

	metricIncomplete = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_incomplete_total",
		Help: "Requests whose answer did not complete (client gone, stream broken); their tokens are the ones seen.",
	}, []string{"group", "model"})

	metricEstimated = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_estimated_usage_total",
		Help: "Requests whose usage was estimated, by group: output tokens from the content the client was sent (the client left a stream, and its final usage did not come within settle_grace), or the input of a request whose client left before any answer and before the upstream counted it. Their cost and the key's spend include the estimate.",
	}, []string{"group"})

	metricDedup = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_dedup_total",
		Help: "Retries answered from the request they repeat (in flight or answered within dedup_window) instead of an upstream, by group.",
	}, []string{"group"})

	metricCacheAffinity = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_cache_affinity_total",
		Help: "Messages requests with a prompt prefix long enough to cache, by group and prompt-cache affinity result: warm (sent to the channel whose cache holds the prefix), cold (no channel is known to hold it), moved (the channel that holds it was not a live channel of the best tier; the prefix follows the channel that serves it).",
	}, []string{"group", "result"})

	metricCacheMissUSD = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_cache_miss_usd_total",
		Help: "What the prompt-cache writes of requests not served warm cost beyond reading the same tokens from a warm cache, in US dollars, by group and reason: failover (the warm channel failed and another answered), cold, moved.",
	}, []string{"group", "reason"})

	metricCache = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_cache_total",
		Help: "Messages requests of groups with a response cache, by group and result: hit (a fresh answer, or an identical miss in flight), stale (a stale answer while one request revalidates it), miss, bypass (the client sent cache-control: no-cache).",
	}, []string{"group", "result"})

	metricSavedTokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_saved_tokens_total",
		Help: "Tokens (input, output, cache read and cache write) of the answers given from the response cache or to attached retries, which no upstream was paid for again, by group.",
	}, []string{"group"})

	metricSavedUSD = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_saved_usd_total",
		Help: "What those answers would have cost, in US dollars at the price of the answer they repeat, by group.",
	}, []string{"group"})

	metricDropped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_dropped_events_total",
		Help: "Upstream SSE events dropped because their data was not JSON, by channel.",
	}, []string{"channel"})

	metricRateLimited = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_rate_limited_total",
		Help: "Requests refused by a limit, by key name and scope (rate, tokens, concurrency, queue).",
	}, []string{"key", "scope"})

	metricSessionRefusals = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_session_refusals_total",
		Help: "Requests of agent sessions refused by their session's limits, by group and reason (budget: session_budget, rate: session_rate, loop: loop_guard).",
	}, []string{"group", "reason"})

	metricQueueWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "relay_queue_wait_seconds",
		Help:    "Time requests waited in their group's queue for a busy channel, by group and priority class.",
		Buckets: []float64{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300},
	}, []string{"group", "priority"})

	metricQueueDepth = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "relay_queue_depth",
		Help: "Requests waiting in a group's queue, by group and priority class.",
	}, []string{"group", "priority"})

	metricFallbacks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_model_fallbacks_total",
		Help: "Requests served by a fallback model because no channel of the requested one was live, by group, requested model and fallback.",
	}, []string{"group", "from", "to"})

	metricDegraded = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_degraded_total",
		Help: "Messages served more cheaply because the tightest budget that applies to them neared its end (budget_degrade), by group and mode: cheaper (the channels of the lowest price_factor in the live tier), model (another model served instead). A message both steps reach counts once in each.",
	}, []string{"group", "mode"})

	metricCapabilityMisses = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_capability_misses_total",
		Help: "Attempts a channel's upstream refused for a feature its wire does not support (the relay failed over and set the feature aside on the channel), by channel and feature (a name of the feature table, or other).",
	}, []string{"channel", "feature"})

	metricThinkingStripped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_thinking_stripped_total",
		Help: "Attempts sent to a channel of another signature domain than the one that signed the request's thinking blocks, those blocks removed (a group with thinking_failover strip), by group.",
	}, []string{"group"})

	metricResources = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_resource_requests_total",
		Help: "Successful calls of the Message Batches and Files APIs, by group, the channel that holds the item (none for a list, which asks them all), resource (batches, files) and operation (create, list, get, delete, cancel, results, content). Files cost nothing; this is how they are counted.",
	}, []string{"group", "channel", "resource", "op"})

	metricBatchResultsAccounted = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "relay_batch_results_accounted_total",
		Help: "Batches whose results were accounted (tokens, cost at the batch price, the key's spend and token limit), by group and channel: once per batch, at its first read.",
	}, []string{"group", "channel"})

	metricStates = stateCollector{
		state: prometheus.NewDesc("relay_channel_state",
			"1 for the state each channel is in (healthy, cooldown, open, half_open, disabled), 0 for the others.", []string{"channel", "state"}, nil),
		inflight: prometheus.NewDesc("relay_inflight",
			"Attempts in flight, by channel.", []string{"channel"}, nil),
		live: prometheus.NewDesc("relay_group_live_channels",
			"Channels of a group that can take a request now; 0 means the group is down.", []string{"group"}, nil),
		classCooling: prometheus.NewDesc("relay_channel_class_cooling",
			"Seconds left of the cooldown of a model class on a channel (a 429, a 529 or a spent anthropic-ratelimit-* quota for one of its models), 0 when it does not cool; class is a class the config or the price list names, or other.", []string{"channel", "class"}, nil),
	}
)

var collectors = []prometheus.Collector{
	metricRequests, metricDuration, metricFirstByte, metricAttempts, metricFailovers,
	metricTokens, metricCost, metricWasted, metricIncomplete, metricEstimated, metricDropped, metricStates,
	metricRateLimited, metricSessionRefusals, metricQueueWait, metricQueueDepth, metricFallbacks, money.SpendCollector,
	metricCapabilityMisses, metricThinkingStripped, metricDegraded,
	metricDedup, metricCache, metricSavedTokens, metricSavedUSD,
	metricResources, metricBatchResultsAccounted,
	metricCacheAffinity, metricCacheMissUSD, metricUnpriced,
}

// ledgerCollectors are registered only by a config with a ledger.
var ledgerCollectors = ledger.Collectors()

// registerMetrics registers the relay's collectors in a config's registry.
func registerMetrics(reg prometheus.Registerer) error { return register(reg, collectors) }

// register registers cs in reg, once: a registry that has them already
// (another relay handler of the same config) is fine.
func register(reg prometheus.Registerer, cs []prometheus.Collector) error {
	if reg == nil {
		return nil
	}
	for _, c := range cs {
		var dup prometheus.AlreadyRegisteredError
		if err := reg.Register(c); err != nil && !errors.As(err, &dup) {
			return err
		}
	}
	return nil
}

// stateCollector reads the channels' live state when scraped, so the
// gauges are never stale and need no bookkeeping on the request path.
type stateCollector struct {
	state, inflight, live, classCooling *prometheus.Desc
}

var allStates = [...]string{stateHealthy, stateCooldown, stateOpen, stateHalfOpen, stateDisabled}

// Describe implements prometheus.Collector.
func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.state
	ch <- c.inflight
	ch <- c.live
	ch <- c.classCooling
}

// Collect implements prometheus.Collector.
func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	now := time.Now()
	live := map[string]int{}
	channelStates.Range(func(k, v any) bool {
		name, h := k.(string), v.(*channelHealth)
		cur := h.State(now)
		for _, s := range allStates {
			val := 0.0
			if s == cur {
				val = 1
			}
			ch <- prometheus.MustNewConstMetric(c.state, prometheus.GaugeValue, val, name, s)
		}
		ch <- prometheus.MustNewConstMetric(c.inflight, prometheus.GaugeValue, float64(h.limits.Inflight()), name)
		for class, left := range classCooling(h, now) {
			ch <- prometheus.MustNewConstMetric(c.classCooling, prometheus.GaugeValue, left, name, class)
		}
		ok, _ := h.Available(now)
		for _, g := range h.groups() {
			if _, seen := live[g]; !seen {
				live[g] = 0
			}
			if ok {
				live[g]++
			}
		}
		return true
	})
	for g, n := range live {
		ch <- prometheus.MustNewConstMetric(c.live, prometheus.GaugeValue, float64(n), g)
	}
}

// classCooling is the seconds left of each model class's cooldown on the
// channel, by label: every class its configs can name (0 when it does not
// cool), and other for a class cooling that they do not name (one another
// node of a fleet published), so the labels stay the config's.
func classCooling(h *channelHealth, now time.Time) map[string]float64 {
	labels := h.classLabels()
	out := make(map[string]float64, len(labels))
	for _, c := range labels {
		out[c] = 0
	}
	for class, c := range h.CoolingClasses(now) {
		if _, named := out[class]; !named {
			class = classOther
		}
		out[class] = max(out[class], time.Duration(c.Until-now.UnixNano()).Seconds())
	}
	return out
}
