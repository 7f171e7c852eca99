package fleet

import (
	"cmp"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// ParseCaddyfile parses `storage redis { ... }`, the Dispenser on
// `storage`, into the Redis config it names.
func ParseCaddyfile(d *caddyfile.Dispenser) (*Config, error) {
	if !d.NextArg() {
		return nil, d.ArgErr()
	}
	if d.Val() != "redis" {
		return nil, d.Errf("storage %q is not known: the relay keeps shared state in redis", d.Val())
	}
	rs := new(Config)
	var lease, timeout caddy.Duration
	o := provider.Options{
		Strings:   map[string]*string{"master_name": &rs.MasterName, "username": &rs.Username, "password": &rs.Password, "prefix": &rs.Prefix, "on_error": &rs.OnError},
		Lists:     map[string]*[]string{"address": &rs.Address},
		Ints:      map[string]*int{"db": &rs.DB},
		Durations: map[string]*caddy.Duration{"timeout": &timeout, "lease": &lease},
	}
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() == "tls" {
			t, err := parseTLS(d)
			if err != nil {
				return nil, err
			}
			rs.TLS = t
			continue
		}
		if ok, err := o.Parse(d); err != nil || !ok {
			return nil, cmp.Or(err, d.Errf("unrecognized storage redis option %q", d.Val()))
		}
	}
	rs.Timeout, rs.Lease = timeout, lease
	if err := rs.Validate(); err != nil {
		return nil, d.Err(err.Error())
	}
	return rs, nil
}

// parseTLS parses `tls`, alone or with a block of Caddy's TLS
// client options as reverse_proxy names them without their tls_ prefix:
// server_name, trust_pool, client_auth, insecure_skip_verify.
func parseTLS(d *caddyfile.Dispenser) (*reverseproxy.TLSConfig, error) {
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
