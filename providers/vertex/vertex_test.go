package vertex

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"strings"
	"testing"
	"time"
)

const vertexTestEmail = "relay-test@p.iam.gserviceaccount.com"

func TestVertexEndpointByRegion(t *testing.T) {
	for region, want := range map[string]string{
		"global":       "https://aiplatform.googleapis.com",
		"us":           "https://aiplatform.us.rep.googleapis.com",
		"eu":           "https://aiplatform.eu.rep.googleapis.com",
		"us-east5":     "https://us-east5-aiplatform.googleapis.com",
		"europe-west1": "https://europe-west1-aiplatform.googleapis.com",
	} {
		if got := vertexEndpoint(region); got != want {
			t.Errorf("vertexEndpoint(%q) = %q, want %q", region, got, want)
		}
		if !validVertexRegion(region) {
			t.Errorf("region %q refused", region)
		}
	}
	for _, bad := range []string{"", "us-east5/x", "US-EAST5", "-us", "us.east", "evil.com#"} {
		if validVertexRegion(bad) {
			t.Errorf("region %q accepted", bad)
		}
	}
}

func TestCheckGoogleCredentials(t *testing.T) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	pkcs1 := string(pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}))
	sa := func(email, key string) string {
		b, _ := json.Marshal(map[string]string{"type": "service_account", "client_email": email, "private_key": key})
		return string(b)
	}
	for _, c := range []struct {
		file string
		want string // in the error; empty: accepted
	}{
		{sa(vertexTestEmail, pkcs1), ""},
		{`{"type":"authorized_user","client_id":"c","client_secret":"s","refresh_token":"r"}`, ""},
		{`not json`, "not a Google credentials file"},
		{`{"type":"api_key"}`, `credentials type "api_key" is not supported`},
		{sa("", pkcs1), "no client_email"},
		{sa(vertexTestEmail, "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw"), "not a PEM key"},
		{sa(vertexTestEmail, "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcw\n-----END PRIVATE KEY-----\n"), "does not parse"},
	} {
		err := checkGoogleCredentials([]byte(c.file))
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("checkGoogleCredentials(%.40s...) = %v, want %q", c.file, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "MIIE") {
			t.Errorf("the error quotes the key: %v", err)
		}
	}
}

func TestVertexRefresherStopsWithItsLastConfig(t *testing.T) {
	a := newVertexAuth("vx-stop", nil)
	if err := a.Destruct(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.done:
	case <-time.After(10 * time.Second):
		t.Fatal("the refresher did not stop")
	}
}
