// Package vertex is the relay's provider for Google Vertex AI's rawPredict
// wire: module http.handlers.relay.providers.vertex.
package vertex

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

const (
	// vertexVersion is the body's anthropic_version on Vertex when the
	// request carries none.
	vertexVersion = "vertex-2023-10-16"
	// vertexScope is the OAuth2 scope Vertex AI's API takes.
	vertexScope = "https://www.googleapis.com/auth/cloud-platform"
	// vertexRefreshMargin is how long before its expiry an access token is
	// replaced in the background (Google's last an hour).
	vertexRefreshMargin = 5 * time.Minute
	// vertexTokenTimeout bounds one token request to Google.
	vertexTokenTimeout = 30 * time.Second
)

func init() {
	caddy.RegisterModule(Provider{})
}

// Provider speaks Google Vertex AI's rawPredict wire: the model in the
// URL, anthropic_version in the body, betas in the anthropic-beta header, a
// Google OAuth2 access token refreshed off the request path, and
// Google-shaped errors, which become Anthropic's.
type Provider struct {
	// Project is the Google Cloud project. Required.
	Project string `json:"project,omitempty"`

	// Region is the Google Cloud region (us-east5, europe-west1...) or the
	// global, us and eu endpoints. Required.
	Region string `json:"region,omitempty"`

	// URL is the API endpoint. Default: the region's.
	URL string `json:"url,omitempty"`

	// CredentialsFile is the path of a Google credentials file (a service
	// account key, or another type Google's libraries take). Default:
	// Google's application default credentials.
	CredentialsFile string `json:"credentials_file,omitempty"`

	// AnthropicVersion is the `anthropic_version` put in the body when the
	// request has none. Default: vertex-2023-10-16.
	AnthropicVersion string `json:"anthropic_version,omitempty"`

	// Betas lists the anthropic-beta flags this channel supports, in place
	// of the feature table's Vertex column (`*`: every flag). A request
	// carrying another flag goes to another channel, or gets
	// capability_not_available.
	Betas []string `json:"betas,omitempty"`

	// StripFields lists top-level body fields removed from every request
	// on this channel (the channel's `strip` line says the same for the
	// feature table's fields). Default: none; nothing a client sent is
	// removed unless configured.
	StripFields []string `json:"strip_fields,omitempty"`

	models      string   // .../publishers/anthropic/models/, to which {model}:{method} is appended
	version     string   // anthropic_version when the body has none
	strip       []string // removed from every body: strip_fields
	stripModels []string // removed from Messages bodies: model, then strip
	auth        *vertexAuth
}

// CaddyModule returns the Caddy module information.
func (Provider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.vertex",
		New: func() caddy.Module { return new(Provider) },
	}
}

// check validates what needs no file or network; the Caddyfile adapter
// runs it too.
func (p *Provider) check() error {
	if p.Project == "" || p.Region == "" {
		return fmt.Errorf("a vertex channel needs a project and a region")
	}
	if !validVertexRegion(p.Region) {
		return fmt.Errorf("region %q is not a Google Cloud region (us-east5, europe-west1, global, us, eu...)", p.Region)
	}
	return provider.CheckURL(p.URL)
}

// BaseURL implements provider.Provider.
func (p *Provider) BaseURL() string {
	return cmp.Or(strings.TrimSuffix(p.URL, "/"), vertexEndpoint(p.Region))
}

// Provision reads and checks the credentials but fetches no token: `caddy
// validate` provisions without network, and missing application default
// credentials fail requests (which fail over), not the config.
func (p *Provider) Provision(ctx caddy.Context) error {
	if err := p.check(); err != nil {
		return err
	}
	auth, err := loadVertexAuth(ctx, p.CredentialsFile)
	if err != nil {
		return err
	}
	p.auth = auth
	p.strip = p.StripFields
	p.models = p.BaseURL() + "/v1/projects/" + url.PathEscape(p.Project) + "/locations/" + url.PathEscape(p.Region) +
		"/publishers/anthropic/models/"
	p.version = cmp.Or(p.AnthropicVersion, vertexVersion)
	p.stripModels = append([]string{"model"}, p.strip...)
	return nil
}

// Account implements provider.AccountNamer: the Google Cloud project,
// whose channels (in any region) share a signature domain.
func (p *Provider) Account() string { return "project-" + p.Project }

// GenAIProviderName implements provider.GenAINamer: the conventions' name of
// Google Vertex AI.
func (*Provider) GenAIProviderName() string { return "gcp.vertex_ai" }

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	project           <project>
//	region            <region>
//	url               <endpoint>
//	credentials_file  <path>
//	anthropic_version <version>
//	betas             <flag>...|*
//	strip_fields      <field>...
func (p *Provider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return provider.UnmarshalOptions(d, p.CaddyfileOptions(), p.check)
}

// CaddyfileOptions implements provider.OptionsProvider.
func (p *Provider) CaddyfileOptions() provider.Options {
	return provider.Options{
		Strings: map[string]*string{"project": &p.Project, "region": &p.Region, "url": &p.URL,
			"credentials_file": &p.CredentialsFile, "anthropic_version": &p.AnthropicVersion},
		Lists: map[string]*[]string{"betas": &p.Betas, "strip_fields": &p.StripFields},
	}
}

// vertexEndpoint is the API endpoint of a region, as the Anthropic SDKs
// pick it: global and the us and eu multi-regions have their own hosts.
func vertexEndpoint(region string) string {
	switch region {
	case "global":
		return "https://aiplatform.googleapis.com"
	case "us", "eu":
		return "https://aiplatform." + region + ".rep.googleapis.com"
	}
	return "https://" + region + "-aiplatform.googleapis.com"
}

// validVertexRegion accepts what can name a region in a host name.
func validVertexRegion(s string) bool {
	if s == "" || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for _, c := range []byte(s) {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

// NewRequest implements provider.Provider. Messages go to {model}:rawPredict or
// :streamRawPredict without their model; token counts go to
// count-tokens:rawPredict with it. The query string (?beta=true) has no
// meaning on Vertex and stays behind.
func (p *Provider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	var u string
	var body []byte
	var err error
	if c.CountTokens() {
		u = p.models + "count-tokens:rawPredict"
		if body, err = vertexCountBody(c.Body(), c.Model); err == nil {
			body, err = provider.CloudBody(body, p.version, p.strip)
		}
	} else {
		method := ":rawPredict"
		if c.Stream {
			method = ":streamRawPredict"
		}
		u = p.models + url.PathEscape(c.Model) + method
		body, err = provider.CloudBody(c.Body(), p.version, p.stripModels)
	}
	if err != nil {
		return nil, fmt.Errorf("vertex: rewriting the body: %v", err)
	}
	token, err := p.auth.token(ctx)
	if err != nil {
		return nil, err
	}
	req, err := c.NewRequest(ctx, http.MethodPost, u, body)
	if err != nil {
		return nil, err
	}
	c.ForwardHeaders(req.Header)
	req.Header.Del("Anthropic-Beta")
	if betas := provider.Betas(c.Header); len(betas) > 0 { // the selection let them through
		req.Header.Set("Anthropic-Beta", strings.Join(betas, ","))
	}
	req.Header.Set("Authorization", "Bearer "+token)
	return req, nil
}

// features is what rawPredict refuses of the feature table; it takes every
// other feature, and a beta flag the table does not list is forwarded: its
// answer decides (docs/providers.md gives the source of each).
var features = map[string]provider.Support{
	"service_tier":                           provider.Unsupported,
	"inference_geo":                          provider.Unsupported,
	"speed":                                  provider.Unsupported,
	"mcp_servers":                            provider.Unsupported,
	"container":                              provider.Unsupported,
	"web_fetch":                              provider.Unsupported,
	"code_execution":                         provider.Unsupported,
	"advanced-tool-use-2025-11-20":           provider.Unsupported,
	"claude-code-20250219":                   provider.Unsupported,
	"code-execution-2025-05-22":              provider.Unsupported,
	"code-execution-2025-08-25":              provider.Unsupported,
	"effort-2025-11-24":                      provider.Unsupported,
	"fast-mode-2026-02-01":                   provider.Unsupported,
	"files-api-2025-04-14":                   provider.Unsupported,
	"fine-grained-tool-streaming-2025-05-14": provider.Unsupported,
	"mcp-client-2025-04-04":                  provider.Unsupported,
	"mcp-client-2025-11-20":                  provider.Unsupported,
	"oauth-2025-04-20":                       provider.Unsupported,
	"output-128k-2025-02-19":                 provider.Unsupported,
	"prompt-caching-scope-2026-01-05":        provider.Unsupported,
	"skills-2025-10-02":                      provider.Unsupported,
	"structured-outputs-2025-11-13":          provider.Unsupported,
	"token-efficient-tools-2025-02-19":       provider.Unsupported,
	"web-fetch-2025-09-10":                   provider.Unsupported,
}

// Supports implements provider.FeatureSupport: the feature table's Vertex
// column, with the channel's betas and strip_fields in place of its own.
func (p *Provider) Supports(name string) provider.Support {
	c := provider.Column{Default: provider.Supported, Features: features, Betas: p.Betas, Strip: p.StripFields}
	return c.Supports(name)
}

// vertexCountBody gives count-tokens its model: Vertex counts for the model
// named in the body, and refuses the @default and @latest aliases there that
// rawPredict takes, so they are dropped.
func vertexCountBody(body []byte, model string) ([]byte, error) {
	for _, alias := range []string{"@default", "@latest"} {
		if m, ok := strings.CutSuffix(model, alias); ok {
			return sjson.SetBytes(body, "model", m)
		}
	}
	return body, nil
}

// Response implements provider.Provider. Successes (SSE included) are Anthropic's
// wire already, and so are the model's own errors; Google's platform errors
// ({"error":{"code","message","status"}}, sometimes in an array) become the
// Anthropic error the classification table and the SDKs expect.
func (*Provider) Response(resp *http.Response, _ *provider.Call) (*http.Response, error) {
	if resp.StatusCode >= 200 && resp.StatusCode <= 299 {
		return resp, nil
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, provider.MaxErrorBody))
	if err != nil {
		return nil, err
	}
	status, msg, translate := vertexError(resp.StatusCode, body)
	if !translate {
		out := *resp
		out.Body = io.NopCloser(bytes.NewReader(body))
		return &out, nil
	}
	// every URL names the model, and a bad credential is UNAUTHENTICATED
	// (401): a 403 refuses the model
	return provider.UpstreamError{Status: status, Message: msg, RefusesModel: status == http.StatusForbidden}.Response(resp), nil
}

// vertexStatuses maps Google's canonical error statuses onto the status
// Anthropic answers the same condition with; the classification table gives
// the rest. PERMISSION_DENIED and FAILED_PRECONDITION (the model is not
// enabled for the project, or outside the account's permissions) refuse the
// model: as 403s they set the model aside on the channel and fail over.
var vertexStatuses = map[string]int{
	"RESOURCE_EXHAUSTED":  http.StatusTooManyRequests,
	"UNAVAILABLE":         529,
	"DEADLINE_EXCEEDED":   http.StatusGatewayTimeout,
	"INTERNAL":            http.StatusInternalServerError,
	"UNKNOWN":             http.StatusInternalServerError,
	"INVALID_ARGUMENT":    http.StatusBadRequest,
	"OUT_OF_RANGE":        http.StatusBadRequest,
	"NOT_FOUND":           http.StatusNotFound,
	"UNAUTHENTICATED":     http.StatusUnauthorized,
	"PERMISSION_DENIED":   http.StatusForbidden,
	"FAILED_PRECONDITION": http.StatusForbidden,
}

// vertexError reads a non-2xx Vertex body: translate is false for an
// Anthropic error, which passes unchanged; otherwise it gives the Anthropic
// status and the message to answer with.
func vertexError(status int, body []byte) (_ int, msg string, translate bool) {
	root := gjson.ParseBytes(body)
	if root.Get("type").String() == "error" && root.Get("error.type").Type == gjson.String {
		return status, "", false
	}
	g := root
	if g.IsArray() {
		g = g.Get("0")
	}
	if e := g.Get("error"); e.IsObject() {
		name := e.Get("status").String()
		msg = "vertex: " + strings.Join(nonEmpty(name, e.Get("message").String()), ": ")
		if st, ok := vertexStatuses[name]; ok {
			return st, msg, true
		}
		return status, msg, true
	}
	msg = fmt.Sprintf("vertex: HTTP %d %s", status, http.StatusText(status))
	if s := strings.Join(strings.Fields(string(body)), " "); s != "" && utf8.ValidString(s) {
		if len(s) > 200 {
			s = s[:200] + "..."
		}
		msg += ": " + s
	}
	return status, msg, true
}

// nonEmpty returns the strings of ss that are not empty.
func nonEmpty(ss ...string) []string {
	return slices.DeleteFunc(ss, func(s string) bool { return s == "" })
}

// Interface guards
var (
	_ provider.GenAINamer      = (*Provider)(nil)
	_ provider.Provider        = (*Provider)(nil)
	_ provider.FeatureSupport  = (*Provider)(nil)
	_ provider.OptionsProvider = (*Provider)(nil)
	_ provider.AccountNamer    = (*Provider)(nil)
	_ caddy.Provisioner        = (*Provider)(nil)
	_ caddyfile.Unmarshaler    = (*Provider)(nil)
	_ caddy.Destructor         = (*vertexAuth)(nil)
)
