package vertex

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
	"golang.org/x/oauth2"
	"golang.org/x/oauth2/google"
)

// vertexAuths keeps each vertex channel's credentials and access token
// across config reloads, by channel name and credentials, so a reload costs
// no token fetch on the request path.
var vertexAuths = caddy.NewUsagePool()

// loadVertexAuth returns the token keeper of the channel ctx provisions,
// from the pool, and gives it back when the config ends.
func loadVertexAuth(ctx caddy.Context, credentialsFile string) (*vertexAuth, error) {
	name := provider.ChannelOf(ctx)
	var creds []byte // nil: application default credentials
	if credentialsFile != "" {
		path, err := provider.ResolvePlaceholders(credentialsFile)
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
	key := name + "\x00" + hex.EncodeToString(sum[:])
	if creds == nil {
		key = name + "\x00adc"
	}
	v, _, err := vertexAuths.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newVertexAuth(name, creds), nil
	})
	if err != nil {
		return nil, err
	}
	a := v.(*vertexAuth)
	a.logger.Store(ctx.Logger())
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
