package relay

import (
	"cmp"

	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseLedger parses `ledger [sqlite [<path>]]` and
// `ledger postgres { dsn <dsn> }` into r.Ledger, keeping a retention that
// ledger_retention set before it.
func parseLedger(d *caddyfile.Dispenser, r *Relay) error {
	if r.Ledger != nil && (r.Ledger.SQLite != nil || r.Ledger.Postgres != nil) {
		return d.Err("ledger is given twice")
	}
	l := cmp.Or(r.Ledger, new(ledger.Config))
	kind := "sqlite"
	if d.NextArg() {
		kind = d.Val()
	}
	switch kind {
	case "sqlite":
		l.SQLite = new(ledger.SQLite)
		d.AllArgs(&l.SQLite.Path)
		if d.NextArg() {
			return d.ArgErr()
		}
		if d.NextBlock(d.Nesting()) {
			return d.Err("ledger sqlite takes a path, not a block")
		}
	case "postgres":
		l.Postgres = new(ledger.Postgres)
		if d.NextArg() {
			return d.ArgErr()
		}
		o := provider.Options{Strings: map[string]*string{"dsn": &l.Postgres.DSN}}
		for nesting := d.Nesting(); d.NextBlock(nesting); {
			if ok, err := o.Parse(d); err != nil || !ok {
				return cmp.Or(err, d.Errf("unrecognized ledger postgres option %q (dsn)", d.Val()))
			}
		}
		if l.Postgres.DSN == "" {
			return d.Err("ledger postgres needs a block with its dsn: ledger postgres { dsn {env.RELAY_PG_DSN} }")
		}
	default:
		return d.Errf("ledger %q is not known: sqlite [<path>] or postgres { dsn <dsn> }", kind)
	}
	r.Ledger = l
	return nil
}

// parseLedgerRetention parses `ledger_retention <duration>` (days
// allowed: 400d).
func parseLedgerRetention(d *caddyfile.Dispenser, r *Relay) error {
	l := cmp.Or(r.Ledger, new(ledger.Config))
	if l.Retention != 0 {
		return d.Err("ledger_retention is given twice")
	}
	if err := parseDuration(d, &l.Retention); err != nil {
		return err
	}
	if l.Retention <= 0 {
		return d.Err("ledger_retention must be positive")
	}
	r.Ledger = l
	return nil
}
