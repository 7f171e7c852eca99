package ledger

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
)

// Config keeps one row per request in a database that finance can query
// (GET /relay/usage on the admin API, or SQL): who asked, what was served,
// its tokens and its cost. It is `ledger` in the JSON config and the
// Caddyfile. Without it, the relay keeps no such record. Rows are written
// off the request path, in batches; a database that is away never slows or
// fails a request.
type Config struct {
	// SQLite keeps the ledger in a SQLite file of this machine: right for
	// a single relay. It is the default when neither is set.
	SQLite *SQLite `json:"sqlite,omitempty"`

	// Postgres keeps the ledger in a PostgreSQL database, which the
	// relays of a fleet share.
	Postgres *Postgres `json:"postgres,omitempty"`

	// Retention is how long rows are kept: older ones are deleted once an
	// hour. Default: 400d (a year and a month, for a year-on-year
	// comparison).
	Retention caddy.Duration `json:"retention,omitempty"`
}

// SQLite is a SQLite ledger file, written in WAL mode.
type SQLite struct {
	// Path is the database file. Placeholders such as {env.NAME} are
	// resolved. Default: relay/ledger.db in Caddy's data directory.
	Path string `json:"path,omitempty"`
}

// Postgres is a PostgreSQL ledger.
type Postgres struct {
	// DSN is the connection string (postgres://user:pass@host/db?... or
	// key=value pairs). Use a placeholder such as {env.RELAY_PG_DSN}: it is
	// resolved when the config loads and never shows in GET /config/ or
	// the logs.
	DSN string `json:"dsn,omitempty"`
}

// Validate says what is wrong with c, if anything: both databases, a
// Postgres without its DSN, a negative retention.
func (c *Config) Validate() error {
	if c.SQLite != nil && c.Postgres != nil {
		return fmt.Errorf("ledger: sqlite or postgres, not both")
	}
	if c.Postgres != nil && c.Postgres.DSN == "" {
		return fmt.Errorf("ledger postgres: dsn is required")
	}
	if c.Retention < 0 {
		return fmt.Errorf("ledger_retention must not be negative")
	}
	return nil
}

// backend says which database c names (the pool's key: a SQLite
// file's absolute path, or the DSN as configured, a placeholder, never
// resolved) and how to open it.
func backend(ctx caddy.Context, c *Config, digest func(string) string) (string, func() (Store, string, error), error) {
	if c.Postgres != nil {
		dsn, err := provider.ResolvePlaceholders(c.Postgres.DSN)
		if err != nil {
			return "", nil, fmt.Errorf("ledger postgres: dsn: %w", err)
		}
		if !strings.HasPrefix(c.Postgres.DSN, "{") {
			ctx.Logger().Warn("the ledger's postgres dsn is written in the config; use a placeholder such as {env.RELAY_PG_DSN} to keep its password out of GET /config/ and autosave.json")
		}
		raw, _ := json.Marshal(c.Postgres)
		return "postgres:" + string(raw), func() (Store, string, error) {
			s, err := openPostgresStore(dsn, digest)
			if err != nil {
				return nil, "", err
			}
			return s, "postgres", nil
		}, nil
	}
	path, err := sqlitePath(c.SQLite)
	if err != nil {
		return "", nil, err
	}
	return "sqlite:" + path, func() (Store, string, error) {
		s, err := openSQLiteFile(path, digest)
		if err != nil {
			return nil, "", err
		}
		return s, "sqlite " + path, nil
	}, nil
}

// sqlitePath is the file of a SQLite ledger: the configured one
// (placeholders resolved), else relay/ledger.db in Caddy's data directory;
// absolute, so that two configs naming one file share its writer.
func sqlitePath(c *SQLite) (string, error) {
	path := filepath.Join(caddy.AppDataDir(), "relay", "ledger.db")
	if c != nil && c.Path != "" {
		p, err := caddy.NewReplacer().ReplaceOrErr(c.Path, true, true)
		if err != nil {
			return "", fmt.Errorf("ledger sqlite: path: %w", err)
		}
		path = p
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("ledger sqlite: path: %w", err)
	}
	return abs, nil
}
