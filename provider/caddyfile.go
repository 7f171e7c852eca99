package provider

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// Options maps a provider's Caddyfile options, each of which takes one
// value or a list, to the config fields they set. A provider whose options
// are all of this kind reads its block with UnmarshalOptions.
type Options struct {
	// Strings are options of one value, kept as written.
	Strings map[string]*string
	// Lists are options of one value or more, appended to: the option
	// may repeat.
	Lists map[string]*[]string
	// Ints are options of one integer.
	Ints map[string]*int
	// Durations are options of one duration (30s, 1m30s, 2d).
	Durations map[string]*caddy.Duration
	// Ratios are options of one fraction, written 0.2 or 20%.
	Ratios map[string]*float64
}

// Has reports whether name is one of o's options.
func (o Options) Has(name string) bool {
	_, s := o.Strings[name]
	_, l := o.Lists[name]
	_, i := o.Ints[name]
	_, d := o.Durations[name]
	_, r := o.Ratios[name]
	return s || l || i || d || r
}

// Parse reads the option under d's cursor into its field; false when the
// option is not one of o's.
func (o Options) Parse(d *caddyfile.Dispenser) (bool, error) {
	name := d.Val()
	if dst, ok := o.Strings[name]; ok {
		if !d.AllArgs(dst) {
			return true, d.ArgErr()
		}
		return true, nil
	}
	if dst, ok := o.Lists[name]; ok {
		args := d.RemainingArgs()
		if len(args) == 0 {
			return true, d.ArgErr()
		}
		*dst = append(*dst, args...)
		return true, nil
	}
	if dst, ok := o.Ints[name]; ok {
		return true, ParseArg(d, dst, func(v string) (int, error) {
			n, err := strconv.Atoi(v)
			if err != nil {
				return 0, fmt.Errorf("%q is not an integer", v)
			}
			return n, nil
		})
	}
	if dst, ok := o.Durations[name]; ok {
		return true, ParseArg(d, dst, func(v string) (caddy.Duration, error) {
			dur, err := caddy.ParseDuration(v)
			return caddy.Duration(dur), err
		})
	}
	if dst, ok := o.Ratios[name]; ok {
		return true, ParseArg(d, dst, Ratio)
	}
	return false, nil
}

// ParseArg parses an option's one argument (the Dispenser is on the
// option's name) into dst with parse; errors name the option.
func ParseArg[T any](d *caddyfile.Dispenser, dst *T, parse func(string) (T, error)) error {
	opt := d.Val()
	var v string
	if !d.AllArgs(&v) {
		return d.ArgErr()
	}
	x, err := parse(v)
	if err != nil {
		return d.Errf("%s: %v", opt, err)
	}
	*dst = x
	return nil
}

// Ratio reads a fraction written as 0.2 or 20%: a value between 0 and 1.
func Ratio(v string) (float64, error) {
	f, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
	if err != nil {
		return 0, fmt.Errorf("%q is not a number or a percentage", v)
	}
	if strings.HasSuffix(v, "%") {
		f /= 100
	}
	if f < 0 || f > 1 {
		return 0, fmt.Errorf("%q is not between 0 and 1 (0%% and 100%%)", v)
	}
	return f, nil
}

// OptionsProvider is a provider whose Caddyfile options are Options: an
// error about a channel line no provider of the channel takes names the
// providers that do take it.
type OptionsProvider interface {
	CaddyfileOptions() Options
}

// UnmarshalOptions reads a provider's Caddyfile block, as the relay hands
// it over (`<name> { <the channel's lines it does not know> }`), into the
// fields of o, then runs check (nil: none) on them. An unknown line is an
// error that names the other providers that take it.
func UnmarshalOptions(d *caddyfile.Dispenser, o Options, check func() error) error {
	d.Next() // the provider's name
	name := d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		ok, err := o.Parse(d)
		if err != nil {
			return err
		}
		if !ok {
			return d.Errf("unrecognized channel option %q (provider %s has no such option either%s)", d.Val(), name, optionOwners(d.Val()))
		}
	}
	if check == nil {
		return nil
	}
	if err := check(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// optionOwners names the providers that take an option, for an error
// about a line on the wrong channel.
func optionOwners(opt string) string {
	var owners []string
	for _, m := range caddy.GetModules(Namespace) {
		if p, ok := m.New().(OptionsProvider); ok && p.CaddyfileOptions().Has(opt) {
			owners = append(owners, m.ID.Name())
		}
	}
	if len(owners) == 0 {
		return ""
	}
	return "; it is an option of provider " + strings.Join(owners, " and ")
}
