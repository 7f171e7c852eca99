package ledger

import (
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// ledgers keeps each ledger's writer across config reloads, by its
// database: one writer per database in a process, whatever the number of
// relay handlers and configs that use it. The last config to go writes its
// queue out and closes it.
var ledgers = caddy.NewUsagePool()

// Load returns the writer of config c's database, from the pool (opened,
// and its writer started, when no config holds it yet), and the key the
// caller gives back with Release when its config ends. A reload that
// keeps the database keeps its writer and its queue, and takes the new
// retention. digest is a session id as the rows keep it.
func Load(ctx caddy.Context, c *Config, digest func(string) string) (*Writer, string, error) {
	if err := c.Validate(); err != nil {
		return nil, "", err
	}
	key, open, err := backend(ctx, c, digest)
	if err != nil {
		return nil, "", err
	}
	v, _, err := ledgers.LoadOrNew(key, func() (caddy.Destructor, error) {
		store, name, err := open()
		if err != nil {
			return nil, err
		}
		return Start(store, name, ctx.Logger(), Queue), nil
	})
	if err != nil {
		return nil, "", err
	}
	l := v.(*Writer)
	l.mu.Lock()
	l.retain = defaultLedgerRetention
	if c.Retention > 0 {
		l.retain = time.Duration(c.Retention)
	}
	l.logger = ctx.Logger()
	l.mu.Unlock()
	return l, key, nil
}

// Release gives back the writer of key, which Load returned: once no
// config holds it, it writes its queue out and closes its database.
func Release(key string) error {
	_, err := ledgers.Delete(key)
	return err
}

// Current is the ledger GET /relay/usage reads: the only one the
// process writes. With none or several, it says why not.
func Current() (*Writer, error) {
	var found []*Writer
	ledgers.Range(func(_, v any) bool {
		found = append(found, v.(*Writer))
		return true
	})
	switch len(found) {
	case 0:
		return nil, fmt.Errorf("no ledger is configured (the relay's ledger option)")
	case 1:
		return found[0], nil
	}
	return nil, fmt.Errorf("%d ledgers are configured in this process; GET /relay/usage reads one", len(found))
}
