package relay

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

	"github.com/caddyserver/caddy/v2"
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

// defaultVertexStrip are the top-level fields Vertex does not know.
var defaultVertexStrip = []string{"service_tier", "inference_geo", "speed"}

// vertexProvider speaks Vertex AI's rawPredict wire: the model in the URL,
// anthropic_version in the body, betas in the anthropic-beta header, a
// Google OAuth2 access token, Google-shaped errors.
type vertexProvider struct {
	models      string   // .../publishers/anthropic/models/, to which {model}:{method} is appended
	version     string   // anthropic_version when the body has none
	strip       []string // removed from every body
	stripModels []string // removed from Messages bodies: model, then strip
	betas       []string // anthropic-beta flags allowed; "*": all
	auth        *vertexAuth
}

// provisionVertex sets up a channel to Google Vertex AI. It reads and checks
// the credentials but fetches no token: `caddy validate` provisions without
// network, and missing application default credentials fail requests (which
// fail over), not the config.
func (r *Relay) provisionVertex(ctx caddy.Context, cfg *Channel, ch *channel) error {
	if !validVertexRegion(cfg.Region) {
		return fmt.Errorf("region %q is not a Google Cloud region (us-east5, europe-west1, global, us, eu...)", cfg.Region)
	}
	base := cmp.Or(strings.TrimSuffix(cfg.URL, "/"), vertexEndpoint(cfg.Region))
	u, err := url.Parse(base)
	if err != nil {
		return fmt.Errorf("url: %v", err)
	}
	auth, err := r.vertexAuth(ctx, cfg)
	if err != nil {
		return err
	}
	if ch.rt, err = r.loadTransport(ctx, cfg, u.Scheme == "https"); err != nil {
		return err
	}
	strip := cfg.StripFields
	if len(strip) == 0 {
		strip = defaultVertexStrip
	}
	betas := cfg.Betas
	if len(betas) == 0 {
		betas = []string{"*"}
	}
	ch.host = u.Host
	ch.provider = vertexProvider{
		models: base + "/v1/projects/" + url.PathEscape(cfg.Project) + "/locations/" + url.PathEscape(cfg.Region) +
			"/publishers/anthropic/models/",
		version:     cmp.Or(cfg.AnthropicVersion, vertexVersion),
		strip:       strip,
		stripModels: append([]string{"model"}, strip...),
		betas:       betas,
		auth:        auth,
	}
	return nil
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

// newRequest implements provider. Messages go to {model}:rawPredict or
// :streamRawPredict without their model; token counts go to
// count-tokens:rawPredict with it. The query string (?beta=true) has no
// meaning on Vertex and stays behind.
func (p vertexProvider) newRequest(ctx context.Context, ch *channel, in *inbound) (*http.Request, error) {
	var u string
	var body []byte
	var err error
	if in.route == routeCountTokens {
		u = p.models + "count-tokens:rawPredict"
		if body, err = vertexCountBody(in.bodyFor(ch), ch.upstreamModel(in.target)); err == nil {
			body, err = cloudBody(body, p.version, p.strip)
		}
	} else {
		method := ":rawPredict"
		if in.stream {
			method = ":streamRawPredict"
		}
		u = p.models + url.PathEscape(ch.upstreamModel(in.target)) + method
		body, err = cloudBody(in.body, p.version, p.stripModels)
	}
	if err != nil {
		return nil, fmt.Errorf("vertex: rewriting the body: %v", err)
	}
	token, err := p.auth.token(ctx)
	if err != nil {
		return nil, err
	}
	ctx, rd, getBody := in.upstreamBody(ctx, body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, rd)
	if err != nil {
		return nil, err
	}
	req.GetBody = getBody
	forwardHeaders(req.Header, in.header)
	req.Header.Del("Anthropic-Beta")
	if betas := betasFor(in.header, p.betas); len(betas) > 0 {
		req.Header.Set("Anthropic-Beta", strings.Join(betas, ","))
	}
	req.Header.Set("Authorization", "Bearer "+token)
	return req, nil
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

// response implements provider. Successes (SSE included) are Anthropic's
// wire already, and so are the model's own errors; Google's platform errors
// ({"error":{"code","message","status"}}, sometimes in an array) become the
// Anthropic error the classification table and the SDKs expect.
func (vertexProvider) response(resp *http.Response, _ *inbound) (*http.Response, error) {
	if resp.StatusCode >= 200 && resp.StatusCode <= 299 {
		return resp, nil
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	if err != nil {
		return nil, err
	}
	status, typ, msg, translate := vertexError(resp.StatusCode, body)
	if !translate {
		out := *resp
		out.Body = io.NopCloser(bytes.NewReader(body))
		return &out, nil
	}
	// every URL names the model, and a bad credential is UNAUTHENTICATED
	// (401): a 403 refuses the model
	return asAnthropicError(resp, status, typ, msg, "", status == http.StatusForbidden), nil
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
// status, type and message to answer with.
func vertexError(status int, body []byte) (_ int, typ, msg string, translate bool) {
	root := gjson.ParseBytes(body)
	if root.Get("type").String() == "error" && root.Get("error.type").Type == gjson.String {
		return status, "", "", false
	}
	g := root
	if g.IsArray() {
		g = g.Get("0")
	}
	if e := g.Get("error"); e.IsObject() {
		name := e.Get("status").String()
		msg = "vertex: " + strings.Join(nonEmpty(name, e.Get("message").String()), ": ")
		if st, ok := vertexStatuses[name]; ok {
			return st, anthropicType(st), msg, true
		}
		return status, anthropicType(status), msg, true
	}
	msg = fmt.Sprintf("vertex: HTTP %d %s", status, http.StatusText(status))
	if s := strings.Join(strings.Fields(string(body)), " "); s != "" && utf8.ValidString(s) {
		if len(s) > 200 {
			s = s[:200] + "..."
		}
		msg += ": " + s
	}
	return status, anthropicType(status), msg, true
}

// nonEmpty returns the strings of ss that are not empty.
func nonEmpty(ss ...string) []string {
	return slices.DeleteFunc(ss, func(s string) bool { return s == "" })
}

// Interface guards
var (
	_ provider         = vertexProvider{}
	_ caddy.Destructor = (*vertexAuth)(nil)
)
