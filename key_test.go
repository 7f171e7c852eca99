package relay

import (
	"bufio"
	"bytes"
	"cmp"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

func TestLiteralKeyIsHashedInConfig(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, channelBlock("lit-a", up.URL)+keyAndGroup("lit", "lit-a"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("status %d", r.status)
	}
	resp, err := client.Get("http://localhost:2999/config/")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if bytes.Contains(cfg, []byte(clientKey)) || !bytes.Contains(cfg, []byte(`"secret":"sha256:`)) {
		t.Errorf("a literal client key must be stored as its sha256: %s", cfg)
	}
}

func TestAKeysSlowClientsWaitForItsSlot(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	// a key of its own: key limits are kept by name across configs
	const key = "sk-slow-slot-client-0123456789"
	startRelay(t, channelBlock("hostile-slot", up.URL)+
		"\t\tkey "+key+" hostile-slot {\n\t\t\tname slow-slot\n\t\t\tconcurrency 1\n\t\t}\n\t\tgroup hostile-slot {\n\t\t\tchannels hostile-slot\n\t\t}\n")
	conn := slowRequest(t, key, 1<<20)
	// the slow request holds the key's one slot while its body trickles
	// in: the next request is refused before its body is read
	var last reply
	deadline := time.Now().Add(5 * time.Second)
	for last = send(t, "POST", "/v1/messages", key, simpleBody); last.status != 429; last = send(t, "POST", "/v1/messages", key, simpleBody) {
		if time.Now().After(deadline) {
			_ = conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
			answer, _ := bufio.NewReader(conn).ReadString('\n')
			t.Fatalf("no request was refused while the slow one should hold the slot (last %d %s; the slow one got %q)", last.status, last.body, answer)
		}
		time.Sleep(10 * time.Millisecond)
	}
	wantRelayError(t, last, 429, "rate_limit_error", "key_rate_limited")
	conn.Close() // the slow client gives up: its slot comes back
	waitFor(t, "the slot back", 5*time.Second, func() bool { return send(t, "POST", "/v1/messages", key, simpleBody).status == 200 })
}

// recorded turns a recorded response into a reply, for wantRelayError.
func recorded(w *httptest.ResponseRecorder) reply {
	return reply{w.Code, w.Header(), w.Body.Bytes()}
}

func TestAKeyStopsWorkingWhenItExpires(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	expires := time.Unix(1_900_000_000, 0).Add(time.Hour) // the fake clock starts at 1_900_000_000
	r, clock := limitRelay(t, "kexp", Key{Expires: expires.Format(time.RFC3339)}, up.URL)
	send := func(path string) *httptest.ResponseRecorder {
		req := newRequest(simpleBody, "sk-kexp")
		if path != "" {
			req = httptest.NewRequest(http.MethodGet, path, nil)
			req.Header.Set("X-Api-Key", "sk-kexp")
		}
		w, _ := serveHandler(t, r, req)
		return w
	}
	if w := send(""); w.Code != 200 {
		t.Fatalf("before its expiry: %d %s", w.Code, w.Body)
	}
	clock.advance(time.Hour - time.Second)
	if w := send(""); w.Code != 200 {
		t.Fatalf("a second before its expiry: %d %s", w.Code, w.Body)
	}
	clock.advance(time.Second)
	for _, path := range []string{"", "/v1/models"} {
		w := send(path)
		wantRelayError(t, recorded(w), 401, "authentication_error", "key_expired")
		body := w.Body.String()
		if !strings.Contains(body, `key \"kexp\" expired at `+expires.UTC().Format(time.RFC3339)) || strings.Contains(body, "sk-kexp") {
			t.Errorf("%s: the message must name the key and its expiry, never the secret: %s", cmp.Or(path, "/v1/messages"), body)
		}
	}
	if up.Hits() != 2 {
		t.Errorf("an expired key's request reached the upstream: %d hits", up.Hits())
	}
}

func TestADisabledKeyIsRefused(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	r, _ := limitRelay(t, "kdis", Key{Disabled: true}, up.URL)
	w, _ := serveHandler(t, r, newRequest(simpleBody, "sk-kdis"))
	wantRelayError(t, recorded(w), 401, "authentication_error", "key_disabled")
	if body := w.Body.String(); !strings.Contains(body, `key \"kdis\" is disabled`) || strings.Contains(body, "sk-kdis") {
		t.Errorf("the message must name the key, never the secret: %s", body)
	}
	if up.Hits() != 0 {
		t.Errorf("a disabled key's request reached the upstream")
	}
	// a wrong key is still only a wrong key
	w, _ = serveHandler(t, r, newRequest(simpleBody, "sk-other"))
	wantRelayError(t, recorded(w), 401, "authentication_error", "")
}
