package relay

import (
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/suggest"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// groupOptions are a group's options that its switch reads, besides its
// Options.
var groupOptions = []string{"retries", "expose_channel", "retry_budget", "split", "fallback", "cache_affinity", "cache", "budget_degrade", "max_wait"}

// parseGroup parses `group <name> { ... }`.
func parseGroup(d *caddyfile.Dispenser, pos positions) (*Group, error) {
	g := new(Group)
	if !d.Args(&g.Name) {
		return nil, d.Errf("group takes a name: group <name> { ... }")
	}
	pos["group "+g.Name] = d.Token()
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	opts := provider.Options{
		Strings:   map[string]*string{"policy": &g.Policy, "thinking_failover": &g.ThinkingFailover, "session_budget": &g.SessionBudget, "session_rate": &g.SessionRate},
		Lists:     map[string]*[]string{"channels": &g.Channels, "budget": &g.Budgets},
		Ints:      map[string]*int{"max_queue": &g.MaxQueue, "loop_guard": &g.LoopGuard},
		Ratios:    map[string]*float64{"budget_warn": &g.BudgetWarn},
		Durations: map[string]*caddy.Duration{"wait_for_recovery": &g.WaitForRecovery},
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		pos.line(d, "group", g.Name)
		if ok, err := opts.Parse(d); err != nil {
			return nil, err
		} else if ok {
			continue
		}
		switch d.Val() {
		case "retries":
			var n int
			if err := parseInt(d, &n); err != nil {
				return nil, err
			}
			g.Retries = &n
		case "expose_channel":
			if d.NextArg() {
				return nil, d.ArgErr()
			}
			g.ExposeChannel = true
		case "retry_budget":
			args := d.RemainingArgs()
			if len(args) < 1 || len(args) > 2 {
				return nil, d.Errf("retry_budget takes a ratio and an optional floor: retry_budget 20%% [10/s]")
			}
			f, err := provider.Ratio(args[0])
			if err != nil {
				return nil, d.Errf("retry_budget: %v", err)
			}
			g.RetryBudget = &f
			if len(args) == 2 {
				floor, err := strconv.ParseFloat(strings.TrimSuffix(args[1], "/s"), 64)
				if err != nil {
					return nil, d.Errf("retry_budget: floor %q is not a rate such as 10/s", args[1])
				}
				g.RetryBudgetFloor = &floor
			}
		case "split":
			var name, share string
			if !d.AllArgs(&name, &share) {
				return nil, d.Errf("split takes a channel and a share: split canary 10%%")
			}
			f, err := provider.Ratio(share)
			if err != nil {
				return nil, d.Errf("split: %v", err)
			}
			if g.Splits == nil {
				g.Splits = map[string]float64{}
			}
			g.Splits[name] = f
		case "fallback":
			args := d.RemainingArgs()
			if len(args) < 2 {
				return nil, d.Errf("fallback takes a model and the models that may serve it: fallback claude-opus-4-1 claude-sonnet-4-5")
			}
			if g.Fallbacks == nil {
				g.Fallbacks = map[string][]string{}
			}
			g.Fallbacks[args[0]] = append(g.Fallbacks[args[0]], args[1:]...)
		case "cache_affinity":
			var v string
			if !d.Args(&v) || d.NextArg() || (v != "on" && v != "off") {
				return nil, d.Errf("cache_affinity takes on or off: cache_affinity off")
			}
			on := v == "on"
			g.CacheAffinity = &on
		case "cache":
			if g.Cache != nil {
				return nil, d.Err("cache is given twice")
			}
			c, err := parseCache(d)
			if err != nil {
				return nil, err
			}
			g.Cache = c
		case "budget_degrade":
			step, err := parseBudgetDegrade(d)
			if err != nil {
				return nil, err
			}
			g.BudgetDegrade = append(g.BudgetDegrade, step)
		case "max_wait":
			var class, dur string
			if !d.AllArgs(&class, &dur) {
				return nil, d.Errf("max_wait takes a class and a duration: max_wait batch 5m")
			}
			v, err := caddy.ParseDuration(dur)
			if err != nil {
				return nil, d.Errf("max_wait: %v", err)
			}
			if g.MaxWait == nil {
				g.MaxWait = map[string]caddy.Duration{}
			}
			g.MaxWait[class] = caddy.Duration(v)
		default:
			return nil, d.Errf("unrecognized group option %q%s", d.Val(), suggest.DidYouMean(d.Val(), optionNames(opts), groupOptions))
		}
	}
	return g, nil
}

// parseCache parses a group's cache block: cache { ttl; stale; max_size }.
func parseCache(d *caddyfile.Dispenser) (*ResponseCache, error) {
	c := new(ResponseCache)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		var err error
		switch d.Val() {
		case "ttl":
			err = parseDuration(d, &c.TTL)
		case "stale":
			err = parseDuration(d, &c.Stale)
		case "max_size":
			err = parseSize(d, &c.MaxSize)
		default:
			return nil, d.Errf("unrecognized cache option %q: ttl, stale or max_size", d.Val())
		}
		if err != nil {
			return nil, err
		}
		if c.TTL < 0 || c.Stale < 0 {
			return nil, d.Errf("cache: %s is negative", d.Val())
		}
	}
	return c, nil
}
