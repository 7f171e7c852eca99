package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// TestAClientThatLeavesEarlyIsBilledItsOutput runs the binary and plays the
// early-leave attack on it: a raw client reads a streamed answer up to
// content_block_stop and closes its connection before message_delta. The
// key is billed the output all the same: exactly when the upstream ends
// its answer within settle_grace, and within 10% by the relay's estimate
// when it stalls instead, the relay reading it for settle_grace and no
// longer.
func TestAClientThatLeavesEarlyIsBilledItsOutput(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	events := fakeupstream.StreamEvents("m-settle", fakeupstream.Usage{InputTokens: 1000, OutputTokens: fakeupstream.AnswerTokens},
		fakeupstream.Deltas(fakeupstream.Answer, 3)...)
	held := len(events) - 2 // up to content_block_stop
	release := make(chan struct{})
	ends := fakeupstream.New(t, fakeupstream.Held(events, held, release, nil))
	stallCanceled := make(chan time.Time, 1)
	stalls := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fakeupstream.StartStream(w)
		for _, ev := range events[:held] {
			fakeupstream.WriteEvent(w, ev)
		}
		<-r.Context().Done() // it never sends message_delta
		stallCanceled <- time.Now()
	}))
	// one site whose settle_grace outlasts the test, one whose grace ends
	site, stallSite, admin := freePort(t), freePort(t), freePort(t)
	config := filepath.Join(t.TempDir(), "Caddyfile")
	src := fmt.Sprintf(`{
	admin %s
}
http://%s {
	relay {
		settle_grace 1m
		pricing {
			m-settle input 3 output 15
		}
		key sk-settle-ends-0123456789abcdef ends {
			name settle-ends
		}
		channel ends {
			url %s
			api_key UPSTREAM_KEY
		}
		group ends {
			channels ends
		}
	}
}
http://%s {
	relay {
		settle_grace 300ms
		pricing {
			m-settle input 3 output 15
		}
		key sk-settle-stalls-0123456789abcdef stalls {
			name settle-stalls
		}
		channel stalls {
			url %s
			api_key UPSTREAM_KEY
		}
		group stalls {
			channels stalls
		}
	}
}
`, admin, site, ends.URL, stallSite, stalls.URL)
	src = strings.ReplaceAll(src, "UPSTREAM_KEY", fakeupstream.Key)
	if err := os.WriteFile(config, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	runCaddy(t, caddyBin, config)

	// spend returns the key's spend this month, and what of it was
	// estimated, once the request is accounted
	spend := func(name string) (usd, estimated float64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			resp, err := fleetClient.Get("http://" + admin + "/relay/keys")
			if err != nil {
				t.Fatal(err)
			}
			var rows []struct {
				Name         string
				SpendUSD     map[string]float64 `json:"spend_usd"`
				EstimatedUSD map[string]float64 `json:"estimated_usd"`
			}
			err = json.NewDecoder(resp.Body).Decode(&rows)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			for _, row := range rows {
				if row.Name == name && row.SpendUSD["month"] > 0 {
					return row.SpendUSD["month"], row.EstimatedUSD["month"]
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("key %s: no spend within 10s", name)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	input := 1000 * 3 / 1e6 // the input's cost, exact from message_start
	output := func(usd float64) float64 { return (usd - input) * 1e6 / 15 }

	t.Run("the upstream ends its answer", func(t *testing.T) {
		leaveAfterStop(t, site, "sk-settle-ends-0123456789abcdef")
		close(release) // message_delta comes after the client left
		usd, estimated := spend("settle-ends")
		if got := output(usd); math.Abs(got-fakeupstream.AnswerTokens) > 1e-6 || estimated != 0 {
			t.Errorf("billed %.3f output tokens (estimated $%v), want the %d the upstream reported", got, estimated, fakeupstream.AnswerTokens)
		}
	})
	t.Run("the upstream stalls", func(t *testing.T) {
		left := leaveAfterStop(t, stallSite, "sk-settle-stalls-0123456789abcdef")
		select {
		case at := <-stallCanceled:
			// the relay read on for settle_grace, and no longer
			if d := at.Sub(left); d < 300*time.Millisecond || d > 5*time.Second {
				t.Errorf("the relay read the upstream for %v after the client left, want settle_grace (300ms)", d)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the relay still reads the stalled upstream 10s after the client left")
		}
		usd, estimated := spend("settle-stalls")
		got := output(usd)
		if off := math.Abs(got-fakeupstream.AnswerTokens) / fakeupstream.AnswerTokens; off > 0.10 {
			t.Errorf("billed %.0f output tokens, the upstream made %d (%.1f%% off)", got, fakeupstream.AnswerTokens, 100*off)
		}
		if want := got * 15 / 1e6; math.Abs(estimated-want) > 1e-9 {
			t.Errorf("estimated_usd %v, want the estimated output's $%v", estimated, want)
		}
		resp, err := fleetClient.Get("http://" + admin + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if !strings.Contains(string(b), "\nrelay_estimated_usage_total{group=\"stalls\"} 1\n") {
			t.Errorf("no relay_estimated_usage_total{group=\"stalls\"} 1 in the metrics")
		}
	})
}

// leaveAfterStop sends a streamed request with key on a raw connection,
// reads up to the first content_block_stop and closes the connection; it
// returns when it closed it.
func leaveAfterStop(t *testing.T, site, key string) time.Time {
	t.Helper()
	conn, err := net.Dial("tcp", site)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	body := `{"model":"m-settle","max_tokens":1024,"stream":true,"messages":[{"role":"user","content":"Why does my Go program leak goroutines?"}]}`
	fmt.Fprintf(conn, "POST /v1/messages HTTP/1.1\r\nHost: %s\r\nX-Api-Key: %s\r\nAnthropic-Version: 2023-06-01\r\n"+
		"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", site, key, len(body), body)
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("the stream ended before content_block_stop: %v", err)
		}
		if line == "event: content_block_stop\n" {
			_ = conn.Close()
			return time.Now()
		}
	}
}
