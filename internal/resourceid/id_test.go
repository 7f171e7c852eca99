package resourceid

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

func TestItemIDsAndCursorsRoundTrip(t *testing.T) {
	secret := []byte("s3cret")
	for _, up := range []string{"file_011CNha8iCJcU1wXNR6q4V8w", "weird-id", "file_"} {
		id := Item(secret, File, "g", "channel-é", up)
		if !strings.HasPrefix(id, "file_") {
			t.Errorf("id %q lost its prefix", id)
		}
		ch, got, ok := ParseItem(secret, File, "g", id)
		if !ok || ch != "channel-é" || got != up && up != "file_" {
			t.Errorf("%q: %q %q %v", up, ch, got, ok)
		}
		if _, _, ok := ParseItem(secret, File, "h", id); ok {
			t.Errorf("another group's id was accepted")
		}
		if _, _, ok := ParseItem([]byte("other"), File, "g", id); ok {
			t.Errorf("an id of another secret was accepted")
		}
		if _, _, ok := ParseItem(secret, Batch, "g", "msgbatch_"+strings.TrimPrefix(id, "file_")); ok {
			t.Errorf("a file's id was accepted as a batch's")
		}
	}
	pos := []Pos{{Channel: "a", Mode: PosAfter, Value: "msgbatch_1"}, {Channel: "b", Mode: PosPage, Value: "page_x", Skip: 3}, {Channel: "c", Mode: PosDone}}
	c := SealCursor(secret, Batch, "g", pos)
	got, ok := OpenCursor(secret, Batch, "g", c)
	if !ok || !slices.Equal(got, pos) {
		t.Errorf("cursor: %+v %v", got, ok)
	}
	if _, _, ok := ParseItem(secret, Batch, "g", c); ok {
		t.Errorf("a cursor was taken for an item")
	}
	if _, ok := OpenCursor(secret, Batch, "h", c); ok {
		t.Errorf("another group's cursor was accepted")
	}
}

// TestTheSecretIsMadeOnceAndKept: without resource_secret, the first
// relay of a storage makes the secret and every later one reads it; a
// configured secret is resolved, and one that resolves to nothing is
// refused.
func TestTheSecretIsMadeOnceAndKept(t *testing.T) {
	storage := &certmagic.FileStorage{Path: t.TempDir()}
	log := zap.NewNop()
	a, err := NewSecret("", nil, storage, log)
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewSecret("", nil, storage, log)
	if err != nil {
		t.Fatal(err)
	}
	ka, _ := a.Get()
	kb, _ := b.Get()
	if len(ka) != 64 || string(ka) != string(kb) {
		t.Errorf("two relays of one storage have secrets %q and %q", ka, kb)
	}
	if stored, err := storage.Load(context.Background(), secretStorageKey); err != nil || string(stored) != string(ka) {
		t.Errorf("the stored secret: %q %v", stored, err)
	}
	t.Setenv("RELAY_TEST_SECRET", "from-the-env")
	c, err := NewSecret("{env.RELAY_TEST_SECRET}", nil, storage, log)
	if k, ok := c.Get(); err != nil || !ok || string(k) != "from-the-env" {
		t.Errorf("a configured secret: %q %v %v", k, ok, err)
	}
	if _, err := NewSecret("{env.RELAY_TEST_SECRET_UNSET}", nil, storage, log); err == nil {
		t.Error("a secret that resolves to nothing was taken")
	}
	p, err := NewSecret("", nil, nil, log)
	if k, ok := p.Get(); err != nil || !ok || len(k) != 64 {
		t.Errorf("a secret of this process: %q %v %v", k, ok, err)
	}
}

// TestAFleetSharesItsSecret: the relays of a fleet read one secret from
// Redis, whichever made it.
func TestAFleetSharesItsSecret(t *testing.T) {
	srv := redistest.Start(t)
	client := func() *fleet.Client {
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		t.Cleanup(cancel)
		c, err := fleet.New(ctx, &fleet.Config{Address: []string{srv.Addr}, Prefix: "ids:"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Stop(); _ = c.Close() })
		return c
	}
	a, err := NewSecret("", client(), nil, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	b, err := NewSecret("", client(), nil, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	ka, oka := a.Get()
	kb, okb := b.Get()
	if !oka || !okb || len(ka) != 64 || string(ka) != string(kb) {
		t.Errorf("two relays of one fleet: %q %v, %q %v", ka, oka, kb, okb)
	}
	if got, err := srv.Command("GET", "ids:resource_secret"); err != nil || got != string(ka) {
		t.Errorf("the secret in Redis: %q %v", got, err)
	}
}
