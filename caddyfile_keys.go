package relay

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"strings"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

// parseKey parses `key <secret> <group> [{ <options> }]`.
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
	opts := provider.Options{
		Strings: map[string]*string{"name": &o.Name, "priority": &o.Priority, "rate": &o.Rate, "tokens": &o.Tokens,
			"user_rate": &o.UserRate, "user_tokens": &o.UserTokens, "expires": &o.Expires},
		Ints:   map[string]*int{"concurrency": &o.Concurrency},
		Lists:  map[string]*[]string{"budget": &o.Budgets},
		Ratios: map[string]*float64{"budget_warn": &o.BudgetWarn},
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
		if ok, err := opts.Parse(d); err != nil || !ok {
			return cmp.Or(err, d.Errf("unrecognized %s option %q%s", what, d.Val(), didYouMean(d.Val(), optionNames(opts), []string{"disabled"})))
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
