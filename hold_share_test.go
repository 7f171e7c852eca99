package relay

import (
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"

	"github.com/caddy-relay/relay/internal/money"
)

// shareRelay is a relay whose one channel, on a gated upstream, has a $1
// daily cap and serves groups <name>-a and <name>-b (of max_queue
// bQueue; 0: the default), each with a key sk-<name>-a, sk-<name>-b. Its
// model m-hold costs $15 per million output tokens.
func shareRelay(t *testing.T, prefix string, bQueue int) (*Relay, string, *gate) {
	t.Helper()
	name := prefix + "-" + strconv.FormatInt(holdRelays.Add(1), 10)
	g := newGate()
	up := fakeupstream.New(t, g)
	t.Cleanup(g.openAll)
	r := &Relay{
		Pricing: map[string]Price{"m-hold": {Input: 0, Output: 15}},
		Channels: []*Channel{{Name: name, SpendCaps: []string{"1usd/day"},
			UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", fakeupstream.Key)}},
		Groups: []*Group{{Name: name + "-a", Channels: []string{name}}, {Name: name + "-b", Channels: []string{name}, MaxQueue: bQueue}},
	}
	for _, k := range []string{"a", "b"} {
		r.Keys = append(r.Keys, &Key{Secret: "sk-" + name + "-" + k, Group: name + "-" + k, KeyOptions: KeyOptions{Name: name + "-" + k}})
	}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 12, 0, 0, 0, time.UTC)}
	r.now = clock.now
	return r, name, g
}

// TestOneGroupsHoldsDoNotStarveAnotherOnASharedCap: a channel with a $1
// daily cap serves two groups. Group a's two max_tokens 32000 requests
// hold $0.96 of it while they run; group b's 20 requests of up to $0.015
// each then find $0.04 of room: two run, and the rest wait for room, as
// for a busy channel, and are served when a's requests end, where 18 of
// them used to be refused with 503.
func TestOneGroupsHoldsDoNotStarveAnotherOnASharedCap(t *testing.T) {
	r, name, g := shareRelay(t, "share", 0)
	send := func(key string, maxTokens int) *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(holdBody(maxTokens), key))
		return w
	}
	var wg sync.WaitGroup
	codes := make(chan string, 22)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := send("sk-"+name+"-a", 32000) // $0.48 held
			codes <- "a " + strconv.Itoa(w.Code) + " " + w.Body.String()
		}()
	}
	<-g.arrived
	<-g.arrived
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := send("sk-"+name+"-b", 1000) // $0.015 held
			codes <- "b " + strconv.Itoa(w.Code) + " " + w.Body.String()
		}()
	}
	<-g.arrived // b's two that fit beside a's holds
	<-g.arrived
	select {
	case c := <-codes:
		t.Fatalf("a request ended while every one of them was held or waiting: %s", c)
	default:
	}
	g.openAll()
	wg.Wait()
	close(codes)
	for c := range codes {
		if !strings.HasPrefix(c[2:], "200") {
			t.Errorf("%.300s", c)
		}
	}
	spent, _ := r.groups[name+"-a"].channels[0].spend.Spent(r.now())
	if spent[money.PeriodDay] > 1 {
		t.Errorf("the cap spent %v of $1", spent[money.PeriodDay])
	}
}

// TestARequestThatCannotWaitForACapIsToldOfTheCap: in a group that does
// not queue, a request that finds a cap's room held by another group's
// requests is answered at once, naming the cap, as before it could wait.
func TestARequestThatCannotWaitForACapIsToldOfTheCap(t *testing.T) {
	r, name, g := shareRelay(t, "share-noq", -1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		serveHandler(t, r, newRequest(holdBody(64000), "sk-"+name+"-a")) // $0.96 held
	}()
	<-g.arrived
	w, _ := serveHandler(t, r, newRequest(holdBody(4000), "sk-"+name+"-b")) // $0.06: no room
	if w.Code != 503 || !strings.Contains(w.Body.String(), "spend_cap") || !strings.Contains(w.Body.String(), "no_healthy_channel") {
		t.Errorf("%d %s, want 503 no_healthy_channel naming the spend_cap", w.Code, w.Body)
	}
	g.openAll()
	<-done
}
