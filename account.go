package relay

import (
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Label values for requests that never got that far (no key, no model, no
// channel), and for models no channel lists.
const (
	labelNone  = "none"
	labelOther = "other"
)

// account is the last step of every request: its cost, its metrics, the
// token placeholders and its one log line. It never sees a secret or a body.
func (r *Relay) account(in *inbound) {
	duration := time.Since(in.start)
	if in.end.status == 0 { // the client left before any answer
		in.end.clientLeft()
	}
	group, key, channel := labelNone, labelNone, labelNone
	if in.who.key != nil {
		group, key = in.who.key.group.name, in.who.key.name
	}
	if in.end.answered != nil {
		channel = in.end.answered.name
	}
	model, served := r.modelLabel(in.ask.model), r.modelLabel(in.grant.target)

	u := in.end.usage
	priced, tools := r.price(in)
	cost := in.end.cost
	r.settleHolds(in, cost)
	if in.grant.session != nil {
		r.sessionEnded(in, cost)
	}
	if in.end.estimated {
		r.estimated(in, group)
	}
	var sm *servedMetrics // a success's children, which its channel keeps
	if in.end.answered != nil && in.end.status == http.StatusOK && in.causeLabel() == causeOK {
		sm = in.end.answered.metrics.servedFor(channel, servedKey{group, model, served})
		sm.requests.Inc()
		in.tr.observe(sm.duration, duration.Seconds())
	} else {
		metricRequests.WithLabelValues(group, channel, model, statusLabel(in.end.status), in.causeLabel()).Inc()
		in.tr.observe(metricDuration.WithLabelValues(group, model), duration.Seconds())
	}
	if in.route == routeMessages && in.end.answered != nil {
		counts := [4]int64{u.input, u.output, u.cacheRead, u.cacheWrite} // in tokenKinds' order
		for i, n := range counts {
			if sm != nil {
				sm.tokens[i].Add(float64(n))
			} else {
				metricTokens.WithLabelValues(group, channel, served, tokenKinds[i]).Add(float64(n))
			}
		}
		if cost > 0 {
			if sm != nil {
				sm.costOf(group, channel, served).Add(cost)
			} else {
				metricCost.WithLabelValues(group, channel, served).Add(cost)
			}
		}
		if in.end.incomplete {
			metricIncomplete.WithLabelValues(group, model).Inc()
		}
	}

	r.settleAffinity(in)
	in.tr.end(in, priced)
	recordStatus(in, duration, cost)
	recordUsage(r.ledger, in, r.now(), duration, cost, tools)

	c := r.logger.Check(zap.InfoLevel, "relayed request")
	if c == nil {
		return
	}
	fp := logFields.Get().(*[]zap.Field)
	fields := append((*fp)[:0],
		zap.String("request_id", in.id),
		zap.String("key", key),
		zap.String("group", group),
		zap.String("model", in.ask.model),
		zap.Bool("stream", in.ask.stream),
		zap.Array("attempts", in.end.attemptsLog()),
		zap.Int("status", in.end.status),
		zap.Duration("first_byte", in.end.firstByte),
		zap.Duration("duration", duration),
		zap.Int64("input_tokens", u.input),
		zap.Int64("output_tokens", u.output),
		zap.Int64("cache_read_tokens", u.cacheRead),
		zap.Int64("cache_write_tokens", u.cacheWrite),
		zap.Bool("incomplete", in.end.incomplete),
	)
	if in.grant.target != in.ask.model {
		fields = append(fields, zap.String("served_model", in.grant.target))
	}
	if priced {
		fields = append(fields, zap.Float64("cost_usd", cost))
	}
	if in.end.shared != "" {
		fields = append(fields, zap.String("shared", in.end.shared))
	}
	if in.end.wasted > 0 {
		fields = append(fields, zap.Int64("wasted_tokens", in.end.wasted))
	}
	if in.end.estimated {
		fields = append(fields, zap.Bool("estimated", true))
	}
	if in.end.estimatedPrice {
		fields = append(fields, zap.Bool("estimated_price", true))
	}
	if in.tr != nil {
		fields = append(fields, zap.String("trace_id", in.tr.traceID))
	}
	c.Write(fields...)
	clear(fields) // a pooled slice keeps no strings alive
	*fp = fields[:0]
	logFields.Put(fp)
}

// logFields are the field slices of the log line: a core encodes a line's
// fields before Write returns and keeps none of them.
var logFields = sync.Pool{New: func() any {
	s := make([]zap.Field, 0, 20) // room for the optional fields too
	return &s
}}

// attemptChain is the log line's attempts: channel:outcome:duration for
// each attempt, written into the line as they are encoded.
type attemptChain []attemptRecord

func (c *attemptChain) MarshalLogArray(enc zapcore.ArrayEncoder) error {
	var b [128]byte
	for _, a := range *c {
		out := append(b[:0], a.channel...)
		out = append(out, ':')
		out = append(out, a.outcome.String()...)
		out = append(out, ':')
		out = append(out, a.duration.Round(time.Millisecond).String()...)
		enc.AppendByteString(out)
	}
	return nil
}

// price sets in.cost, what the request costs: the list price of the usage
// its client got (its tokens and its server tools), at the price of the
// model that served it, times the price factor of the channel that
// answered. It reports whether that model has a price, and the server
// tools' part of the cost.
//
// A model the price table does not know costs its estimate when a budget
// or a spend cap counts the request (unpriced.go), else nothing.
func (r *Relay) price(in *inbound) (priced bool, tools float64) {
	rates, estimated := r.ratesFor(in.grant.target, in.grant.counted) // what was served is what is billed
	if rates == nil {
		return false, 0
	}
	in.end.priced(0, false)
	if ch := in.end.charged(); ch != nil {
		cost := rates.Cost(in.end.usage.priced()) * ch.priceFactor
		tools = rates.ServerTools(in.end.usage.priced()) * ch.priceFactor
		in.end.priced(cost, estimated && cost > 0)
		if estimated && cost > 0 {
			r.unpriced(in, in.grant.target, cost)
		}
	}
	return true, tools
}

// Reasons of relay_wasted_tokens_total.
const (
	wasteFailover = "failover"
	wasteCanceled = "canceled"
)

// waste counts the input tokens of an abandoned attempt, which the
// upstream processed for nothing (see attemptResult.accepted).
func (in *inbound) waste(res attemptResult, reason string) {
	if res.wasted > 0 {
		metricWasted.WithLabelValues(res.channel.name, reason).Add(float64(res.wasted))
		in.end.wastedTokens(res.wasted)
	}
}

// placeholder answers the {http.relay.*} placeholders from what the
// request came to so far; nothing is computed unless a log format or a
// header asks.
func (in *inbound) placeholder(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, "http.relay.")
	if !ok || in.who.key == nil {
		return nil, false
	}
	switch name {
	case "key":
		return in.who.key.name, true
	case "group":
		return in.who.key.group.name, true
	case "model":
		return in.ask.model, in.ask.model != ""
	case "channel":
		if in.end.answered != nil {
			return in.end.answered.name, true
		}
	case "attempts":
		return in.end.attempts, true
	case "input_tokens":
		return in.end.usage.input, true
	case "output_tokens":
		return in.end.usage.output, true
	}
	return nil, false
}

// Causes of an answer, the cause label of relay_requests_total: the
// client's own doing (a bad request, an unknown model, a limit, leaving) is
// told from what an operator must look at, the upstreams and the relay.
const (
	causeOK       = "ok"
	causeClient   = "client"
	causeUpstream = "upstream"
	causeRelay    = "relay"
)

// causeLabel is why the request was answered as it was: as the one exit
// recorded for an answer that did not commit; else, for a committed one,
// as its last attempt ended.
func (in *inbound) causeLabel() string {
	if in.end.cause != "" {
		return in.end.cause
	}
	if in.end.status == statusClientClosed {
		return causeClient
	}
	if n := len(in.end.chain); n > 0 && in.end.answered != nil {
		switch in.end.chain[n-1].outcome {
		case outcomeSuccess:
			return causeOK
		case outcomeCanceled, outcomeClientError:
			return causeClient
		}
		return causeUpstream // a stream broken after the commit point
	}
	if in.end.status < 400 {
		return causeOK
	}
	return causeClient
}

// statusLabels holds the code label of every HTTP status, so counting a
// request formats nothing.
var statusLabels = func() (l [600]string) {
	for i := range l {
		l[i] = strconv.Itoa(i)
	}
	return l
}()

func statusLabel(code int) string {
	if code >= 0 && code < len(statusLabels) {
		return statusLabels[code]
	}
	return strconv.Itoa(code)
}

// statusClientClosed is what nginx and Caddy record for a client that
// closed its connection before the answer.
const statusClientClosed = 499

// modelLabel bounds the model label to the names the config lists.
func (r *Relay) modelLabel(model string) string {
	switch {
	case model == "":
		return labelNone
	case r.modelNames[model]:
		return model
	}
	return labelOther
}
