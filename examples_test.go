package relay

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestExamplesAdaptAndValidate adapts every Caddyfile in examples/ and then
// provisions it as `caddy validate` does, with made-up values for the
// placeholders it uses.
func TestExamplesAdaptAndValidate(t *testing.T) {
	files, err := filepath.Glob("examples/*.Caddyfile")
	if err != nil || len(files) < 2 {
		t.Fatalf("examples: %v %v", files, err)
	}
	placeholder := regexp.MustCompile(`\{(env|file)\.([^}]+)\}`)
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			src, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range placeholder.FindAllStringSubmatch(string(src), -1) {
				switch {
				case m[1] == "env" && strings.HasSuffix(m[2], "_FILE"):
					// a credentials file must exist and be well formed
					t.Setenv(m[2], newFakeGoogle(t, 3600).serviceAccountFile(t))
				case m[1] == "env":
					t.Setenv(m[2], "test-secret-"+m[2])
				default:
					if _, err := os.Stat(m[2]); err == nil {
						continue
					}
					// point the {file.*} placeholder at a file that exists
					tmp := filepath.Join(t.TempDir(), "secret")
					if err := os.WriteFile(tmp, []byte("test-secret-file\n"), 0o600); err != nil {
						t.Fatal(err)
					}
					src = []byte(strings.ReplaceAll(string(src), m[0], "{file."+tmp+"}"))
				}
			}
			adapter := caddyconfig.GetAdapter("caddyfile")
			cfgJSON, warnings, err := adapter.Adapt(src, map[string]any{"filename": file})
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			for _, w := range warnings {
				t.Logf("warning: %s", w.String())
			}
			if !strings.Contains(string(cfgJSON), `"handler":"relay"`) {
				t.Errorf("no relay handler in the adapted config")
			}
			var cfg caddy.Config
			if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
				t.Fatal(err)
			}
			// validation must not bind the example's ports or admin address
			cfg.Admin = &caddy.AdminConfig{Disabled: true}
			if err := caddy.Validate(&cfg); err != nil {
				t.Fatalf("validate: %v", err)
			}
		})
	}
}
