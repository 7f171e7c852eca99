package money

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// spendCollector exports the accounts at each scrape: every key's and
// group's spend in the current month, a capped channel's in each period
// it caps, and for an account with budgets (or caps), its spend, budget
// and warning threshold in each budgeted period. The scope label says
// whose: key (keys and named user entries, by key), group (by group) or
// channel (by channel); the labels of the other scopes are empty.
type spendCollector struct {
	spend, budget, warn *prometheus.Desc
}

// spendLabels are the labels of every spend metric.
var spendLabels = []string{"scope", "key", "group", "channel", "period"}

// SpendCollector is the collector of the spend metrics.
var SpendCollector = spendCollector{
	spend: prometheus.NewDesc("relay_spend_usd",
		"What a key, a group or a capped channel spent in the current calendar period (UTC), or in total, in USD: month for every key and group, and each period it has a budget (a channel: a spend_cap) for.", spendLabels, nil),
	budget: prometheus.NewDesc("relay_budget_usd",
		"A key's or a group's budget, or a channel's spend_cap, for a period, in USD.", spendLabels, nil),
	warn: prometheus.NewDesc("relay_budget_warn_usd",
		"The spend at which a budget warns (budget times budget_warn), in USD.", spendLabels, nil),
}

// Describe implements prometheus.Collector.
func (c spendCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.spend
	ch <- c.budget
	ch <- c.warn
}

// Collect implements prometheus.Collector.
func (c spendCollector) Collect(ch chan<- prometheus.Metric) {
	spendAccounts.Range(func(_, v any) bool {
		a := v.(*Account)
		if a.perIdentity.Load() {
			return true
		}
		a.mu.Lock()
		label, warn, scope := a.label, a.warn, a.scope
		a.mu.Unlock()
		if scope == OfSession {
			return true
		}
		usd, caps := a.Spent(time.Time{})
		names := [3]string{}
		names[scope] = label
		for p := range NumPeriods {
			labels := []string{scope.String(), names[OfKey], names[OfGroup], names[OfChannel], p.String()}
			if caps[p] > 0 {
				ch <- prometheus.MustNewConstMetric(c.budget, prometheus.GaugeValue, caps[p], labels...)
				ch <- prometheus.MustNewConstMetric(c.warn, prometheus.GaugeValue, caps[p]*warn, labels...)
			}
			if caps[p] > 0 || p == PeriodMonth && scope != OfChannel {
				ch <- prometheus.MustNewConstMetric(c.spend, prometheus.GaugeValue, usd[p], labels...)
			}
		}
		return true
	})
}
