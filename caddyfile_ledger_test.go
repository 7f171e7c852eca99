package relay

import (
	"encoding/json"
	"strings"
	"testing"
)

// ledgerBase is a relay block's smallest valid content.
const ledgerBase = "key sk-ledger-adapt-7f3a9c2e1b8d4 g\nchannel c {\n\tprovider mock\n}\ngroup g {\n\tchannels c\n}\n"

func TestCaddyfileLedger(t *testing.T) {
	for _, c := range []struct{ block, want string }{
		{"ledger", `{"sqlite":{}}`},
		{"ledger sqlite", `{"sqlite":{}}`},
		{"ledger sqlite /var/lib/relay/ledger.db\nledger_retention 90d", `{"retention":7776000000000000,"sqlite":{"path":"/var/lib/relay/ledger.db"}}`},
		{"ledger_retention 30d\nledger postgres {\n\tdsn {env.RELAY_PG_DSN}\n}", `{"postgres":{"dsn":"{env.RELAY_PG_DSN}"},"retention":2592000000000000}`},
	} {
		out, err := adaptCaddyfile(":8080 {\n\trelay {\n" + ledgerBase + c.block + "\n\t}\n}\n")
		if err != nil {
			t.Errorf("%q: %v", c.block, err)
			continue
		}
		var v any
		_ = json.Unmarshal(out, &v)
		got, _ := json.Marshal(findHandler(v, "relay")["ledger"])
		if string(got) != c.want {
			t.Errorf("%q adapts to %s, want %s", c.block, got, c.want)
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
		_, err := adaptCaddyfile(":8080 {\n\trelay {\n" + ledgerBase + c.block + "\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: error %v, want %q", c.block, err, c.want)
		}
	}
}
