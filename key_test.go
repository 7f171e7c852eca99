package relay

import (
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
	startRelay(t, channelBlock("hostile-slot", up.URL)+
		"\t\tkey "+clientKey+" hostile-slot {\n\t\t\tconcurrency 1\n\t\t}\n\t\tgroup hostile-slot {\n\t\t\tchannels hostile-slot\n\t\t}\n")
	conn := slowRequest(t, clientKey, 1<<20)
	// the slow request holds the key's one slot while its body trickles
	// in: the next request is refused before its body is read
	waitFor(t, "a request refused while the slow one holds the slot", 5*time.Second, func() bool {
		r := message(t, simpleBody)
		if r.status == 429 {
			wantRelayError(t, r, 429, "rate_limit_error", "key_rate_limited")
		}
		return r.status == 429
	})
	conn.Close() // the slow client gives up: its slot comes back
	waitFor(t, "the slot back", 5*time.Second, func() bool { return message(t, simpleBody).status == 200 })
}
