package ledger

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseLines parses src, lines of ledger and ledger_retention, into one
// Config as the relay block does.
func parseLines(src string) (*Config, error) {
	var c *Config
	d := caddyfile.NewTestDispenser(src)
	for d.Next() {
		parse := ParseCaddyfile
		if d.Val() == "ledger_retention" {
			parse = ParseRetentionCaddyfile
		}
		l, err := parse(d, c)
		if err != nil {
			return nil, err
		}
		c = l
	}
	return c, nil
}

func TestCaddyfileLedger(t *testing.T) {
	for _, c := range []struct{ block, want string }{
		{"ledger", `{"sqlite":{}}`},
		{"ledger sqlite", `{"sqlite":{}}`},
		{"ledger sqlite /var/lib/relay/ledger.db\nledger_retention 90d", `{"retention":7776000000000000,"sqlite":{"path":"/var/lib/relay/ledger.db"}}`},
		{"ledger_retention 30d\nledger postgres {\n\tdsn {env.RELAY_PG_DSN}\n}", `{"postgres":{"dsn":"{env.RELAY_PG_DSN}"},"retention":2592000000000000}`},
	} {
		l, err := parseLines(c.block)
		if err != nil {
			t.Errorf("%q: %v", c.block, err)
			continue
		}
		// as the relay's JSON config has it
		var v any
		raw, _ := json.Marshal(l)
		_ = json.Unmarshal(raw, &v)
		got, _ := json.Marshal(v)
		if string(got) != c.want {
			t.Errorf("%q parses to %s, want %s", c.block, got, c.want)
		}
	}
	for _, c := range []struct{ block, want string }{
		{"ledger mysql", `ledger "mysql" is not known: sqlite [<path>] or postgres { dsn <dsn> }`},
		{"ledger postgres", "ledger postgres needs a block with its dsn"},
		{"ledger postgres {\n\tpassword x\n}", `unrecognized ledger postgres option "password"`},
		{"ledger\nledger sqlite", "ledger is given twice"},
		{"ledger sqlite a b", "wrong argument count"},
		{"ledger_retention 0s", "ledger_retention must be positive"},
		{"ledger_retention 1d\nledger_retention 2d", "ledger_retention is given twice"},
	} {
		_, err := parseLines(c.block)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want %q", c.block, err, c.want)
		}
	}
}
