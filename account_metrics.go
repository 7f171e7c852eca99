package relay

import (
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// servedMetrics are the children of the metrics that a successful answer
// of a channel updates, for one group, requested model and served model:
// a request's account updates seven series, and finding each by its label
// values (hashing them, then a locked map lookup in the vector) cost more
// than the updates. A channel keeps them, found once.
type servedMetrics struct {
	requests prometheus.Counter    // relay_requests_total, code 200, cause ok
	duration prometheus.Observer   // relay_request_duration_seconds
	tokens   [4]prometheus.Counter // relay_tokens_total: input, output, cache_read, cache_write

	// relay_cost_usd_total, found when first counted: an unpriced model's
	// answers have no cost series
	costOnce sync.Once
	cost     prometheus.Counter
}

// costOf returns the cost child, found on its first use.
func (s *servedMetrics) costOf(group, channel, served string) prometheus.Counter {
	s.costOnce.Do(func() { s.cost = metricCost.WithLabelValues(group, channel, served) })
	return s.cost
}

// tokenKinds are the type labels of servedMetrics.tokens, in order.
var tokenKinds = [4]string{"input", "output", "cache_read", "cache_write"}

// servedKey is what servedMetrics are kept by on a channel: label values,
// bounded by the config (modelLabel).
type servedKey struct{ group, model, served string }

// maxServed bounds the servedMetrics a channel keeps; past it, a request
// finds its children by their labels, as before.
const maxServed = 1024

// attemptMetrics are the children of a channel's per-attempt metrics that
// every successful attempt updates.
type attemptMetrics struct {
	success   prometheus.Counter  // relay_attempts_total, outcome success
	firstByte prometheus.Observer // relay_first_byte_seconds
}

// channelMetrics is what a channel keeps of the above. Its maps are
// replaced, never changed, so a lookup takes no lock.
type channelMetrics struct {
	mu       sync.Mutex
	served   atomic.Pointer[map[servedKey]*servedMetrics]
	attempts atomic.Pointer[attemptMetrics]
}

// servedFor returns the children for k, found on the first request that
// needs them (a series appears when it is first counted, as it did when
// each request looked it up).
func (c *channelMetrics) servedFor(channel string, k servedKey) *servedMetrics {
	if m := c.served.Load(); m != nil {
		if s := (*m)[k]; s != nil {
			return s
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.served.Load()
	if old != nil {
		if s := (*old)[k]; s != nil {
			return s
		}
	}
	s := &servedMetrics{
		requests: metricRequests.WithLabelValues(k.group, channel, k.model, "200", causeOK),
		duration: metricDuration.WithLabelValues(k.group, k.model),
	}
	for i, kind := range tokenKinds {
		s.tokens[i] = metricTokens.WithLabelValues(k.group, channel, k.served, kind)
	}
	if old != nil && len(*old) >= maxServed {
		return s
	}
	next := make(map[servedKey]*servedMetrics, 1+len(mapOrEmpty(old)))
	for key, v := range mapOrEmpty(old) {
		next[key] = v
	}
	next[k] = s
	c.served.Store(&next)
	return s
}

func mapOrEmpty(m *map[servedKey]*servedMetrics) map[servedKey]*servedMetrics {
	if m == nil {
		return nil
	}
	return *m
}

// attempted returns the channel's attemptMetrics, found on first use.
func (c *channelMetrics) attempted(channel string) *attemptMetrics {
	if a := c.attempts.Load(); a != nil {
		return a
	}
	a := &attemptMetrics{
		success:   metricAttempts.WithLabelValues(channel, outcomeSuccess.String()),
		firstByte: metricFirstByte.WithLabelValues(channel),
	}
	c.attempts.CompareAndSwap(nil, a)
	return c.attempts.Load()
}
