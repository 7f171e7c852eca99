package relay

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/dustin/go-humanize"
	"go.uber.org/zap"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("relay", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("relay", httpcaddyfile.Before, "reverse_proxy")
}

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
//		resource_secret       <secret|{env.NAME}|{file./path}>
//		read_body_timeout     <duration>
//		upstream_ratelimit_headers replace|pass
//		dedup_window          <duration>
//		dedup_grace           <duration>
//		settle_grace          <duration>
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
//			expires     <RFC 3339 time>
//			disabled
//			user_rate   <n>/<period>
//			user_tokens <n>/<period>
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
//		pricing {
//			<model> input <usd> output <usd> [cache_read <usd>] [cache_write <usd>] [cache_write_1h <usd>] [batch <factor>] [above <tokens> input <usd> ...]
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
//			split     <channel> <share|percent>
//			fallback  <model> <fallback model>...
//			expose_channel
//			budget      <amount>usd/day|week|month|total
//			budget_warn <ratio|percent>
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
		case "storage":
			if r.Storage != nil {
				return d.Err("storage is given twice")
			}
			s, err := parseStorage(d)
			if err != nil {
				return err
			}
			r.Storage = s
		default:
			return d.Errf("unrecognized relay option %q", opt)
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

// parseArg parses an option's one argument into dst with parse; errors
// name the option.
func parseArg[T any](d *caddyfile.Dispenser, dst *T, parse func(string) (T, error)) error {
	opt := d.Val()
	var v string
	if !d.AllArgs(&v) {
		return d.ArgErr()
	}
	x, err := parse(v)
	if err != nil {
		return d.Errf("%s: %v", opt, err)
	}
	*dst = x
	return nil
}

// parseSize parses an option's one argument as a size in bytes (32MiB).
func parseSize(d *caddyfile.Dispenser, dst *int64) error {
	return parseArg(d, dst, func(v string) (int64, error) {
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
	return options{durations: map[string]*caddy.Duration{
		"first_byte_timeout": &t.FirstByteTimeout, "first_content_timeout": &t.FirstContentTimeout,
		"response_timeout": &t.ResponseTimeout, "stream_idle_timeout": &t.StreamIdleTimeout,
		"cooldown": &t.Cooldown, "max_cooldown": &t.MaxCooldown, "auth_cooldown": &t.AuthCooldown,
		"capability_ttl": &t.CapabilityTTL,
	}}.parse(d)
}

// parseBreaker parses a `breaker { ... }` block; unset fields keep their
// defaults.
func parseBreaker(d *caddyfile.Dispenser) (*Breaker, error) {
	b := new(Breaker)
	return b, parseBlock(d, "breaker", options{
		durations: map[string]*caddy.Duration{"window": &b.Window, "open_for": &b.OpenFor},
		ints:      map[string]*int{"min_requests": &b.MinRequests, "half_open_probes": &b.HalfOpenProbes},
		ratios:    map[string]*float64{"failure_ratio": &b.FailureRatio},
	})
}

// parseBlock reads a block that takes no argument, whose lines are all
// options of o; what names the block in errors.
func parseBlock(d *caddyfile.Dispenser, what string, o options) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if ok, err := o.parse(d); err != nil || !ok {
			return cmp.Or(err, d.Errf("unrecognized %s option %q", what, d.Val()))
		}
	}
	return nil
}

// parsePricing parses a `pricing { ... }` block: one line per model,
//
//	<model> input <usd> output <usd> [cache_read <usd>] [cache_write <usd>] [cache_write_1h <usd>] [batch <factor>] [above <tokens> input <usd> output <usd> ...]
//
// in US dollars per million tokens (batch: the fraction of them Message
// Batches cost, default 0.5); the pairs after `above` price the
// requests whose prompt is larger than that many tokens.
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
		for i := 0; i < len(args); i += 2 {
			if i+1 >= len(args) {
				return d.Errf("pricing %s: %q needs a value", model, args[i])
			}
			name, val := args[i], args[i+1]
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
				cur.Input = f
			case "output":
				cur.Output = f
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
			default:
				return d.Errf("pricing %s: unknown price %q (input, output, cache_read, cache_write, cache_write_1h, batch, above)", model, name)
			}
		}
		if _, dup := r.Pricing[model]; dup {
			return d.Errf("pricing %s is given twice", model)
		}
		r.Pricing[model] = p
	}
	return nil
}

// parseStorage parses `storage redis { ... }`.
func parseStorage(d *caddyfile.Dispenser) (*Storage, error) {
	if !d.NextArg() {
		return nil, d.ArgErr()
	}
	if d.Val() != "redis" {
		return nil, d.Errf("storage %q is not known: the relay keeps shared state in redis", d.Val())
	}
	rs := new(RedisStorage)
	var lease, timeout caddy.Duration
	o := options{
		strings:   map[string]*string{"master_name": &rs.MasterName, "username": &rs.Username, "password": &rs.Password, "prefix": &rs.Prefix, "on_error": &rs.OnError},
		lists:     map[string]*[]string{"address": &rs.Address},
		ints:      map[string]*int{"db": &rs.DB},
		durations: map[string]*caddy.Duration{"timeout": &timeout, "lease": &lease},
	}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() == "tls" {
			t, err := parseStorageTLS(d)
			if err != nil {
				return nil, err
			}
			rs.TLS = t
			continue
		}
		if ok, err := o.parse(d); err != nil || !ok {
			return nil, cmp.Or(err, d.Errf("unrecognized storage redis option %q", d.Val()))
		}
	}
	rs.Timeout, rs.Lease = timeout, lease
	if err := rs.validate(); err != nil {
		return nil, d.Err(err.Error())
	}
	return &Storage{Redis: rs}, nil
}

// parseStorageTLS parses `tls`, alone or with a block of Caddy's TLS
// client options as reverse_proxy names them without their tls_ prefix:
// server_name, trust_pool, client_auth, insecure_skip_verify.
func parseStorageTLS(d *caddyfile.Dispenser) (*reverseproxy.TLSConfig, error) {
	t := new(reverseproxy.TLSConfig)
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "server_name":
			if !d.AllArgs(&t.ServerName) {
				return nil, d.ArgErr()
			}
		case "insecure_skip_verify":
			if d.NextArg() {
				return nil, d.ArgErr()
			}
			t.InsecureSkipVerify = true
		case "client_auth":
			if !d.AllArgs(&t.ClientCertificateFile, &t.ClientCertificateKeyFile) {
				return nil, d.Err("client_auth takes a certificate file and its key file")
			}
		case "trust_pool":
			if !d.NextArg() {
				return nil, d.ArgErr()
			}
			name := d.Val()
			mod, err := caddyfile.UnmarshalModule(d, "tls.ca_pool.source."+name)
			if err != nil {
				return nil, err
			}
			t.CARaw = caddyconfig.JSONModuleObject(mod, "provider", name, nil)
		default:
			return nil, d.Errf("unrecognized storage redis tls option %q (server_name, trust_pool, client_auth, insecure_skip_verify)", d.Val())
		}
	}
	return t, nil
}

// parseProbe parses a `probe { ... }` block.
func parseProbe(d *caddyfile.Dispenser) (*Probe, error) {
	p := new(Probe)
	return p, parseBlock(d, "probe", options{
		strings:   map[string]*string{"path": &p.Path, "body": &p.Body},
		durations: map[string]*caddy.Duration{"interval": &p.Interval},
	})
}

// parseRatio reads a fraction written as 0.2 or 20%.
func parseRatio(d *caddyfile.Dispenser, dst *float64) error { return parseArg(d, dst, ratio) }

func ratio(v string) (float64, error) {
	f, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a number or a percentage", v)
	}
	if strings.HasSuffix(v, "%") {
		f /= 100
	}
	if f < 0 || f > 1 {
		return 0, fmt.Errorf("%q is not between 0 and 1 (0%% and 100%%)", v)
	}
	return f, nil
}

// options maps the simple options of a block, those that take one value
// or a list, to the fields they set.
type options struct {
	strings   map[string]*string
	lists     map[string]*[]string // appended to: the option may repeat
	ints      map[string]*int
	durations map[string]*caddy.Duration
	ratios    map[string]*float64 // a fraction or a percentage
}

// has reports whether name is one of o's options.
func (o options) has(name string) bool {
	_, s := o.strings[name]
	_, l := o.lists[name]
	_, i := o.ints[name]
	_, d := o.durations[name]
	_, r := o.ratios[name]
	return s || l || i || d || r
}

// parse reads the option under d's cursor into its field; false when the
// option is not one of o's.
func (o options) parse(d *caddyfile.Dispenser) (bool, error) {
	name := d.Val()
	if dst, ok := o.strings[name]; ok {
		if !d.AllArgs(dst) {
			return true, d.ArgErr()
		}
		return true, nil
	}
	if dst, ok := o.lists[name]; ok {
		args := d.RemainingArgs()
		if len(args) == 0 {
			return true, d.ArgErr()
		}
		*dst = append(*dst, args...)
		return true, nil
	}
	if dst, ok := o.ints[name]; ok {
		return true, parseInt(d, dst)
	}
	if dst, ok := o.durations[name]; ok {
		return true, parseDuration(d, dst)
	}
	if dst, ok := o.ratios[name]; ok {
		return true, parseRatio(d, dst)
	}
	return false, nil
}

func parseDuration(d *caddyfile.Dispenser, dst *caddy.Duration) error {
	return parseArg(d, dst, func(v string) (caddy.Duration, error) {
		dur, err := caddy.ParseDuration(v)
		return caddy.Duration(dur), err
	})
}

func parseInt(d *caddyfile.Dispenser, dst *int) error {
	return parseArg(d, dst, func(v string) (int, error) {
		n, err := strconv.Atoi(v)
		if err != nil {
			return 0, fmt.Errorf("%q is not an integer", v)
		}
		return n, nil
	})
}

func parseKey(d *caddyfile.Dispenser, pos positions, at []string) (*Key, error) {
	k := new(Key)
	if !d.Args(&k.Secret, &k.Group) {
		return nil, d.Errf("key takes a secret and a group: key <secret> <group>")
	}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	if !strings.HasPrefix(k.Secret, sha256Prefix) && !strings.Contains(k.Secret, "{") {
		if weakKey(k.Secret) {
			caddy.Log().Named("relay").Warn(weakKeyWarning, zap.String("file", d.File()), zap.Int("line", d.Line()))
		}
		sum := sha256.Sum256([]byte(k.Secret))
		k.Secret = sha256Prefix + hex.EncodeToString(sum[:])
	}
	return k, parseKeyOptions(d, pos, at, "key", &k.KeyOptions)
}

// parseKeyOptions reads the block of a key or a user entry (what says
// which, in errors) into o; at locates the entry.
func parseKeyOptions(d *caddyfile.Dispenser, pos positions, at []string, what string, o *KeyOptions) error {
	opts := options{
		strings: map[string]*string{"name": &o.Name, "priority": &o.Priority, "rate": &o.Rate, "tokens": &o.Tokens,
			"user_rate": &o.UserRate, "user_tokens": &o.UserTokens, "expires": &o.Expires},
		ints:   map[string]*int{"concurrency": &o.Concurrency},
		lists:  map[string]*[]string{"budget": &o.Budgets},
		ratios: map[string]*float64{"budget_warn": &o.BudgetWarn},
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		pos.line(d, at...)
		if d.Val() == "disabled" {
			if d.NextArg() {
				return d.Err("disabled takes no argument")
			}
			o.Disabled = true
			continue
		}
		if ok, err := opts.parse(d); err != nil || !ok {
			return cmp.Or(err, d.Errf("unrecognized %s option %q", what, d.Val()))
		}
	}
	return nil
}

// parseUser parses `user <id> <group> [{ <the options of a key> }]`.
func parseUser(d *caddyfile.Dispenser, pos positions, at []string) (*User, error) {
	u := new(User)
	if !d.Args(&u.ID, &u.Group) {
		return nil, d.Errf("user takes an identity (or *) and a group: user <id> <group>")
	}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	return u, parseKeyOptions(d, pos, at, "user", &u.KeyOptions)
}

func parseChannel(d *caddyfile.Dispenser, pos positions) (*Channel, error) {
	ch := new(Channel)
	if !d.Args(&ch.Name) {
		return nil, d.Errf("channel takes a name: channel <name> { ... }")
	}
	chLine := d.Token()
	pos["channel "+ch.Name] = chLine
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	opts := options{
		strings: map[string]*string{"rate": &ch.Rate},
		lists: map[string]*[]string{"models": &ch.Models, "allow": &ch.Allow,
			"supports": &ch.Supports, "lacks": &ch.Lacks, "strip": &ch.Strip, "spend_cap": &ch.SpendCaps},
		ints: map[string]*int{"priority": &ch.Priority, "weight": &ch.Weight, "concurrency": &ch.Concurrency},
	}
	up := providerLines{name: providerAnthropic}
	var transport caddyfile.Unmarshaler
	var transportName string
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		pos.line(d, "channel", ch.Name)
		ok, err := parseTuning(d, &ch.Tuning)
		if !ok && err == nil {
			ok, err = opts.parse(d)
		}
		if err != nil {
			return nil, err
		}
		if ok {
			continue
		}
		switch opt {
		case "provider":
			if err := up.parse(d); err != nil {
				return nil, err
			}
		case "tokens":
			// N/period is the channel's token limit; any other value is
			// the provider's (a mock channel's reply length)
			args := d.RemainingArgs()
			if len(args) == 1 && strings.Contains(args[0], "/") {
				ch.Tokens = args[0]
				continue
			}
			for range args {
				d.Prev()
			}
			up.take(d)
		case "price_factor":
			var f float64
			if err := parseArg(d, &f, func(v string) (float64, error) {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil || !(f > 0) || math.IsInf(f, 0) {
					return 0, fmt.Errorf("%q is not a number above 0 (the channel's price over the list price: 0.8 for 80%%)", v)
				}
				return f, nil
			}); err != nil {
				return nil, err
			}
			ch.PriceFactor = &f
		case "probe":
			p, err := parseProbe(d)
			if err != nil {
				return nil, err
			}
			ch.Probe = p
		case "transport":
			if !d.NextArg() {
				return nil, d.ArgErr()
			}
			transportName = d.Val()
			mod, err := caddyfile.UnmarshalModule(d, "http.reverse_proxy.transport."+transportName)
			if err != nil {
				return nil, err
			}
			transport = mod
		default:
			// the provider's own options: its module reads them
			up.take(d)
		}
	}
	p, err := up.unmarshal(chLine)
	if err != nil {
		return nil, fmt.Errorf("channel %q: %w", ch.Name, err)
	}
	ch.UpstreamRaw = caddyconfig.JSONModuleObject(p, "provider", up.name, nil)
	if transport != nil {
		if _, inProcess := p.(provider.Transporter); inProcess {
			return nil, d.Errf("channel %q: provider %s answers in-process and takes no transport", ch.Name, up.name)
		}
		// as reverse_proxy does: an https upstream gets a TLS transport
		if te, ok := transport.(reverseproxy.TLSTransport); ok {
			https := !strings.HasPrefix(p.BaseURL(), "http://")
			switch {
			case https && !te.TLSEnabled():
				if err := te.EnableTLS(new(reverseproxy.TLSConfig)); err != nil {
					return nil, err
				}
			case !https && te.TLSEnabled():
				return nil, d.Errf("channel %q: url is http:// but its transport is configured for TLS", ch.Name)
			}
		}
		ch.TransportRaw = caddyconfig.JSONModuleObject(transport, "protocol", transportName, nil)
	}
	return ch, nil
}

// providerLines gathers, while a channel block is read, the lines that
// belong to its provider: those of a `provider <name> { ... }` block and
// every channel line the relay does not know, so a provider's options can
// stay on the channel's own lines.
type providerLines struct {
	name   string
	at     caddyfile.Token // the `provider` line's name token, for errors
	tokens []caddyfile.Token
}

// parse reads `provider <name>` and its optional block.
func (u *providerLines) parse(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	u.name, u.at = d.Val(), d.Token()
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		u.take(d)
	}
	return nil
}

// take keeps the line under d's cursor, and its block if it opens one.
func (u *providerLines) take(d *caddyfile.Dispenser) {
	u.tokens = append(u.tokens, d.Token())
	for d.NextArg() {
		u.tokens = append(u.tokens, d.Token())
		if d.Val() == "{" {
			for depth := 1; depth > 0 && d.Next(); {
				switch d.Val() {
				case "{":
					depth++
				case "}":
					depth--
				}
				u.tokens = append(u.tokens, d.Token())
			}
			return
		}
	}
}

// unmarshal hands the lines to the provider's module, as a block of its
// own, `<name> { <lines> }`, that opens on the channel's line (where a
// provider's errors about the whole block point).
func (u *providerLines) unmarshal(channel caddyfile.Token) (provider.Provider, error) {
	id := provider.Namespace + "." + u.name
	if _, err := caddy.GetModule(id); err != nil {
		at := channel
		if u.at.Text != "" {
			at = u.at
		}
		d := caddyfile.NewDispenser([]caddyfile.Token{at})
		d.Next()
		return nil, d.Errf("unknown provider %q (known: %s)", u.name, strings.Join(provider.Names(), ", "))
	}
	open := channel
	open.Text = u.name
	last := open.Line
	for _, t := range u.tokens {
		last = max(last, t.Line)
	}
	brace := open
	brace.Text = "{"
	closing := open
	closing.Text, closing.Line = "}", last+1
	toks := append([]caddyfile.Token{open, brace}, u.tokens...)
	sub := caddyfile.NewDispenser(append(toks, closing))
	sub.Next()
	mod, err := caddyfile.UnmarshalModule(sub, id)
	if err != nil {
		return nil, err
	}
	p, ok := mod.(provider.Provider)
	if !ok {
		return nil, fmt.Errorf("provider %s: module %T does not implement provider.Provider", u.name, mod)
	}
	return p, nil
}

func parseGroup(d *caddyfile.Dispenser, pos positions) (*Group, error) {
	g := new(Group)
	if !d.Args(&g.Name) {
		return nil, d.Errf("group takes a name: group <name> { ... }")
	}
	pos["group "+g.Name] = d.Token()
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	opts := options{
		strings:   map[string]*string{"policy": &g.Policy},
		lists:     map[string]*[]string{"channels": &g.Channels, "budget": &g.Budgets},
		ints:      map[string]*int{"max_queue": &g.MaxQueue},
		ratios:    map[string]*float64{"budget_warn": &g.BudgetWarn},
		durations: map[string]*caddy.Duration{"wait_for_recovery": &g.WaitForRecovery},
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		pos.line(d, "group", g.Name)
		if ok, err := opts.parse(d); err != nil {
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
			f, err := ratio(args[0])
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
			f, err := ratio(share)
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
		case "cache":
			if g.Cache != nil {
				return nil, d.Err("cache is given twice")
			}
			c, err := parseCache(d)
			if err != nil {
				return nil, err
			}
			g.Cache = c
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
			return nil, d.Errf("unrecognized group option %q", d.Val())
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

// Interface guard
var _ caddyfile.Unmarshaler = (*Relay)(nil)
