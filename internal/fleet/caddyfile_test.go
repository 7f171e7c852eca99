package fleet

import (
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parse parses src, a `storage` line and its block.
func parse(src string) (*Config, error) {
	d := caddyfile.NewTestDispenser(src)
	d.Next() // storage
	return ParseCaddyfile(d)
}

func TestCaddyfileFleet(t *testing.T) {
	s, err := parse(`storage redis {
	address 10.0.0.1:6379 10.0.0.2:6379
	username relay
	password {env.REDIS_PASSWORD}
	prefix team-a:
	timeout 20ms
	on_error deny
	lease 5s
	tls {
		server_name redis.internal
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(s.Address, ",") != "10.0.0.1:6379,10.0.0.2:6379" || s.Username != "relay" || s.Password != "{env.REDIS_PASSWORD}" ||
		s.Prefix != "team-a:" || time.Duration(s.Timeout) != 20*time.Millisecond || s.OnError != "deny" ||
		time.Duration(s.Lease) != 5*time.Second || s.TLS == nil || s.TLS.ServerName != "redis.internal" {
		t.Fatalf("parsed %+v", s)
	}

	for src, want := range map[string]string{
		"storage memcached":                          `storage "memcached" is not known`,
		"storage redis {\n\ton_error maybe\n}":       `on_error must be local or deny`,
		"storage redis {\n\taddress localhost\n}":    `not host:port`,
		"storage redis {\n\tpool 10\n}":              `unrecognized storage redis option "pool"`,
		"storage redis {\n\ttls {\n\t\tca x\n\t}\n}": `unrecognized storage redis tls option "ca"`,
		"storage redis {\n\ttimeout -1s\n}":          `must not be negative`,
	} {
		if _, err := parse(src); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: error %v, want %q", src, err, want)
		}
	}
}
