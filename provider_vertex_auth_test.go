package relay

// Vertex channels against a fake Google token endpoint and a fake Vertex
// AI on 127.0.0.1: a test service account signs its token requests with a
// fresh RSA key, the token endpoint verifies the signature, and the fake
// Vertex accepts only the tokens it issued.

import (
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

func TestVertexTokenIsFetchedOnceAndRefreshedBeforeExpiry(t *testing.T) {
	g := newFakeGoogle(t, 3600)
	vertex := fakeVertex(t, g, fakeupstream.Message("ok"))
	creds := g.serviceAccountFile(t)
	startRelay(t, vertexBlock("vx-once", vertex.URL, creds)+vertexBlock("vx-refresh", vertex.URL, creds)+
		keyAndGroup("vx-once", "vx-once")+
		"\t\tkey sk-vx-refresh vx-refresh\n\t\tgroup vx-refresh {\n\t\t\tchannels vx-refresh\n\t\t}\n")

	// concurrent first requests share one synchronous fetch; later ones read
	// the cached token
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			if r, err := do(http.MethodPost, "/v1/messages", clientKey, simpleBody); err != nil || r.status != 200 {
				errs <- fmt.Errorf("%v %d %s", err, r.status, r.body)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	message(t, simpleBody)
	if n := g.hits.Load(); n != 1 {
		t.Fatalf("token endpoint hits = %d after 9 requests, want 1", n)
	}

	// a short-lived token is replaced in the background, before it expires
	g.expiresIn.Store(2)
	if r := send(t, http.MethodPost, "/v1/messages", "sk-vx-refresh", simpleBody); r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	first := vertex.Last(t).Header.Get("Authorization")
	if first != "Bearer ya29.test-2" {
		t.Fatalf("first token of vx-refresh: %q", first)
	}
	g.awaitHit(t, 3) // the refresher's, with no request waiting on it
	// the refreshed token is current once the refresher has read the
	// endpoint's answer: a request sent meanwhile still carries the old
	// one, which is still usable
	var n int
	var got string
	for deadline := time.Now().Add(time.Second); ; time.Sleep(10 * time.Millisecond) {
		if r := send(t, http.MethodPost, "/v1/messages", "sk-vx-refresh", simpleBody); r.status != 200 {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		// ya29.test-3, or a later one if the refresher went on meanwhile
		got = vertex.Last(t).Header.Get("Authorization")
		if _, err := fmt.Sscanf(got, "Bearer ya29.test-%d", &n); err == nil && n >= 3 || time.Now().After(deadline) {
			break
		}
	}
	if n < 3 {
		t.Errorf("after the refresh the request carried %q, want the refreshed Bearer ya29.test-3", got)
	}
}

func TestVertexWithoutCredentialsFailsOver(t *testing.T) {
	// no credentials_file, and no application default credentials either
	t.Setenv("GOOGLE_APPLICATION_CREDENTIALS", filepath.Join(t.TempDir(), "missing.json"))
	t.Setenv("HOME", t.TempDir())
	vertex := fakeupstream.New(t, fakeupstream.Message("vertex must not be reached"))
	good := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, vertexBlock("vx-adc-a", vertex.URL, "", "priority 1")+channelBlock("vx-adc-b", good.URL, "priority 2")+
		vertexBlock("vx-adc-c", vertex.URL, "")+
		keyAndGroup("vx-adc", "vx-adc-a vx-adc-b")+
		"\t\tkey sk-vx-adc-solo vx-adc-solo\n\t\tgroup vx-adc-solo {\n\t\t\tchannels vx-adc-c\n\t\t}\n")

	r := message(t, simpleBody)
	if r.status != 200 || !strings.Contains(string(r.body), "from anthropic") {
		t.Fatalf("failover: %d %s", r.status, r.body)
	}
	if st := channels(t)["vx-adc-a"]; st.State != stateCooldown || st.LastError != "transient" || !strings.Contains(st.LastErrorReason, "credentials") {
		t.Errorf("vx-adc-a: %+v", st)
	}

	r = send(t, http.MethodPost, "/v1/messages", "sk-vx-adc-solo", simpleBody)
	wantRelayError(t, r, http.StatusBadGateway, "api_error", "")
	if !strings.Contains(string(r.body), "application default credentials were not found") {
		t.Errorf("the reason does not say what is missing: %s", r.body)
	}
	if vertex.Hits() != 0 {
		t.Errorf("a request without a token reached Vertex")
	}
}

func TestVertexTokenRefusalNamesNoKeyMaterial(t *testing.T) {
	g := newFakeGoogle(t, 3600)
	g.refuse.Store(true)
	vertex := fakeVertex(t, g, fakeupstream.Message("unreachable"))
	startRelay(t, vertexBlock("vx-refused", vertex.URL, g.serviceAccountFile(t))+keyAndGroup("vx-refused", "vx-refused"))

	r := message(t, simpleBody)
	wantRelayError(t, r, http.StatusBadGateway, "api_error", "")
	if !strings.Contains(string(r.body), "token endpoint refused the credentials: 400 Bad Request: invalid_grant: Invalid JWT Signature.") {
		t.Errorf("reason: %s", r.body)
	}
	keyLines := strings.Split(strings.TrimSpace(g.keyPEM), "\n")
	for _, secret := range []string{"PRIVATE KEY", keyLines[1], keyLines[len(keyLines)-2], "eyJ"} {
		if strings.Contains(string(r.body), secret) || strings.Contains(channels(t)["vx-refused"].LastErrorReason, secret) {
			t.Errorf("the error shows key material or the assertion (%q)", secret)
		}
	}
	if vertex.Hits() != 0 {
		t.Errorf("a request without a token reached Vertex")
	}
}
