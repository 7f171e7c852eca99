package relay

import (
	"net/http"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

func TestACreateWaitsInTheQueueWhileEveryChannelIsBusy(t *testing.T) {
	store := fakeupstream.NewStore("cq")
	gate, arrived := make(chan struct{}), make(chan struct{}, 1)
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/messages" {
			store.ServeHTTP(w, r)
			return
		}
		arrived <- struct{}{}
		select {
		case <-gate:
		case <-r.Context().Done():
			return
		}
		fakeupstream.Message("ok")(w, r)
	}))
	startRelay(t, channelBlock("cq-ch", up.URL, "concurrency 1")+keyAndGroup("cq", "cq-ch"))

	held := make(chan reply, 1)
	go func() { r, _ := do("POST", "/v1/messages", clientKey, bodyWithID("holder")); held <- r }()
	<-arrived // the channel's one slot is taken
	created := make(chan reply, 1)
	go func() { r, _ := do("POST", "/v1/messages/batches", clientKey, batchBody("one")); created <- r }()
	waitFor(t, "the create queued", 5*time.Second, func() bool { return queueDepth(t, "cq", "normal") == 1 })
	if store.Batches() != 0 {
		t.Fatal("the batch was made on a channel at its concurrency")
	}

	close(gate) // the message ends, and its slot goes to the create
	if r := <-held; r.status != 200 {
		t.Fatalf("the message got %d: %s", r.status, r.body)
	}
	if r := <-created; r.status != 200 || store.Batches() != 1 {
		t.Fatalf("the queued create got %d: %s", r.status, r.body)
	}
}

func TestACreateAvoidsTheHostThatAnswered529(t *testing.T) {
	overloaded := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	up, store := storeUpstream(t, "ah")
	// ah-b is second by priority, but on the host that just answered 529
	startRelay(t, channelBlock("ah-a", overloaded.URL, "priority 1")+channelBlock("ah-b", overloaded.URL, "priority 2")+
		channelBlock("ah-c", up.URL, "priority 3")+keyAndGroup("ah", "ah-a ah-b ah-c", "retries 1"))
	r := send(t, "POST", "/v1/messages/batches", clientKey, batchBody("one"))
	if r.status != 200 || store.Batches() != 1 {
		t.Fatalf("create after a 529: %d %s", r.status, r.body)
	}
	if n := hitsOn(overloaded, "/v1/messages/batches"); n != 1 {
		t.Errorf("the overloaded host was asked %d times, want once", n)
	}
	if got := r.header.Get("X-Relay-Attempts"); got != "2" {
		t.Errorf("X-Relay-Attempts %q, want 2", got)
	}
}
