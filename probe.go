package relay

import (
	"context"
	"io"
	"net/http"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// probe is a channel's resolved `probe` block: the request that tells
// whether the upstream has recovered.
type probe struct {
	interval time.Duration
	route    route
	body     []byte
	model    string
}

const (
	defaultProbeInterval = 10 * time.Second
	defaultProbeModel    = "claude-haiku-4-5"
)

func newProbe(cfg *Channel) *probe {
	p := &probe{interval: time.Duration(cfg.Probe.Interval), route: routeCountTokens, model: defaultProbeModel}
	if p.interval <= 0 {
		p.interval = defaultProbeInterval
	}
	if cfg.Probe.Path != "" {
		p.route = routeByPath(cfg.Probe.Path)
	}
	if models := channelModels(cfg); len(models) > 0 {
		p.model = models[0]
	}
	p.body = []byte(cfg.Probe.Body)
	if len(p.body) == 0 {
		p.body = defaultProbeBody(p.route, p.model)
	}
	return p
}

// defaultProbeBody is a one-word request for model on route: a message
// takes max_tokens, which count_tokens refuses as an unknown field.
func defaultProbeBody(rt route, model string) []byte {
	if rt == routeCountTokens {
		return []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"ping"}]}`)
	}
	return []byte(`{"model":"` + model + `","max_tokens":1,"messages":[{"role":"user","content":"ping"}]}`)
}

// runProbes probes ch every interval while it is cooling down or its
// breaker is open (not while only a model class cools: its upstream said
// when that class's limit comes back), until ctx (the config's) ends. A probe that succeeds puts
// the channel back into rotation at once; one that fails changes nothing.
// Probes go through the channel's provider and transport like client
// requests, but count in none of the channel's counters.
func (r *Relay) runProbes(ctx caddy.Context, ch *channel) {
	fleet.Every(ctx, ch.probe.interval, nil, func() {
		switch ch.health.channelState(r.now()) {
		case stateCooldown, stateOpen:
			if r.probeOnce(ctx, ch) {
				ch.health.reset()
				ch.health.announce(healthChange{Kind: changeReset})
				r.logger.Info("probe succeeded; channel back in rotation", zap.String("channel", ch.name))
			}
		}
	})
}

// probeOnce sends one probe and reports whether the upstream answered 2xx.
func (r *Relay) probeOnce(ctx context.Context, ch *channel) bool {
	ctx, cancel := context.WithTimeout(ctx, ch.firstByte)
	defer cancel()
	// a transport whose tls_server_name has a placeholder needs a replacer,
	// as every client request has
	ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, caddy.NewReplacer())
	in := &inbound{route: ch.probe.route, ask: asked{body: ch.probe.body, model: ch.probe.model, header: probeHeader}}
	if err := in.inspect(); err != nil {
		return false
	}
	req, err := ch.provider.NewRequest(ctx, in.callFor(ch))
	if err != nil {
		return false
	}
	resp, err := ch.rt.RoundTrip(req)
	if err != nil {
		r.logger.Debug("probe failed", zap.String("channel", ch.name), zap.Error(err))
		return false
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, maxErrorBody))
	return resp.StatusCode >= 200 && resp.StatusCode < 300
}

var probeHeader = http.Header{"Anthropic-Version": {provider.AnthropicVersion}, "Content-Type": {"application/json"}}
