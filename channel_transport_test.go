package relay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddy-relay/relay/internal/upstreamconn"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
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

// A channel's transport dials upstreamconn.Conns, and bodies of every size
// (under, across and far over the write buffer and the copy buffer) arrive
// byte for byte.
func TestChannelTransportCopiesBodiesThroughPooledBuffers(t *testing.T) {
	srv := bodyHashServer(t)
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-conn", Group: "conn", KeyOptions: KeyOptions{Name: "conn"}}},
		Channels: []*Channel{{Name: "conn", UpstreamRaw: upstream("anthropic", "url", srv.URL, "api_key", channelKey)}},
		Groups:   []*Group{{Name: "conn", Channels: []string{"conn"}}},
	}
	provisionHandler(t, r)
	ht, ok := r.groups["conn"].channels[0].rt.(*reverseproxy.HTTPTransport)
	if !ok {
		t.Fatalf("the channel's transport is a %T, not Caddy's", r.groups["conn"].channels[0].rt)
	}
	tr := ht.Transport
	c, err := tr.DialContext(context.Background(), "tcp", strings.TrimPrefix(srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if _, ok := c.(upstreamconn.Conn); !ok {
		t.Fatalf("the channel's transport dials %T, not an upstreamconn.Conn", c)
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

// countingConn counts the writes of a connection.
type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// A channel's upstream connections write a request of a few KB, headers
// and body, in one write (one system call), where net/http's 4 KiB buffer
// took two; a transport block's write_buffer_size still decides.
func TestChannelTransportWritesASmallRequestAtOnce(t *testing.T) {
	srv := bodyHashServer(t)
	for _, tc := range []struct {
		transport string
		writes    int64
	}{
		{"", 1},
		{`{"protocol":"http","write_buffer_size":4096}`, 2},
	} {
		ch := &Channel{Name: "writes", UpstreamRaw: upstream("anthropic", "url", srv.URL, "api_key", channelKey)}
		if tc.transport != "" {
			ch.TransportRaw = json.RawMessage(tc.transport)
		}
		r := &Relay{
			Keys:     []*Key{{Secret: "sk-writes", Group: "writes", KeyOptions: KeyOptions{Name: "writes"}}},
			Channels: []*Channel{ch},
			Groups:   []*Group{{Name: "writes", Channels: []string{"writes"}}},
		}
		provisionHandler(t, r)
		ht := r.groups["writes"].channels[0].rt.(*reverseproxy.HTTPTransport)
		var writes atomic.Int64
		tr := ht.Transport.Clone()
		dial := tr.DialContext
		tr.DialContext = func(ctx context.Context, network, address string) (net.Conn, error) {
			c, err := dial(ctx, network, address)
			if err != nil {
				return nil, err
			}
			return countingConn{c, &writes}, nil
		}
		body := bytes.Repeat([]byte("0123456789"), 1024)
		sum := sha256.Sum256(body)
		if got := post(t, tr, srv.URL, body); got != hex.EncodeToString(sum[:]) {
			t.Fatalf("transport %q: the body arrived as %q, want its digest %x", tc.transport, got, sum)
		}
		tr.CloseIdleConnections()
		if got := writes.Load(); got != tc.writes {
			t.Errorf("transport %q: a 10 KB request took %d writes, want %d", tc.transport, got, tc.writes)
		}
	}
}
