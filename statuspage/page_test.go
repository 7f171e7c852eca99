package statuspage

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestCaddyfile(t *testing.T) {
	for _, c := range []struct{ in, err string }{
		{"relay_status", ""},
		{"relay_status extra", "wrong argument count"},
		{"relay_status {\n\tfoo\n}", "takes no options"},
	} {
		d := caddyfile.NewTestDispenser(c.in)
		err := new(StatusPage).UnmarshalCaddyfile(d)
		if (err == nil) != (c.err == "") || err != nil && !strings.Contains(err.Error(), c.err) {
			t.Errorf("%q: %v, want %q", c.in, err, c.err)
		}
	}
}

// page provisions a page alone, on the test's Source.
func page(t *testing.T) *StatusPage {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: t.Context()})
	t.Cleanup(cancel)
	p := new(StatusPage)
	if err := p.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	return p
}

// serve has p answer a request for path, from the page's own origin.
func serve(t *testing.T, p *StatusPage, method, path string) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest(method, "http://localhost:8088"+path, nil)
	r.Header.Set("Origin", "http://localhost:8088")
	w := httptest.NewRecorder()
	if err := p.ServeHTTP(w, r, nil); err != nil {
		t.Fatal(err)
	}
	return w
}

func TestPageServesItsFilesAndSendsOtherPathsToTheirSlash(t *testing.T) {
	p := page(t)
	for path, mime := range map[string]string{"/": "text/html", "/status.js": "text/javascript", "/status.css": "text/css", "/board/": "text/html"} {
		w := serve(t, p, http.MethodGet, path)
		h := w.Header()
		if w.Code != 200 || !strings.HasPrefix(h.Get("Content-Type"), mime) || h.Get("Content-Security-Policy") != CSP ||
			h.Get("X-Content-Type-Options") != "nosniff" || h.Get("Cache-Control") != "no-store" || w.Body.Len() == 0 {
			t.Errorf("%s: %d %v", path, w.Code, h)
		}
	}
	if w := serve(t, p, http.MethodGet, "/board"); w.Code != http.StatusFound || w.Header().Get("Location") != "./board/" {
		t.Errorf("a path without its slash: %d %q", w.Code, w.Header().Get("Location"))
	}
	if w := serve(t, p, http.MethodPost, "/"); w.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST of the page: %d", w.Code)
	}
}

func TestPageActsThroughItsSource(t *testing.T) {
	testSource.mu.Lock()
	testSource.snap = Snapshot{Channels: []ChannelView{{Channel: Channel{Name: "act-ch", State: "healthy"}}}}
	testSource.acted = nil
	testSource.mu.Unlock()
	p := page(t)
	w := serve(t, p, http.MethodPost, "/channels/act-ch/disable")
	var got map[string]any
	if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &got) != nil || got["name"] != "act-ch" {
		t.Fatalf("disable: %d %s", w.Code, w.Body)
	}
	if _, ok := got["recent"]; ok {
		t.Errorf("an action's answer has the page's recent traffic: %s", w.Body)
	}
	if w := serve(t, p, http.MethodPost, "/channels/nope/disable"); w.Code != http.StatusNotFound {
		t.Errorf("unknown channel: %d", w.Code)
	}
	testSource.mu.Lock()
	defer testSource.mu.Unlock()
	if len(testSource.acted) != 1 || testSource.acted[0] != "act-ch disable" {
		t.Errorf("acted: %v", testSource.acted)
	}
}
