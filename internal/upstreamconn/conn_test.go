package upstreamconn

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"

	"github.com/caddy-relay/relay/internal/memtest"
)

// bodyHashServer answers each request with the SHA-256 of its body.
func bodyHashServer(t testing.TB) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := sha256.New()
		_, _ = io.Copy(h, r.Body)
		_, _ = io.WriteString(w, hex.EncodeToString(h.Sum(nil)))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// post sends body to url over tr and returns the answer.
func post(t testing.TB, tr http.RoundTripper, url string, body []byte) string {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

// A transport with PooledCopies dials Conns, and bodies of every size
// (under, across and far over the write buffer and the copy buffer)
// arrive byte for byte.
func TestBodiesArriveWhole(t *testing.T) {
	srv := bodyHashServer(t)
	tr := &http.Transport{DialContext: (&net.Dialer{}).DialContext}
	defer tr.CloseIdleConnections()
	PooledCopies(tr)
	c, err := tr.DialContext(t.Context(), "tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, ok := c.(Conn); !ok {
		t.Fatalf("the transport dials %T, not a Conn", c)
	}
	for _, n := range []int{0, 100, 4000, 4096, 10 << 10, 32 << 10, 100<<10 + 7, 1 << 20} {
		body := make([]byte, n)
		for i := range body {
			body[i] = byte(i*7 + n)
		}
		sum := sha256.Sum256(body)
		if got := post(t, tr, srv.URL, body); got != hex.EncodeToString(sum[:]) {
			t.Fatalf("a body of %d bytes arrived as %q, want its digest %x", n, got, sum)
		}
	}
}

// A 10 KB body sent over a transport with PooledCopies allocates at least
// 5 KB less than over the same transport without: the copy of what does
// not fit the 4 KiB write buffer no longer allocates its own buffer.
func TestAllocationPooledBodyCopies(t *testing.T) {
	if memtest.Race {
		t.Skip("the race detector allocates for itself")
	}
	srv := bodyHashServer(t)
	body := bytes.Repeat([]byte("0123456789"), 1024)
	perRequest := func(pooled bool) float64 {
		tr := &http.Transport{DialContext: (&net.Dialer{}).DialContext, MaxIdleConnsPerHost: 4}
		defer tr.CloseIdleConnections()
		if pooled {
			PooledCopies(tr)
		}
		post(t, tr, srv.URL, body) // the connection, and the pools, warm
		const n = 200
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for range n {
			post(t, tr, srv.URL, body)
		}
		runtime.ReadMemStats(&after)
		return float64(after.TotalAlloc-before.TotalAlloc) / n
	}
	without, with := perRequest(false), perRequest(true)
	t.Logf("bytes allocated per 10 KB request: %.0f without, %.0f with pooled copies", without, with)
	if without-with < 5000 {
		t.Fatalf("pooled copies saved %.0f bytes a request (%.0f against %.0f), want at least 5000", without-with, with, without)
	}
}
