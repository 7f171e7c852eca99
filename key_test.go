package relay

import (
	"bufio"
	"bytes"
	"io"
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
