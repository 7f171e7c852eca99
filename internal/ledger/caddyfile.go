package ledger

import (
	"cmp"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// ParseCaddyfile parses `ledger [sqlite [<path>]]` and
// `ledger postgres { dsn <dsn> }`, the Dispenser on `ledger`, into c (a
// new Config when c is nil), keeping a retention that ledger_retention
// set before it, and returns it.
func ParseCaddyfile(d *caddyfile.Dispenser, c *Config) (*Config, error) {
	if c != nil && (c.SQLite != nil || c.Postgres != nil) {
		return nil, d.Err("ledger is given twice")
	}
	l := cmp.Or(c, new(Config))
	kind := "sqlite"
	if d.NextArg() {
		kind = d.Val()
	}
	switch kind {
	case "sqlite":
		l.SQLite = new(SQLite)
		d.AllArgs(&l.SQLite.Path)
		if d.NextArg() {
			return nil, d.ArgErr()
		}
		if d.NextBlock(d.Nesting()) {
			return nil, d.Err("ledger sqlite takes a path, not a block")
		}
	case "postgres":
		l.Postgres = new(Postgres)
		if d.NextArg() {
			return nil, d.ArgErr()
		}
		o := provider.Options{Strings: map[string]*string{"dsn": &l.Postgres.DSN}}
		for nesting := d.Nesting(); d.NextBlock(nesting); {
			if ok, err := o.Parse(d); err != nil || !ok {
				return nil, cmp.Or(err, d.Errf("unrecognized ledger postgres option %q (dsn)", d.Val()))
			}
		}
		if l.Postgres.DSN == "" {
			return nil, d.Err("ledger postgres needs a block with its dsn: ledger postgres { dsn {env.RELAY_PG_DSN} }")
		}
	default:
		return nil, d.Errf("ledger %q is not known: sqlite [<path>] or postgres { dsn <dsn> }", kind)
	}
	return l, nil
}

// ParseRetentionCaddyfile parses `ledger_retention <duration>` (days
// allowed: 400d), the Dispenser on `ledger_retention`, into c (a new
// Config when c is nil), and returns it.
func ParseRetentionCaddyfile(d *caddyfile.Dispenser, c *Config) (*Config, error) {
	l := cmp.Or(c, new(Config))
	if l.Retention != 0 {
		return nil, d.Err("ledger_retention is given twice")
	}
	if err := provider.ParseArg(d, &l.Retention, func(v string) (caddy.Duration, error) {
		dur, err := caddy.ParseDuration(v)
		return caddy.Duration(dur), err
	}); err != nil {
		return nil, err
	}
	if l.Retention <= 0 {
		return nil, d.Err("ledger_retention must be positive")
	}
	return l, nil
}
