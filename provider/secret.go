package provider

import (
	"context"
	"fmt"
	"net/url"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// channelKey is the context key under which a provider's Provision finds
// the name of its channel.
type channelKey struct{}

// WithChannel is the context the relay provisions the provider of the
// channel named name with.
func WithChannel(ctx caddy.Context, name string) caddy.Context {
	return ctx.WithValue(channelKey{}, name)
}

// ChannelOf is the name of the channel whose provider ctx provisions, for
// its logs and for state it keeps across config reloads; empty outside the
// relay.
func ChannelOf(ctx context.Context) string {
	name, _ := ctx.Value(channelKey{}).(string)
	return name
}

// Secret resolves a secret of the provider ctx provisions (field names it
// in errors, never its value), and warns when it is written in the config
// itself rather than as a placeholder.
func Secret(ctx caddy.Context, field, value string) (string, error) {
	v, err := ResolvePlaceholders(value)
	if err != nil {
		return "", fmt.Errorf("%s: %w", field, err)
	}
	if !IsPlaceholder(value) {
		ctx.Logger().Warn("a channel secret is written in the config; use a placeholder such as {env.NAME} to keep it out of GET /config/ and autosave.json",
			zap.String("channel", ChannelOf(ctx)), zap.String("field", field))
	}
	return v, nil
}

// IsPlaceholder reports whether s is made of a Caddy placeholder, which
// Provision resolves, rather than the secret itself.
func IsPlaceholder(s string) bool {
	return strings.HasPrefix(s, "{") && strings.HasSuffix(s, "}")
}

// ResolvePlaceholders resolves the global placeholders ({env.*}, {file.*})
// in s with a fresh replacer, so request placeholders can never leak in.
// An empty result is an error: a channel or key without its secret is
// unusable. The error names the placeholder, never a value.
func ResolvePlaceholders(s string) (string, error) {
	return caddy.NewReplacer().ReplaceOrErr(s, true, true)
}

// CheckURL checks a provider's optional base URL: empty, or an absolute
// http:// or https:// URL without a query or fragment.
func CheckURL(raw string) error {
	if raw == "" {
		return nil
	}
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("url: %v", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
		return fmt.Errorf("url %q must be an absolute http:// or https:// URL", raw)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("url %q must not have a query or fragment", raw)
	}
	return nil
}
