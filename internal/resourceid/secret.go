package resourceid

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/certmagic"
	"go.uber.org/zap"
)

// secretStorageKey is where, in Caddy's storage, a relay without
// resource_secret keeps the secret it generated.
const secretStorageKey = "relay/resource_secret"

// Secret is the key of the ids' MACs: resource_secret, else the secret
// generated once and kept in the fleet's Redis (fleet mode) or in Caddy's
// storage. A relay of a fleet that cannot reach Redis when it starts asks
// again, at most once a second, on the requests that need it.
type Secret struct {
	mu     sync.Mutex
	key    []byte
	tried  time.Time
	fleet  *fleet.Client
	logger *zap.Logger
}

// NewSecret sets up the secret of a relay whose resource_secret is
// configured (placeholders unresolved; "" when it has none), of fleet f
// (nil: none), whose config keeps its state in storage (nil in a unit
// test's context: the secret is then one of this process).
func NewSecret(configured string, f *fleet.Client, storage certmagic.Storage, logger *zap.Logger) (*Secret, error) {
	s := &Secret{fleet: f, logger: logger}
	if configured != "" {
		v, err := provider.ResolvePlaceholders(configured)
		if err != nil {
			return nil, err
		}
		if v == "" {
			return nil, errors.New("resource_secret resolves to nothing")
		}
		if !provider.IsPlaceholder(configured) {
			logger.Warn("resource_secret is written in the config; use a placeholder such as {env.RELAY_RESOURCE_SECRET} to keep it out of GET /config/")
		}
		s.key = []byte(v)
		return s, nil
	}
	if f != nil {
		_, _ = s.Get() // a Redis that is down is asked again later
		return s, nil
	}
	if storage == nil { // a unit test's context: a secret of this process
		s.key = processSecret()
		return s, nil
	}
	c := context.Background()
	// once it is made, a load reads it without the lock: a storage lock
	// taken at every reload (a lock file and the goroutine that keeps it
	// fresh, with the file system storage) can outlive its Unlock and hold
	// the next reload for the seconds it takes to go stale
	if b, err := storage.Load(c, secretStorageKey); err == nil && len(b) > 0 {
		s.key = b
		return s, nil
	}
	// not made yet: made under the lock, so that relays sharing the
	// storage make one
	if err := storage.Lock(c, secretStorageKey); err != nil {
		return nil, err
	}
	defer func() { _ = storage.Unlock(c, secretStorageKey) }()
	b, err := storage.Load(c, secretStorageKey)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		b = []byte(newSecret())
		if err := storage.Store(c, secretStorageKey, b); err != nil {
			return nil, err
		}
	case err != nil:
		return nil, err
	}
	s.key = b
	return s, nil
}

var processSecret = sync.OnceValue(func() []byte { return []byte(newSecret()) })

func newSecret() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Get returns the key, or false while a fleet's Redis has not given it.
func (s *Secret) Get() ([]byte, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.key != nil {
		return s.key, true
	}
	if s.fleet == nil || time.Since(s.tried) < time.Second {
		return nil, false
	}
	s.tried = time.Now()
	f := s.fleet
	var key string
	err := f.Do("resource_secret", func(ctx context.Context) error {
		k := f.Prefix + "resource_secret"
		if err := f.Redis.SetNX(ctx, k, newSecret(), 0).Err(); err != nil {
			return err
		}
		v, err := f.Redis.Get(ctx, k).Result()
		key = v
		return err
	})
	if err != nil || key == "" {
		s.logger.Warn("the fleet's resource secret could not be read from Redis; batches and files answer 503 until it can", zap.Error(err))
		return nil, false
	}
	s.key = []byte(key)
	return s.key, true
}
