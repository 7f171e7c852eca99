package providertest

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// VertexEmail is the test service account's.
const VertexEmail = "relay-test@p.iam.gserviceaccount.com"

// FakeGoogle is Google's OAuth2 token endpoint on 127.0.0.1, for one test
// service account, which signs its token requests with a fresh RSA key:
// the endpoint verifies the signature and issues tokens named
// ya29.test-<n>, n the number of the request.
type FakeGoogle struct {
	*httptest.Server
	// KeyPEM is the service account's private key.
	KeyPEM string
	// ExpiresIn is the lifetime, in seconds, of the tokens to come.
	ExpiresIn atomic.Int64
	// Refuse makes it answer 400 invalid_grant.
	Refuse atomic.Bool
	// Hits counts the token requests.
	Hits atomic.Int64

	key *rsa.PrivateKey
	hit chan int64 // the number of each hit, as it is answered

	mu     sync.Mutex
	issued map[string]bool
	errs   []string
}

// NewFakeGoogle starts a token endpoint whose tokens last expiresIn
// seconds, and stops it when the test ends; a request it could not verify
// fails the test then.
func NewFakeGoogle(t testing.TB, expiresIn int64) *FakeGoogle {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	g := &FakeGoogle{key: key, hit: make(chan int64, 64), issued: map[string]bool{},
		KeyPEM: string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}))}
	g.ExpiresIn.Store(expiresIn)
	g.Server = httptest.NewServer(http.HandlerFunc(g.serve))
	t.Cleanup(g.Close)
	t.Cleanup(func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		for _, e := range g.errs {
			t.Errorf("token endpoint: %s", e)
		}
	})
	return g
}

// TokenURL is the endpoint's URL, the service account's token_uri.
func (g *FakeGoogle) TokenURL() string { return g.URL + "/token" }

// serve answers a JWT-bearer token request whose assertion the service
// account's key signed.
func (g *FakeGoogle) serve(w http.ResponseWriter, r *http.Request) {
	n := g.Hits.Add(1)
	if err := g.verify(r); err != nil {
		g.mu.Lock()
		g.errs = append(g.errs, err.Error())
		g.mu.Unlock()
		http.Error(w, `{"error":"invalid_request"}`, http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if g.Refuse.Load() {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":"invalid_grant","error_description":"Invalid JWT Signature."}`)
		g.signal(n)
		return
	}
	tok := fmt.Sprintf("ya29.test-%d", n)
	g.mu.Lock()
	g.issued[tok] = true
	g.mu.Unlock()
	_, _ = fmt.Fprintf(w, `{"access_token":%q,"expires_in":%d,"token_type":"Bearer"}`, tok, g.ExpiresIn.Load())
	g.signal(n)
}

// signal reports hit n, never blocking: a refresher may go on fetching
// after its test stopped listening.
func (g *FakeGoogle) signal(n int64) {
	select {
	case g.hit <- n:
	default:
	}
}

func (g *FakeGoogle) verify(r *http.Request) error {
	if r.Method != http.MethodPost || r.URL.Path != "/token" {
		return fmt.Errorf("%s %s, want POST /token", r.Method, r.URL.Path)
	}
	if err := r.ParseForm(); err != nil {
		return err
	}
	if gt := r.PostForm.Get("grant_type"); gt != "urn:ietf:params:oauth:grant-type:jwt-bearer" {
		return fmt.Errorf("grant_type %q", gt)
	}
	parts := strings.Split(r.PostForm.Get("assertion"), ".")
	if len(parts) != 3 {
		return fmt.Errorf("assertion is not a JWT")
	}
	var header struct{ Alg, Typ string }
	var claims struct {
		Iss, Scope, Aud string
		Iat, Exp        int64
	}
	for i, dst := range []any{&header, &claims} {
		raw, err := base64.RawURLEncoding.DecodeString(parts[i])
		if err != nil {
			return fmt.Errorf("JWT part %d: %v", i, err)
		}
		if err := json.Unmarshal(raw, dst); err != nil {
			return fmt.Errorf("JWT part %d: %v", i, err)
		}
	}
	sig, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil {
		return fmt.Errorf("JWT signature: %v", err)
	}
	digest := sha256.Sum256([]byte(parts[0] + "." + parts[1]))
	if header.Alg != "RS256" || rsa.VerifyPKCS1v15(&g.key.PublicKey, crypto.SHA256, digest[:], sig) != nil {
		return fmt.Errorf("JWT signature does not verify with the service account's key (alg %q)", header.Alg)
	}
	if claims.Iss != VertexEmail || claims.Aud != g.TokenURL() || claims.Scope != "https://www.googleapis.com/auth/cloud-platform" {
		return fmt.Errorf("JWT claims %+v", claims)
	}
	if now := time.Now().Unix(); claims.Exp <= now || claims.Iat > now+5 {
		return fmt.Errorf("JWT times iat %d exp %d, now %d", claims.Iat, claims.Exp, now)
	}
	return nil
}

// Valid reports whether the token endpoint issued token.
func (g *FakeGoogle) Valid(token string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.issued[token]
}

// AwaitHit waits for the token endpoint's hit number n.
func (g *FakeGoogle) AwaitHit(t testing.TB, n int64) {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case got := <-g.hit:
			if got >= n {
				return
			}
		case <-timeout:
			t.Fatalf("the token endpoint got no request #%d (hits: %d)", n, g.Hits.Load())
		}
	}
}

// ServiceAccountFile writes the test service account's key file, its
// token_uri pointing at g, and returns its path.
func (g *FakeGoogle) ServiceAccountFile(t testing.TB) string {
	t.Helper()
	b, _ := json.Marshal(map[string]string{
		"type": "service_account", "project_id": "p", "private_key_id": "key-1", "private_key": g.KeyPEM,
		"client_email": VertexEmail, "client_id": "1", "token_uri": g.TokenURL(),
	})
	path := filepath.Join(t.TempDir(), "sa.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// NewFakeVertex starts a Vertex AI endpoint that answers with h, after
// checking the bearer token as Vertex would: one g issued, or a
// Google-shaped 401.
func NewFakeVertex(t testing.TB, g *FakeGoogle, h http.HandlerFunc) *fakeupstream.Upstream {
	return fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); !ok || !g.Valid(tok) {
			fakeupstream.Raw(401, []byte(`{"error":{"code":401,"message":"Request had invalid authentication credentials.","status":"UNAUTHENTICATED"}}`))(w, r)
			return
		}
		h(w, r)
	}))
}

// GoogleError answers with a Google platform error, wrapped in an array as
// Vertex sometimes sends it when wrapped is true.
func GoogleError(code int, status, msg string, wrapped bool) http.HandlerFunc {
	b := fmt.Sprintf(`{"error":{"code":%d,"message":%q,"status":%q}}`, code, msg, status)
	if wrapped {
		b = "[" + b + "]"
	}
	return fakeupstream.Raw(code, []byte(b))
}
