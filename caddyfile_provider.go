package relay

import (
	"fmt"
	"strings"

	"github.com/caddy-relay/relay/internal/suggest"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// providerLines gathers, while a channel block is read, the lines that
// belong to its provider: those of a `provider <name> { ... }` block and
// every channel line the relay does not know, so a provider's options can
// stay on the channel's own lines.
type providerLines struct {
	name   string
	at     caddyfile.Token // the `provider` line's name token, for errors
	tokens []caddyfile.Token
}

// parse reads `provider <name>` and its optional block.
func (u *providerLines) parse(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	u.name, u.at = d.Val(), d.Token()
	if d.NextArg() {
		return d.ArgErr()
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		u.take(d)
	}
	return nil
}

// take keeps the line under d's cursor, and its block if it opens one.
func (u *providerLines) take(d *caddyfile.Dispenser) {
	u.tokens = append(u.tokens, d.Token())
	for d.NextArg() {
		u.tokens = append(u.tokens, d.Token())
		if d.Val() == "{" {
			for depth := 1; depth > 0 && d.Next(); {
				switch d.Val() {
				case "{":
					depth++
				case "}":
					depth--
				}
				u.tokens = append(u.tokens, d.Token())
			}
			return
		}
	}
}

// unmarshal hands the lines to the provider's module, as a block of its
// own, `<name> { <lines> }`, that opens on the channel's line (where a
// provider's errors about the whole block point).
func (u *providerLines) unmarshal(channel caddyfile.Token) (provider.Provider, error) {
	id := provider.Namespace + "." + u.name
	if _, err := caddy.GetModule(id); err != nil {
		at := channel
		if u.at.Text != "" {
			at = u.at
		}
		d := caddyfile.NewDispenser([]caddyfile.Token{at})
		d.Next()
		return nil, d.Errf("unknown provider %q (known: %s)", u.name, strings.Join(provider.Names(), ", "))
	}
	open := channel
	open.Text = u.name
	last := open.Line
	for _, t := range u.tokens {
		last = max(last, t.Line)
	}
	brace := open
	brace.Text = "{"
	closing := open
	closing.Text, closing.Line = "}", last+1
	toks := append([]caddyfile.Token{open, brace}, u.tokens...)
	sub := caddyfile.NewDispenser(append(toks, closing))
	sub.Next()
	mod, err := caddyfile.UnmarshalModule(sub, id)
	if err != nil {
		return nil, err
	}
	p, ok := mod.(provider.Provider)
	if !ok {
		return nil, fmt.Errorf("provider %s: module %T does not implement provider.Provider", u.name, mod)
	}
	return p, nil
}

// providerTakes reports whether a provider module that declares its
// options (provider.OptionsProvider) takes opt.
func providerTakes(opt string) bool {
	for _, m := range caddy.GetModules(provider.Namespace) {
		if p, ok := m.New().(provider.OptionsProvider); ok && p.CaddyfileOptions().Has(opt) {
			return true
		}
	}
	return false
}

// typo answers the first of a channel's lines that no provider declares
// (unknown) with a "did you mean", when the channel's provider declares its
// options (provider.OptionsProvider) and a known option is close to it. A
// provider that reads its own lines (its UnmarshalCaddyfile) may take any
// option, and judges them itself.
func (u *providerLines) typo(unknown []caddyfile.Token, opts provider.Options) error {
	if len(unknown) == 0 {
		return nil
	}
	m, err := caddy.GetModule(provider.Namespace + "." + u.name)
	if err != nil {
		return nil // unmarshal says the provider is unknown
	}
	p, ok := m.New().(provider.OptionsProvider)
	if !ok {
		return nil
	}
	own := optionNames(p.CaddyfileOptions())
	for _, t := range unknown {
		if hint := suggest.DidYouMean(t.Text, optionNames(opts), channelOptions, tuningNames(), own); hint != "" {
			d := caddyfile.NewDispenser([]caddyfile.Token{t})
			d.Next()
			return d.Errf("unrecognized channel option %q%s", t.Text, hint)
		}
	}
	return nil
}
