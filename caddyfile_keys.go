package relay

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/suggest"
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
			"user_rate": &o.UserRate, "user_tokens": &o.UserTokens, "expires": &o.Expires,
			"session_budget": &o.SessionBudget, "session_rate": &o.SessionRate},
		Ints:   map[string]*int{"concurrency": &o.Concurrency, "loop_guard": &o.LoopGuard},
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
		if d.Val() == "budget_degrade" {
			step, err := parseBudgetDegrade(d)
			if err != nil {
				return err
			}
			o.BudgetDegrade = append(o.BudgetDegrade, step)
			continue
		}
		if ok, err := opts.Parse(d); err != nil || !ok {
			return cmp.Or(err, d.Errf("unrecognized %s option %q%s", what, d.Val(), suggest.DidYouMean(d.Val(), optionNames(opts), []string{"disabled"})))
		}
	}
	return nil
}

// parseBudgetDegrade parses `budget_degrade <percent> cheaper` or
// `budget_degrade <percent> model <id>`; the percent may end in %.
func parseBudgetDegrade(d *caddyfile.Dispenser) (BudgetDegrade, error) {
	const usage = "budget_degrade takes a percent and a mode: budget_degrade 80% cheaper, or budget_degrade 95% model claude-haiku-4-5"
	args := d.RemainingArgs()
	if len(args) < 2 {
		return BudgetDegrade{}, d.Err(usage)
	}
	pct, err := strconv.ParseFloat(strings.TrimSuffix(args[0], "%"), 64)
	if err != nil {
		return BudgetDegrade{}, d.Errf("budget_degrade: %q is not a percent, such as 80%%", args[0])
	}
	step := BudgetDegrade{Percent: pct, Mode: args[1]}
	switch {
	case args[1] == degradeCheaper && len(args) == 2:
	case args[1] == degradeModel && len(args) == 3:
		step.Model = args[2]
	case args[1] == degradeModel:
		return BudgetDegrade{}, d.Errf("budget_degrade %s model takes one model to serve instead: budget_degrade %s model claude-haiku-4-5", args[0], args[0])
	case args[1] == degradeCheaper:
		return BudgetDegrade{}, d.Errf("budget_degrade %s cheaper takes nothing more", args[0])
	default:
		return BudgetDegrade{}, d.Errf("budget_degrade: mode must be cheaper or model <id>, not %q", args[1])
	}
	return step, nil
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
