package bedrock

import (
	"slices"
	"testing"

	"github.com/caddy-relay/relay/provider"
)

func TestReadRefusal(t *testing.T) {
	for msg, want := range map[string]provider.Refusal{
		"bedrock: ValidationException: Malformed input request: #: extraneous key [context_management] is not permitted, please reformat your input and try again.": {Fields: []string{"context_management"}},
		"bedrock: ValidationException: Malformed input request: #: extraneous key [cut":                                                                             {},
		"bedrock: ValidationException: invalid beta flag":                                                                                                           {SomeBeta: true},
		"mcp_servers: Extra inputs are not permitted":                                                                                                               {},
		"bedrock: ValidationException: messages: invalid beta flag in a later place, not at the start":                                                              {},
	} {
		got := (&Provider{}).ReadRefusal(msg)
		if !slices.Equal(got.Fields, want.Fields) || got.SomeBeta != want.SomeBeta || got.Betas != nil || got.Tools != nil {
			t.Errorf("ReadRefusal(%q) = %+v, want %+v", msg, got, want)
		}
	}
}

func TestFoundationModel(t *testing.T) {
	for id, want := range map[string]string{
		"us.anthropic.claude-sonnet-5-5":   "anthropic.claude-sonnet-5-5",
		"global.anthropic.claude-opus-5-5": "anthropic.claude-opus-5-5",
		"anthropic.claude-haiku-5-5":       "anthropic.claude-haiku-5-5",
		"arn:aws:bedrock:x/y.anthropic.z":  "arn:aws:bedrock:x/y.anthropic.z",
	} {
		if got := foundationModel(id); got != want {
			t.Errorf("foundationModel(%q) = %q, want %q", id, got, want)
		}
	}
}

func TestSupportsTakesTheChannelsBetasAndStripFields(t *testing.T) {
	p := &Provider{Betas: []string{"new-beta-2031-01-01"}, StripFields: []string{"mcp_servers"}}
	for name, want := range map[string]provider.Support{
		"new-beta-2031-01-01":   provider.Supported,
		"context-1m-2025-08-07": provider.Unsupported, // the betas list replaces the column's
		"mcp_servers":           provider.Strip,
		"output_config":         provider.Supported,
		"web_fetch":             provider.Unsupported,
	} {
		if got := p.Supports(name); got != want {
			t.Errorf("Supports(%q) = %v, want %v", name, got, want)
		}
	}
}
