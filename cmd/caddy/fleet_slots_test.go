package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// arrivals is a concurrencyProbe that also counts the requests that
// reached it, whether still held or not.
type arrivals struct {
	concurrencyProbe
	arrived atomic.Int64
}

func (a *arrivals) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.arrived.Add(1)
	a.concurrencyProbe.ServeHTTP(w, r)
}

// fleetView is one row of a node's GET /relay/fleet, as far as these
// tests read it.
type fleetView struct {
	ID       string    `json:"id"`
	State    string    `json:"state"`
	LastSeen time.Time `json:"last_seen"`
	Leases   []struct {
		Limit         string `json:"limit"`
		Kind          string `json:"kind"`
		Block         int64  `json:"block"`
		Held          int64  `json:"held"`
		Nodes         int64  `json:"nodes"`
		MaxFleetError int64  `json:"max_fleet_error"`
	} `json:"leases"`
}

// fleetView reads the node's GET /relay/fleet.
func (n *fleetNode) fleetView(t *testing.T) []fleetView {
	t.Helper()
	resp, err := fleetClient.Get("http://" + n.admin + "/relay/fleet")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []fleetView
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	return rows
}

// awaitRelaysUp returns once every node of a fleet of n has counted the
// n relays up: each wrote a heartbeat after all of them had written one.
func awaitRelaysUp(t *testing.T, node *fleetNode, n int) {
	t.Helper()
	var all time.Time
	within(t, "every node's first heartbeat", 10*time.Second, func() bool {
		all = time.Now()
		return len(node.fleetView(t)) == n
	})
	within(t, "every node's heartbeat after that", 10*time.Second, func() bool {
		rows := node.fleetView(t)
		for _, r := range rows {
			if !r.LastSeen.After(all) {
				return false
			}
		}
		return len(rows) == n
	})
}

// TestFleetLeasesSlotsOfALargeConcurrency: three relay processes share a
// key's concurrency of 300, which they lease in blocks of 10 slots
// (300 / (10 x 3)). 330 slow requests at once, 110 on each: the upstream
// never holds more than 300 (a block's slots count in Redis, used or
// not), at least 270 reach it (no relay holds a block's worth unused),
// the others are refused with 429 key_rate_limited, and GET /relay/fleet
// lists each relay's block with the error it allows. Then a relay dies:
// its slots expire within the lease and the others take them. (Redis gets
// a timeout of a second: on a loaded machine an admission past the
// default 50ms fails, and on_error local then admits on the relay's own
// limits, as documented, past the fleet's.)
func TestFleetLeasesSlotsOfALargeConcurrency(t *testing.T) {
	srv := redistest.Start(t)
	probe := &arrivals{concurrencyProbe: concurrencyProbe{release: make(chan struct{})}}
	released := sync.OnceFunc(func() { close(probe.release) })
	t.Cleanup(released)
	up := fakeupstream.New(t, probe)
	const limit, relays, each, lease = 300, 3, 110, 2 * time.Second
	nodes := startFleet(t, relays, fleetConfig{redisAddr: srv.Addr, prefix: "slots:", storage: "\t\t\tlease 2s\n\t\t\ttimeout 1s\n",
		keyOpts: "\t\t\tconcurrency 300\n", channels: []string{"up=" + up.URL}})
	awaitRelaysUp(t, nodes[0], relays)

	var refused, failed atomic.Int64
	var wg sync.WaitGroup
	for _, n := range nodes {
		for range each {
			wg.Go(func() {
				status, body, err := n.attempt(fleetKey)
				switch {
				case err != nil:
					failed.Add(1) // its relay was killed
				case status == 429:
					if !strings.Contains(body, `"key_rate_limited"`) || !strings.Contains(body, "concurrency") {
						t.Errorf("refused with %s", body)
					}
					refused.Add(1)
				case status != 200:
					t.Errorf("answered %d %s", status, body)
				}
			})
		}
	}
	within(t, "every request at the upstream or refused", 30*time.Second, func() bool {
		return probe.held.Load()+refused.Load() == relays*each
	})
	if m := probe.most.Load(); m > limit {
		t.Fatalf("the upstream held %d requests at once, the key's concurrency is %d", m, limit)
	}
	if n := probe.held.Load(); n < limit-relays*10 {
		t.Fatalf("the upstream holds %d requests, want at least %d: the limit less a block per relay", n, limit-relays*10)
	}
	within(t, "every relay's block listed", 3*lease, func() bool {
		rows := nodes[1].fleetView(t)
		listed := 0
		for _, r := range rows {
			for _, l := range r.Leases {
				if l.Limit == "k:app" && l.Kind == "concurrency" && l.Block == 10 && l.Nodes == relays && l.MaxFleetError == 30 && l.Held >= 10 {
					listed++
				}
			}
		}
		return listed == relays
	})

	// admitted sends one more request to a relay and reports whether it
	// reached the upstream (held there until the end) or was refused
	admitted := func(n *fleetNode) bool {
		t.Helper()
		before := probe.arrived.Load()
		answer := make(chan int, 1)
		wg.Go(func() {
			status, _, err := n.attempt(fleetKey)
			if err != nil {
				status = -1
			}
			answer <- status
		})
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
			select {
			case status := <-answer:
				if status != 429 {
					t.Fatalf("a request with the upstream holding the rest answered %d", status)
				}
				return false
			case <-time.After(5 * time.Millisecond):
				if probe.arrived.Load() > before {
					return true
				}
			}
		}
		t.Fatal("a request neither reached the upstream nor was answered")
		return false
	}
	// the two relays that live use up the slots they hold unused: less
	// than a block each
	for _, n := range nodes[1:] {
		for i := 0; admitted(n); i++ {
			if i >= 10 {
				t.Fatal("a relay held more than a block of slots unused")
			}
		}
	}
	// the first relay dies with its requests; the slots it held expire
	// within the lease, and the others take them
	nodes[0].stop()
	killed := time.Now()
	const freed = lease + time.Second // the lease, and room for a loaded machine
	within(t, "a relay admits in the dead one's slots", freed, func() bool { return admitted(nodes[1]) })
	if took := time.Since(killed); took > freed {
		t.Fatalf("the dead relay's slots were taken %v after it died, the lease is %v", took, lease)
	}
	if m := probe.most.Load(); m > limit {
		t.Fatalf("the upstream held %d requests at once, the key's concurrency is %d", m, limit)
	}
	released()
	wg.Wait()
	if n := failed.Load(); n > each {
		t.Fatalf("%d requests failed, more than the dead relay had", n)
	}
}
