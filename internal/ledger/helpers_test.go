package ledger

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"testing"
	"time"
)

// causeOK is the cause of a request served.
const causeOK = "ok"

// testDigest is a session id as the relay keeps it: the first 16 hex
// digits of its sha256; "" for none.
func testDigest(s string) string {
	if s == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:8])
}

// newRequestID is a random request id, as the relay makes them.
func newRequestID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "relay_" + hex.EncodeToString(b[:])
}

// waitFor polls cond until it holds or the bound passes.
func waitFor(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
