package relay

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
	"go.uber.org/zap"
	"golang.org/x/oauth2"
	"golang.org/x/oauth2/google"
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

// vertexStatuses maps Google's canonical error statuses onto Anthropic's
// errors. PERMISSION_DENIED and FAILED_PRECONDITION (the model is not enabled
// for the project, or outside the account's permissions) refuse the model:
// as 403s they set the model aside on the channel and fail over.
var vertexStatuses = map[string]struct {
	status int
	typ    string
}{
	"RESOURCE_EXHAUSTED":  {http.StatusTooManyRequests, "rate_limit_error"},
	"UNAVAILABLE":         {529, "overloaded_error"},
	"DEADLINE_EXCEEDED":   {http.StatusGatewayTimeout, "timeout_error"},
	"INTERNAL":            {http.StatusInternalServerError, "api_error"},
	"UNKNOWN":             {http.StatusInternalServerError, "api_error"},
	"INVALID_ARGUMENT":    {http.StatusBadRequest, "invalid_request_error"},
	"OUT_OF_RANGE":        {http.StatusBadRequest, "invalid_request_error"},
	"NOT_FOUND":           {http.StatusNotFound, "not_found_error"},
	"UNAUTHENTICATED":     {http.StatusUnauthorized, "authentication_error"},
	"PERMISSION_DENIED":   {http.StatusForbidden, "permission_error"},
	"FAILED_PRECONDITION": {http.StatusForbidden, "permission_error"},
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
		if m, ok := vertexStatuses[name]; ok {
			return m.status, m.typ, msg, true
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

// vertexAuths keeps each vertex channel's credentials and access token
// across config reloads, by channel name and credentials, so a reload costs
// no token fetch on the request path.
var vertexAuths = caddy.NewUsagePool()

// vertexAuth returns the channel's token keeper, from the pool, and gives it
// back when the config ends.
func (r *Relay) vertexAuth(ctx caddy.Context, cfg *Channel) (*vertexAuth, error) {
	var creds []byte // nil: application default credentials
	if cfg.CredentialsFile != "" {
		path, err := resolveSecret(cfg.CredentialsFile)
		if err != nil {
			return nil, fmt.Errorf("credentials_file: %w", err)
		}
		if creds, err = os.ReadFile(path); err != nil {
			return nil, fmt.Errorf("credentials_file: %v", err)
		}
		if err := checkGoogleCredentials(creds); err != nil {
			return nil, fmt.Errorf("credentials_file %s: %v", path, err)
		}
	}
	sum := sha256.Sum256(creds)
	key := cfg.Name + "\x00" + hex.EncodeToString(sum[:])
	if creds == nil {
		key = cfg.Name + "\x00adc"
	}
	v, _, err := vertexAuths.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newVertexAuth(cfg.Name, creds), nil
	})
	if err != nil {
		return nil, err
	}
	a := v.(*vertexAuth)
	a.logger.Store(r.logger)
	go func() {
		<-ctx.Done()
		_, _ = vertexAuths.Delete(key)
	}()
	return a, nil
}

// vertexCredentialTypes are the credential files a channel takes (Google
// advises loading only the types one expects).
var vertexCredentialTypes = []google.CredentialsType{google.ServiceAccount, google.AuthorizedUser,
	google.ExternalAccount, google.ExternalAccountAuthorizedUser, google.ImpersonatedServiceAccount}

// checkGoogleCredentials checks a credentials file without using it: its
// type, and for a service account its email and private key, so a broken
// file fails the config rather than every request. No error quotes the file.
func checkGoogleCredentials(data []byte) error {
	var f struct {
		Type        string `json:"type"`
		ClientEmail string `json:"client_email"`
		PrivateKey  string `json:"private_key"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		return fmt.Errorf("not a Google credentials file (JSON): %v", err)
	}
	if !slices.Contains(vertexCredentialTypes, google.CredentialsType(f.Type)) {
		return fmt.Errorf("credentials type %q is not supported (service_account, authorized_user, external_account, external_account_authorized_user, impersonated_service_account)", f.Type)
	}
	if f.Type != string(google.ServiceAccount) {
		return nil
	}
	if f.ClientEmail == "" {
		return fmt.Errorf("the service account has no client_email")
	}
	block, _ := pem.Decode([]byte(f.PrivateKey))
	if block == nil {
		return fmt.Errorf("the service account's private_key is not a PEM key")
	}
	if _, err := x509.ParsePKCS8PrivateKey(block.Bytes); err != nil {
		if _, err1 := x509.ParsePKCS1PrivateKey(block.Bytes); err1 != nil {
			return fmt.Errorf("the service account's private_key does not parse (PKCS#8 or PKCS#1)")
		}
	}
	return nil
}

// vertexAuth keeps a channel's access token current. Requests read the
// cached token without waiting; a background refresher replaces it before
// it expires. Only when there is no usable token (the first request, or
// after refreshes failed until it expired) do requests wait for one, all
// for the same fetch.
//
// Every fetch builds a fresh token source from the credentials: the sources
// of golang.org/x/oauth2/google cache their token inside an
// oauth2.ReuseTokenSource that hands it out until ten seconds before its
// expiry, and cannot be told to refresh it any sooner.
type vertexAuth struct {
	name     string
	creds    []byte          // the credentials file; nil: application default credentials
	ctx      context.Context // of the token requests: carries their HTTP client
	cur      atomic.Pointer[vertexToken]
	mu       sync.Mutex
	inflight *tokenFetch   // guarded by mu
	fetched  chan struct{} // a new token is current: the refresher reschedules
	logger   atomic.Pointer[zap.Logger]
	stop     context.CancelFunc
	done     chan struct{} // closed when the refresher has stopped
}

func newVertexAuth(name string, creds []byte) *vertexAuth {
	ctx, stop := context.WithCancel(context.Background())
	a := &vertexAuth{
		name:  name,
		creds: creds,
		// the token endpoint is Google's, not the channel's upstream: its
		// own client, bounded so a hung endpoint cannot hold requests
		ctx:     context.WithValue(ctx, oauth2.HTTPClient, &http.Client{Timeout: vertexTokenTimeout}),
		fetched: make(chan struct{}, 1),
		stop:    stop,
		done:    make(chan struct{}),
	}
	a.logger.Store(zap.NewNop())
	go a.refresh(ctx)
	return a
}

// Destruct implements caddy.Destructor: the last config using the channel
// is gone.
func (a *vertexAuth) Destruct() error {
	a.stop()
	return nil
}

// vertexToken is an access token and when it was fetched.
type vertexToken struct {
	tok *oauth2.Token
	at  time.Time
}

// lifetime is how long the token was valid for when it came.
func (t *vertexToken) lifetime() time.Duration { return t.tok.Expiry.Sub(t.at) }

// usable reports whether requests may still send the token: until shortly
// before its expiry (10s, or a quarter of a shorter lifetime).
func (t *vertexToken) usable(now time.Time) bool {
	if t == nil || t.tok.AccessToken == "" {
		return false
	}
	if t.tok.Expiry.IsZero() {
		return true
	}
	return now.Before(t.tok.Expiry.Add(-min(10*time.Second, t.lifetime()/4)))
}

// refreshAt is when the refresher replaces the token: vertexRefreshMargin
// before its expiry, or halfway through a shorter lifetime (a metadata
// server may hand out a token with only minutes left).
func (t *vertexToken) refreshAt() time.Time {
	return t.tok.Expiry.Add(-min(vertexRefreshMargin, t.lifetime()/2))
}

// token returns an access token for a request: the cached one, else the
// one being fetched. ctx ends the wait, not the fetch.
func (a *vertexAuth) token(ctx context.Context) (string, error) {
	if t := a.cur.Load(); t.usable(time.Now()) {
		return t.tok.AccessToken, nil
	}
	f := a.fetching(false)
	select {
	case <-f.done:
		return f.tok, f.err
	case <-ctx.Done():
		return "", context.Cause(ctx)
	}
}

// tokenFetch is one token request to Google, shared by all who wait for it.
type tokenFetch struct {
	done chan struct{} // closed when tok or err is set
	tok  string
	err  error
}

// fetching returns the fetch in flight, starting one if there is none. A
// request (force false) that finds a usable token fetched meanwhile gets
// that one.
func (a *vertexAuth) fetching(force bool) *tokenFetch {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inflight != nil {
		return a.inflight
	}
	f := &tokenFetch{done: make(chan struct{})}
	if t := a.cur.Load(); !force && t.usable(time.Now()) {
		f.tok = t.tok.AccessToken
		close(f.done)
		return f
	}
	a.inflight = f
	go func() {
		tok, err := a.fetch()
		if err == nil {
			f.tok = tok.AccessToken
		}
		f.err = err
		a.mu.Lock()
		a.inflight = nil
		a.mu.Unlock()
		close(f.done)
	}()
	return f
}

// fetch gets a new token from Google and makes it current.
func (a *vertexAuth) fetch() (*oauth2.Token, error) {
	src, err := a.source()
	if err != nil {
		return nil, err
	}
	tok, err := src.Token()
	if err != nil {
		return nil, tokenError(err)
	}
	a.cur.Store(&vertexToken{tok: tok, at: time.Now()})
	select {
	case a.fetched <- struct{}{}:
	default:
	}
	return tok, nil
}

// source returns a token source of the channel's credentials that holds no
// token yet.
func (a *vertexAuth) source() (oauth2.TokenSource, error) {
	if a.creds == nil {
		creds, err := google.FindDefaultCredentials(a.ctx, vertexScope)
		if err != nil {
			return nil, fmt.Errorf("vertex: no Google credentials: the channel has no credentials_file and application default credentials were not found (%v)", err)
		}
		return creds.TokenSource, nil
	}
	var f struct {
		Type string `json:"type"`
	}
	_ = json.Unmarshal(a.creds, &f) // checked when provisioned
	creds, err := google.CredentialsFromJSONWithType(a.ctx, a.creds, google.CredentialsType(f.Type), vertexScope)
	if err != nil {
		return nil, fmt.Errorf("vertex: credentials_file: %v", err)
	}
	return creds.TokenSource, nil
}

// tokenError says why no token came, without the token endpoint's whole
// answer: its status and OAuth2 error code and description.
func tokenError(err error) error {
	var re *oauth2.RetrieveError
	if !errors.As(err, &re) {
		return fmt.Errorf("vertex: no access token: %v", err)
	}
	var status string
	if re.Response != nil {
		status = re.Response.Status
	}
	code := cmp.Or(re.ErrorCode, gjson.GetBytes(re.Body, "error").String())
	desc := cmp.Or(re.ErrorDescription, gjson.GetBytes(re.Body, "error_description").String())
	if len(desc) > 200 {
		desc = desc[:200] + "..."
	}
	return errors.New(strings.Join(nonEmpty("vertex: the token endpoint refused the credentials", status, code, desc), ": "))
}

// refresh replaces the current token before it expires, until ctx ends.
// A failed refresh is retried with backoff while the token is usable; once
// it is not, requests fetch on their own.
func (a *vertexAuth) refresh(ctx context.Context) {
	defer close(a.done)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	failures := 0
	for {
		var due <-chan time.Time
		now := time.Now()
		if t := a.cur.Load(); t.usable(now) && !t.tok.Expiry.IsZero() {
			wait := t.refreshAt().Sub(now)
			if failures > 0 {
				wait = min(time.Second<<min(failures-1, 6), time.Minute)
			}
			timer.Reset(max(wait, time.Second))
			due = timer.C
		}
		select {
		case <-ctx.Done():
			return
		case <-a.fetched:
			failures = 0
		case <-due:
			f := a.fetching(true)
			select {
			case <-ctx.Done():
				return
			case <-f.done:
			}
			if f.err != nil {
				failures++
				a.logger.Load().Warn("vertex: refreshing the access token failed; the current one is used until it expires",
					zap.String("channel", a.name), zap.Error(f.err))
			}
		}
	}
}

// Interface guards
var (
	_ provider         = vertexProvider{}
	_ caddy.Destructor = (*vertexAuth)(nil)
)
