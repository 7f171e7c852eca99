package relay

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"io/fs"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// A batch or a file lives at the upstream organisation of the channel that
// made it. The id a client sees names that channel and the upstream's own
// id, and carries a MAC over both and the key's group, so that the relay
// needs no look-up to route a later call, and a client can neither forge
// an id nor use another group's: any change to the id, or its use from
// another group, fails the MAC and is answered as an id that does not
// exist. Who made the item is recorded besides (resource_owners.go), and
// a call must pass both checks.
//
// An item id is the kind's own prefix (msgbatch_, file_, so SDKs that look
// at prefixes are content), then, in unpadded URL-safe base64:
//
//	tag | uvarint len(channel) | channel | upstream id | mac[:16]
//
// where tag says whether the upstream id began with the kind's prefix
// (which is then left out). A list cursor (see resource_list.go) has the
// same frame with its own tag.

// resourceKind is a stateful resource the relay routes by id.
type resourceKind uint8

const (
	kindBatch resourceKind = iota + 1
	kindFile
)

// prefix is the one Anthropic's ids of the kind start with.
func (k resourceKind) prefix() string {
	if k == kindBatch {
		return "msgbatch_"
	}
	return "file_"
}

// String names the kind in metrics and messages.
func (k resourceKind) String() string {
	if k == kindBatch {
		return "batches"
	}
	return "files"
}

// noun is what the kind calls one of its items in messages.
func (k resourceKind) noun() string {
	if k == kindBatch {
		return "message batch"
	}
	return "file"
}

const (
	tagItemPrefixed = 'i' // an item whose upstream id had the kind's prefix, left out
	tagItemRaw      = 'r' // an item whose upstream id is kept whole
	tagCursor       = 'c' // a list cursor
	macSize         = 16
)

var idEncoding = base64.RawURLEncoding

// resourceMAC is the MAC of a payload of kind for group.
func resourceMAC(secret []byte, kind resourceKind, group string, payload []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(kind.prefix()))
	m.Write([]byte{0})
	m.Write([]byte(group))
	m.Write([]byte{0})
	m.Write(payload)
	return m.Sum(nil)[:macSize]
}

// sealID encodes payload (which starts with its tag) as an id of kind for
// group.
func sealID(secret []byte, kind resourceKind, group string, payload []byte) string {
	payload = append(payload, resourceMAC(secret, kind, group, payload)...)
	return kind.prefix() + idEncoding.EncodeToString(payload)
}

// openID returns the payload of an id of kind sealed for group, or nil
// when it is not one: another kind, another group, altered, or made with
// another secret.
func openID(secret []byte, kind resourceKind, group, id string) []byte {
	rest, ok := strings.CutPrefix(id, kind.prefix())
	if !ok || len(rest) > 4096 {
		return nil
	}
	raw, err := idEncoding.DecodeString(rest)
	if err != nil || len(raw) < 1+macSize {
		return nil
	}
	payload, mac := raw[:len(raw)-macSize], raw[len(raw)-macSize:]
	if !hmac.Equal(mac, resourceMAC(secret, kind, group, payload)) {
		return nil
	}
	return payload
}

// itemID is the client's id of the upstream item up of kind, held by
// channel, for group.
func itemID(secret []byte, kind resourceKind, group, channel, up string) string {
	tag := byte(tagItemRaw)
	if rest, ok := strings.CutPrefix(up, kind.prefix()); ok {
		tag, up = tagItemPrefixed, rest
	}
	p := make([]byte, 0, 1+binary.MaxVarintLen64+len(channel)+len(up)+macSize)
	p = append(p, tag)
	p = binary.AppendUvarint(p, uint64(len(channel)))
	p = append(p, channel...)
	p = append(p, up...)
	return sealID(secret, kind, group, p)
}

// parseItemID returns the channel and upstream id an item id names, false
// when id is no item id of kind for group.
func parseItemID(secret []byte, kind resourceKind, group, id string) (channel, up string, ok bool) {
	p := openID(secret, kind, group, id)
	if len(p) == 0 || p[0] != tagItemPrefixed && p[0] != tagItemRaw {
		return "", "", false
	}
	n, w := binary.Uvarint(p[1:])
	if w <= 0 || n > uint64(len(p)-1-w) {
		return "", "", false
	}
	channel = string(p[1+w : 1+w+int(n)])
	up = string(p[1+w+int(n):])
	if p[0] == tagItemPrefixed {
		up = kind.prefix() + up
	}
	return channel, up, up != ""
}

// resourceSecretStorageKey is where, in Caddy's storage, a relay without
// resource_secret keeps the secret it generated.
const resourceSecretStorageKey = "relay/resource_secret"

// resourceSecret is the key of the ids' MACs: resource_secret, else the
// secret generated once and kept in the fleet's Redis (fleet mode) or in
// Caddy's storage. A relay of a fleet that cannot reach Redis when it
// starts asks again, at most once a second, on the requests that need it.
type resourceSecret struct {
	mu     sync.Mutex
	key    []byte
	tried  time.Time
	fleet  *member
	logger *zap.Logger
}

// provisionResourceSecret sets up r.secret.
func (r *Relay) provisionResourceSecret(ctx caddy.Context) error {
	r.secret = &resourceSecret{fleet: r.fleet, logger: r.logger}
	if r.ResourceSecret != "" {
		v, err := resolveSecret(r.ResourceSecret)
		if err != nil {
			return err
		}
		if v == "" {
			return errors.New("resource_secret resolves to nothing")
		}
		if !isPlaceholder(r.ResourceSecret) {
			r.logger.Warn("resource_secret is written in the config; use a placeholder such as {env.RELAY_RESOURCE_SECRET} to keep it out of GET /config/")
		}
		r.secret.key = []byte(v)
		return nil
	}
	if r.fleet != nil {
		_, _ = r.secret.get() // a Redis that is down is asked again later
		return nil
	}
	storage := configStorage(ctx)
	if storage == nil { // a unit test's context: a secret of this process
		r.secret.key = processSecret()
		return nil
	}
	c := context.Background()
	// once it is made, a load reads it without the lock: a storage lock
	// taken at every reload (a lock file and the goroutine that keeps it
	// fresh, with the file system storage) can outlive its Unlock and hold
	// the next reload for the seconds it takes to go stale
	if b, err := storage.Load(c, resourceSecretStorageKey); err == nil && len(b) > 0 {
		r.secret.key = b
		return nil
	}
	// not made yet: made under the lock, so that relays sharing the
	// storage make one
	if err := storage.Lock(c, resourceSecretStorageKey); err != nil {
		return err
	}
	defer func() { _ = storage.Unlock(c, resourceSecretStorageKey) }()
	b, err := storage.Load(c, resourceSecretStorageKey)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		b = []byte(newSecret())
		if err := storage.Store(c, resourceSecretStorageKey, b); err != nil {
			return err
		}
	case err != nil:
		return err
	}
	r.secret.key = b
	return nil
}

var processSecret = sync.OnceValue(func() []byte { return []byte(newSecret()) })

func newSecret() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// get returns the key, or false while a fleet's Redis has not given it.
func (s *resourceSecret) get() ([]byte, bool) {
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
