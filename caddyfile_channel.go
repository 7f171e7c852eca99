package relay

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// channelOptions are a channel's options that its switch reads, besides its
// Options, the tuning ones and its provider's.
var channelOptions = []string{"provider", "tokens", "price_factor", "model_class", "forward_traceparent", "probe", "transport"}

// parseChannel parses `channel <name> { ... }`: the channel's own lines,
// and those of its provider (see providerLines).
func parseChannel(d *caddyfile.Dispenser, pos positions) (*Channel, error) {
	ch := new(Channel)
	if !d.Args(&ch.Name) {
		return nil, d.Errf("channel takes a name: channel <name> { ... }")
	}
	chLine := d.Token()
	pos["channel "+ch.Name] = chLine
	if d.NextArg() {
		return nil, d.ArgErr()
	}
	opts := provider.Options{
		Strings: map[string]*string{"rate": &ch.Rate, "signature_domain": &ch.SignatureDomain},
		Lists: map[string]*[]string{"models": &ch.Models, "allow": &ch.Allow,
			"supports": &ch.Supports, "lacks": &ch.Lacks, "strip": &ch.Strip, "spend_cap": &ch.SpendCaps},
		Ints: map[string]*int{"priority": &ch.Priority, "weight": &ch.Weight, "concurrency": &ch.Concurrency},
	}
	up := providerLines{name: providerAnthropic}
	var transport caddyfile.Unmarshaler
	var transportName string
	var unknown []caddyfile.Token // lines no provider declares, for typo
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		pos.line(d, "channel", ch.Name)
		ok, err := parseTuning(d, &ch.Tuning)
		if !ok && err == nil {
			ok, err = opts.Parse(d)
		}
		if err != nil {
			return nil, err
		}
		if ok {
			continue
		}
		switch opt {
		case "provider":
			if err := up.parse(d); err != nil {
				return nil, err
			}
		case "tokens":
			// N/period is the channel's token limit; any other value is
			// the provider's (a mock channel's reply length)
			args := d.RemainingArgs()
			if len(args) == 1 && strings.Contains(args[0], "/") {
				ch.Tokens = args[0]
				continue
			}
			for range args {
				d.Prev()
			}
			up.take(d)
		case "price_factor":
			var f float64
			if err := provider.ParseArg(d, &f, func(v string) (float64, error) {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil || !(f > 0) || math.IsInf(f, 0) {
					return 0, fmt.Errorf("%q is not a number above 0 (the channel's price over the list price: 0.8 for 80%%)", v)
				}
				return f, nil
			}); err != nil {
				return nil, err
			}
			ch.PriceFactor = &f
		case "model_class":
			// model_class <glob> <class>: validated with the channel
			var m ModelClass
			if !d.Args(&m.Match, &m.Class) || d.NextArg() {
				return nil, d.Errf("model_class takes a glob of upstream model ids and a class: model_class <glob> <class>")
			}
			ch.ModelClasses = append(ch.ModelClasses, m)
		case "forward_traceparent":
			if d.NextArg() {
				return nil, d.Errf("forward_traceparent takes no value: the line alone turns it on")
			}
			ch.ForwardTraceparent = true
		case "probe":
			p, err := parseProbe(d)
			if err != nil {
				return nil, err
			}
			ch.Probe = p
		case "transport":
			if !d.NextArg() {
				return nil, d.ArgErr()
			}
			transportName = d.Val()
			mod, err := caddyfile.UnmarshalModule(d, "http.reverse_proxy.transport."+transportName)
			if err != nil {
				return nil, err
			}
			transport = mod
		default:
			// the provider's own options: its module reads them; a typo of
			// an option no provider takes is answered once the provider is
			// known (typo)
			if !providerTakes(opt) {
				unknown = append(unknown, d.Token())
			}
			up.take(d)
		}
	}
	if err := up.typo(unknown, opts); err != nil {
		return nil, err
	}
	p, err := up.unmarshal(chLine)
	if err != nil {
		return nil, fmt.Errorf("channel %q: %w", ch.Name, err)
	}
	ch.UpstreamRaw = caddyconfig.JSONModuleObject(p, "provider", up.name, nil)
	if transport != nil {
		if _, inProcess := p.(provider.Transporter); inProcess {
			return nil, d.Errf("channel %q: provider %s answers in-process and takes no transport", ch.Name, up.name)
		}
		// as reverse_proxy does: an https upstream gets a TLS transport
		if te, ok := transport.(reverseproxy.TLSTransport); ok {
			https := !strings.HasPrefix(p.BaseURL(), "http://")
			switch {
			case https && !te.TLSEnabled():
				if err := te.EnableTLS(new(reverseproxy.TLSConfig)); err != nil {
					return nil, err
				}
			case !https && te.TLSEnabled():
				return nil, d.Errf("channel %q: url is http:// but its transport is configured for TLS", ch.Name)
			}
		}
		ch.TransportRaw = caddyconfig.JSONModuleObject(transport, "protocol", transportName, nil)
	}
	return ch, nil
}

// parseProbe parses a `probe { ... }` block.
func parseProbe(d *caddyfile.Dispenser) (*Probe, error) {
	p := new(Probe)
	return p, parseBlock(d, "probe", provider.Options{
		Strings:   map[string]*string{"path": &p.Path, "body": &p.Body},
		Durations: map[string]*caddy.Duration{"interval": &p.Interval},
	})
}
