package relay

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/suggest"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("relay", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("relay", httpcaddyfile.Before, "reverse_proxy")
}

// Typos. An unrecognized Caddyfile option close to a known one (a letter
// missing, added, changed, or two swapped) gets a "did you mean" in its
// error (internal/suggest). The relay's, a channel's and a group's lists
// name the options their switches read, besides those of their
// provider.Options.

// relayOptions are the relay block's own options, besides the tuning ones
// (tuningOptions) that its channels share.
var relayOptions = []string{"max_body_size", "max_response_size", "max_upload_size", "decode_memory", "resource_secret",
	"read_body_timeout", "upstream_ratelimit_headers", "dedup_window", "dedup_grace", "settle_grace", "hold_floor",
	"key", "keys_file", "identity", "user", "channel", "group", "pricing", "ledger", "ledger_retention", "storage"}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	r := new(Relay)
	h.Next()
	at := h.File() + ":" + strconv.Itoa(h.Line())
	h.Reset()
	if err := r.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return r, declareInCaddyfile(h.State, r, "the relay block at "+at)
}

// declareInCaddyfile checks, while a Caddyfile is adapted, that the relay
// blocks of its sites declare the names they share the same way (see
// declarations.go), so `caddy adapt` names both blocks' lines.
func declareInCaddyfile(state map[string]any, r *Relay, by string) error {
	seen, _ := state["relay.declarations"].(map[string]declaration)
	if seen == nil {
		seen = map[string]declaration{}
		state["relay.declarations"] = seen
	}
	own, err := r.declared(by)
	if err != nil {
		return err
	}
	for name, d := range own {
		if err := conflict(name, seen[name], d); err != nil {
			return err
		}
	}
	for name, d := range own {
		seen[name] = d
	}
	return nil
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	relay [<matcher>] {
//		max_body_size         <size>
//		max_response_size     <size>
//		max_upload_size       <size>
//		decode_memory         <size>
//		resource_secret       <secret|{env.NAME}|{file./path}>
//		read_body_timeout     <duration>
//		upstream_ratelimit_headers replace|pass
//		dedup_window          <duration>
//		dedup_grace           <duration>
//		settle_grace          <duration>
//		hold_floor            <usd>
//		first_byte_timeout    <duration>
//		first_content_timeout <duration>
//		response_timeout      <duration>
//		stream_idle_timeout   <duration>
//		cooldown              <duration>
//		max_cooldown          <duration>
//		auth_cooldown         <duration>
//		capability_ttl        <duration>
//		breaker {
//			window           <duration>
//			failure_ratio    <0..1|percent>
//			min_requests     <n>
//			open_for         <duration>
//			half_open_probes <n>
//		}
//
//		key <secret|sha256:hex|{env.NAME}|{file./path}> <group> {
//			name        <name>
//			priority    realtime|normal|batch
//			rate        <n>/<period>
//			tokens      <n>/<period>
//			concurrency <n>
//			budget      <usd>usd/day|week|month|total
//			budget_warn <0..1|percent>
//			budget_degrade <percent> cheaper|model <model>
//			expires     <RFC 3339 time>
//			disabled
//			user_rate   <n>/<period>
//			user_tokens <n>/<period>
//			session_budget <usd>usd/<duration>
//			session_rate   <n>/<period>
//			loop_guard     <n>
//		}
//		keys_file <path>
//
//		identity <placeholder>
//		user <id>|* <group> {
//			<the options of a key>
//		}
//
//		channel <name> {
//			provider  anthropic|bedrock|vertex|openai|mock|<another registered provider> [{
//				<the provider's options>
//			}]
//			# the provider's options may also stand on the channel's own
//			# lines: every line the channel does not know goes to its
//			# provider (see each provider's UnmarshalCaddyfile), such as
//			# anthropic's url, api_key and auth
//			models    <name>[=<upstream name>]...
//			priority  <n>
//			weight    <n>
//			allow     service_tier|inference_geo|speed...
//			rate        <n>/<period>
//			tokens      <n>/<period>
//			concurrency <n>
//			price_factor <factor>
//			spend_cap    <amount>usd/day|week|month|total
//			signature_domain <name>
//			transport http {
//				<reverse_proxy's http transport options>
//			}
//			probe {
//				interval <duration>
//				path     /v1/messages/count_tokens|/v1/messages
//				body     <json>
//			}
//			# any of the timeouts, cooldowns and the breaker block above,
//			# for this channel only
//		}
//
//		ledger [sqlite [<path>]]
//		ledger postgres {
//			dsn <dsn|{env.NAME}>
//		}
//		ledger_retention <duration>
//
//		pricing {
//			<model> input <usd> output <usd> [cache_read <usd>] [cache_write <usd>] [cache_write_1h <usd>] [batch <factor>] [web_search <usd per 1000>] [display_name "<name>"] [above <tokens> input <usd> ...]
//		}
//
//		group <name> {
//			channels <channel>...
//			retries  <n>
//			retry_budget <ratio|percent> [<floor>/s]
//			wait_for_recovery <duration>
//			max_queue <n>
//			max_wait  realtime|normal|batch <duration>
//			policy    weighted|adaptive|sticky
//			cache_affinity on|off
//			split     <channel> <share|percent>
//			fallback  <model> <fallback model>...
//			expose_channel
//			budget      <amount>usd/day|week|month|total
//			budget_warn <ratio|percent>
//			thinking_failover strip
//			session_budget <usd>usd/<duration>
//			session_rate   <n>/<period>
//			loop_guard     <n>
//			budget_degrade <percent> cheaper|model <model>
//			cache {
//				ttl      <duration>
//				stale    <duration>
//				max_size <size>
//			}
//		}
//	}
//
// A literal key secret is stored as its sha256 so that the adapted JSON
// config never holds it.
func (r *Relay) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	pos := positions{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		pos.line(d)
		opt := d.Val()
		ok, err := parseTuning(d, &r.Tuning)
		if err != nil {
			return err
		}
		if ok {
			continue
		}
		switch opt {
		case "max_body_size":
			if err := parseSize(d, &r.MaxBodySize); err != nil {
				return err
			}
		case "max_response_size":
			if err := parseSize(d, &r.MaxResponseSize); err != nil {
				return err
			}
		case "max_upload_size":
			if err := parseSize(d, &r.MaxUploadSize); err != nil {
				return err
			}
		case "decode_memory":
			if err := parseSize(d, &r.DecodeMemory); err != nil {
				return err
			}
		case "resource_secret":
			if !d.AllArgs(&r.ResourceSecret) {
				return d.ArgErr()
			}
		case "read_body_timeout":
			if err := parseDuration(d, &r.ReadBodyTimeout); err != nil {
				return err
			}
		case "upstream_ratelimit_headers":
			if !d.AllArgs(&r.UpstreamRatelimitHeaders) {
				return d.ArgErr()
			}
		case "dedup_window":
			var w caddy.Duration
			if err := parseDuration(d, &w); err != nil {
				return err
			}
			if w < 0 {
				return d.Errf("dedup_window: %s is negative (0 turns dedup off)", time.Duration(w))
			}
			r.DedupWindow = &w
		case "dedup_grace":
			if err := parseDuration(d, &r.DedupGrace); err != nil {
				return err
			}
			if r.DedupGrace < 0 {
				return d.Errf("dedup_grace: %s is negative", time.Duration(r.DedupGrace))
			}
		case "settle_grace":
			var g caddy.Duration
			if err := parseDuration(d, &g); err != nil {
				return err
			}
			if g < 0 {
				return d.Errf("settle_grace: %s is negative (0: do not read on after a client left)", time.Duration(g))
			}
			r.SettleGrace = &g
		case "hold_floor":
			if !d.NextArg() {
				return d.ArgErr()
			}
			v, err := strconv.ParseFloat(strings.TrimSuffix(strings.ToLower(d.Val()), "usd"), 64)
			if err != nil || v < 0 || math.IsInf(v, 0) || math.IsNaN(v) {
				return d.Errf("hold_floor: %q is not an amount in US dollars, such as 0.50 or 2usd", d.Val())
			}
			r.HoldFloor = &v
		case "key":
			at := []string{"key", "#" + strconv.Itoa(len(r.Keys)+1)}
			pos.line(d, at...)
			k, err := parseKey(d, pos, at)
			if err != nil {
				return err
			}
			r.Keys = append(r.Keys, k)
		case "keys_file":
			if r.KeysFile != "" {
				return d.Err("keys_file is given twice")
			}
			if !d.AllArgs(&r.KeysFile) {
				return d.ArgErr()
			}
		case "identity":
			if r.Identity != "" {
				return d.Err("identity is given twice")
			}
			if !d.AllArgs(&r.Identity) {
				return d.ArgErr()
			}
		case "user":
			at := []string{"user", "#" + strconv.Itoa(len(r.Users)+1)}
			pos.line(d, at...)
			u, err := parseUser(d, pos, at)
			if err != nil {
				return err
			}
			r.Users = append(r.Users, u)
		case "channel":
			ch, err := parseChannel(d, pos)
			if err != nil {
				return err
			}
			r.Channels = append(r.Channels, ch)
		case "group":
			g, err := parseGroup(d, pos)
			if err != nil {
				return err
			}
			r.Groups = append(r.Groups, g)
		case "pricing":
			if err := parsePricing(d, r); err != nil {
				return err
			}
		case "ledger":
			l, err := ledger.ParseCaddyfile(d, r.Ledger)
			if err != nil {
				return err
			}
			r.Ledger = l
		case "ledger_retention":
			l, err := ledger.ParseRetentionCaddyfile(d, r.Ledger)
			if err != nil {
				return err
			}
			r.Ledger = l
		case "storage":
			if r.Fleet != nil {
				return d.Err("storage is given twice")
			}
			rs, err := fleet.ParseCaddyfile(d)
			if err != nil {
				return err
			}
			r.Fleet = &Fleet{Redis: rs}
		default:
			return d.Errf("unrecognized relay option %q%s", opt, suggest.DidYouMean(opt, relayOptions, tuningNames()))
		}
	}
	if err := r.validateConfig(); err != nil {
		return pos.errf(d, err)
	}
	return nil
}

// positions records where a Caddyfile said things, by locators such as
// "group g channels x" (see configError), so that an error found once the
// whole block is read points at the line that caused it.
type positions map[string]caddyfile.Token

// line records the line under d's cursor under the locator at: the line as
// at, or as at + its first token when at is not the line's own, and each
// argument as that + the argument. The cursor stays where it is.
func (p positions) line(d *caddyfile.Dispenser, at ...string) {
	base := strings.Join(append(at, d.Val()), " ")
	if len(at) > 0 && at[0] == d.Val() {
		base = strings.Join(at, " ") // a block's own line: key, channel, group
	}
	p[base] = d.Token()
	steps := 0
	for d.NextArg() {
		steps++
		if d.Val() == "{" {
			break
		}
		p[base+" "+d.Val()] = d.Token()
	}
	for ; steps > 0; steps-- {
		d.Prev()
	}
}

// errf reports a config error at the line of the most precise locator
// recorded for it, else where d is.
func (p positions) errf(d *caddyfile.Dispenser, err error) error {
	var ce *configError
	if errors.As(err, &ce) {
		for n := len(ce.at); n > 0; n-- {
			if tok, ok := p[strings.Join(ce.at[:n], " ")]; ok {
				at := caddyfile.NewDispenser([]caddyfile.Token{tok})
				at.Next()
				return at.Errf("relay: %v", err)
			}
		}
	}
	return d.Errf("relay: %v", err)
}

// parseSize parses an option's one argument as a size in bytes (32MiB).
func parseSize(d *caddyfile.Dispenser, dst *int64) error {
	return provider.ParseArg(d, dst, func(v string) (int64, error) {
		size, err := humanize.ParseBytes(v)
		if err == nil && size > math.MaxInt64 {
			err = fmt.Errorf("%s is too large", v)
		}
		return int64(size), err
	})
}

// parseTuning parses a timeout or cooldown option, or a breaker block, at
// the dispenser, if the current token is one.
func parseTuning(d *caddyfile.Dispenser, t *Tuning) (bool, error) {
	if d.Val() == "breaker" {
		b, err := parseBreaker(d)
		t.Breaker = b
		return true, err
	}
	return tuningOptions(t).Parse(d)
}

// tuningOptions are the tuning options of t, but its breaker.
func tuningOptions(t *Tuning) provider.Options {
	return provider.Options{Durations: map[string]*caddy.Duration{
		"first_byte_timeout": &t.FirstByteTimeout, "first_content_timeout": &t.FirstContentTimeout,
		"response_timeout": &t.ResponseTimeout, "stream_idle_timeout": &t.StreamIdleTimeout,
		"cooldown": &t.Cooldown, "max_cooldown": &t.MaxCooldown, "auth_cooldown": &t.AuthCooldown,
		"capability_ttl": &t.CapabilityTTL,
	}}
}

// optionNames lists the options of o.
func optionNames(o provider.Options) []string {
	var out []string
	out = slices.AppendSeq(out, maps.Keys(o.Strings))
	out = slices.AppendSeq(out, maps.Keys(o.Lists))
	out = slices.AppendSeq(out, maps.Keys(o.Ints))
	out = slices.AppendSeq(out, maps.Keys(o.Durations))
	out = slices.AppendSeq(out, maps.Keys(o.Ratios))
	slices.Sort(out) // the same suggestion for a tie, every time
	return out
}

// tuningNames lists the tuning options of the relay and its channels.
func tuningNames() []string {
	return append(optionNames(tuningOptions(new(Tuning))), "breaker")
}

// parseBreaker parses a `breaker { ... }` block; unset fields keep their
// defaults.
func parseBreaker(d *caddyfile.Dispenser) (*Breaker, error) {
	b := new(Breaker)
	return b, parseBlock(d, "breaker", provider.Options{
		Durations: map[string]*caddy.Duration{"window": &b.Window, "open_for": &b.OpenFor},
		Ints:      map[string]*int{"min_requests": &b.MinRequests, "half_open_probes": &b.HalfOpenProbes},
		Ratios:    map[string]*float64{"failure_ratio": &b.FailureRatio},
	})
}

// parseBlock reads a block that takes no argument, whose lines are all
// options of o; what names the block in errors.
func parseBlock(d *caddyfile.Dispenser, what string, o provider.Options) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if ok, err := o.Parse(d); err != nil || !ok {
			return cmp.Or(err, d.Errf("unrecognized %s option %q%s", what, d.Val(), suggest.DidYouMean(d.Val(), optionNames(o))))
		}
	}
	return nil
}

// parsePricing parses a `pricing { ... }` block: one line per model,
//
//	<model> input <usd> output <usd> [cache_read <usd>] [cache_write <usd>] [cache_write_1h <usd>] [batch <factor>] [web_search <usd per 1000>] [display_name "<name>"] [above <tokens> input <usd> output <usd> ...]
//
// in US dollars per million tokens (batch: the fraction of them Message
// Batches cost, default 0.5; web_search: US dollars per 1,000 web
// searches, default 10); the pairs after `above` price the requests whose
// prompt is larger than that many tokens. display_name, anywhere on the
// line, is the model's name in GET /v1/models.
func parsePricing(d *caddyfile.Dispenser, r *Relay) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	if r.Pricing == nil {
		r.Pricing = map[string]Price{}
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		model := d.Val()
		args := d.RemainingArgs()
		var p Price
		cur := &p
		priced := false // the line gives input or output
		for i := 0; i < len(args); i += 2 {
			if i+1 >= len(args) {
				return d.Errf("pricing %s: %q needs a value", model, args[i])
			}
			name, val := args[i], args[i+1]
			if name == "display_name" {
				if val == "" || p.DisplayName != "" {
					return d.Errf("pricing %s: display_name takes a name, once", model)
				}
				p.DisplayName = val
				continue
			}
			if name == "above" {
				n, err := strconv.ParseInt(val, 10, 64)
				if err != nil || cur != &p {
					return d.Errf("pricing %s: above takes a number of tokens, once", model)
				}
				p.LongPrompt = &LongPromptPrice{Above: n}
				cur = &p.LongPrompt.Price
				continue
			}
			f, err := strconv.ParseFloat(val, 64)
			if err != nil {
				return d.Errf("pricing %s: %s: %q is not a price", model, name, val)
			}
			switch name {
			case "input":
				cur.Input, priced = f, true
			case "output":
				cur.Output, priced = f, true
			case "cache_read":
				cur.CacheRead = &f
			case "cache_write":
				cur.CacheWrite = &f
			case "cache_write_1h":
				cur.CacheWrite1h = &f
			case "batch":
				if cur != &p || f < 0 {
					return d.Errf("pricing %s: batch is a factor of the whole price, not negative, before above", model)
				}
				cur.Batch = &f
			case "web_search":
				if cur != &p || f < 0 {
					return d.Errf("pricing %s: web_search is the model's price per 1,000 searches, not negative, before above", model)
				}
				cur.WebSearch = &f
			default:
				return d.Errf("pricing %s: unknown price %q (input, output, cache_read, cache_write, cache_write_1h, batch, web_search, display_name, above)", model, name)
			}
		}
		if p.DisplayName != "" && !priced && money.Builtin(model) != nil {
			// the entry replaces the built-in row: renaming alone would
			// make the model free
			return d.Errf("pricing %s: an entry replaces the model's built-in prices: give its input and output with display_name", model)
		}
		if _, dup := r.Pricing[model]; dup {
			return d.Errf("pricing %s is given twice", model)
		}
		r.Pricing[model] = p
	}
	return nil
}

// parseDuration parses an option's one argument as a duration (90s, 1h).
func parseDuration(d *caddyfile.Dispenser, dst *caddy.Duration) error {
	return provider.ParseArg(d, dst, func(v string) (caddy.Duration, error) {
		dur, err := caddy.ParseDuration(v)
		return caddy.Duration(dur), err
	})
}

// parseInt parses an option's one argument as an integer.
func parseInt(d *caddyfile.Dispenser, dst *int) error {
	return provider.ParseArg(d, dst, func(v string) (int, error) {
		n, err := strconv.Atoi(v)
		if err != nil {
			return 0, fmt.Errorf("%q is not an integer", v)
		}
		return n, nil
	})
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Relay)(nil)
