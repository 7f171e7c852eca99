package provider

import "testing"

func TestColumnSupports(t *testing.T) {
	wire := map[string]Support{"mcp_servers": Unsupported, "service_tier": OptIn, "files-api-2025-04-14": Unsupported}
	for _, tt := range []struct {
		name   string
		col    Column
		ask    string
		answer Support
	}{
		{"the default", Column{Default: Supported, Features: wire}, "web_search", Supported},
		{"an exception", Column{Default: Supported, Features: wire}, "mcp_servers", Unsupported},
		{"an opt-in", Column{Default: Supported, Features: wire}, "service_tier", OptIn},
		{"a beta the column names", Column{Default: Supported, Features: wire}, "files-api-2025-04-14", Unsupported},
		{"another beta takes the default", Column{Default: Unsupported}, "new-beta-2031-01-01", Unsupported},
		{"a betas list replaces the column's betas", Column{Default: Supported, Features: wire, Betas: []string{"files-api-2025-04-14"}}, "files-api-2025-04-14", Supported},
		{"a betas list refuses the others", Column{Default: Supported, Betas: []string{"a-2030-01-01"}}, "b-2030-01-01", Unsupported},
		{"a betas list of every flag", Column{Default: Unsupported, Betas: []string{"*"}}, "b-2030-01-01", Supported},
		{"a betas list leaves the fields alone", Column{Default: Supported, Features: wire, Betas: []string{"*"}}, "mcp_servers", Unsupported},
		{"strip wins", Column{Default: Supported, Features: wire, Strip: []string{"mcp_servers"}}, "mcp_servers", Strip},
	} {
		if got := tt.col.Supports(tt.ask); got != tt.answer {
			t.Errorf("%s: Supports(%q) = %v, want %v", tt.name, tt.ask, got, tt.answer)
		}
	}
}

func TestIsBeta(t *testing.T) {
	for name, beta := range map[string]bool{"context-1m-2025-08-07": true, "claude-code-20250219": true,
		"long_context": false, "web_search": false, "mcp_servers": false} {
		if IsBeta(name) != beta {
			t.Errorf("IsBeta(%q) = %v", name, !beta)
		}
	}
}
