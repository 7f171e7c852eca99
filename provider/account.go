package provider

import (
	"crypto/sha256"
	"encoding/hex"
)

// AccountNamer is implemented by a provider that knows which account its
// channel's credential belongs to. The relay makes a channel's default
// signature domain of it, with the provider's name: Claude signs the
// thinking blocks of its answers for the account that made them, and
// another account's upstream refuses them, so a conversation with signed
// thinking goes back to channels of the same domain. A provider without it
// gives each of its channels a domain of its own.
type AccountNamer interface {
	// Account names the account of the channel's credential once the
	// provider is provisioned: the same name for two channels of one
	// account (as far as the provider can tell), another for another
	// account. It must not reveal the credential, since a domain is kept in
	// memory and in a fleet's store: name a secret by its Digest.
	Account() string
}

// Digest names a secret without revealing it: the first 8 bytes of the
// SHA-256 of the parts, in hex. Two channels with the same credential get
// the same digest; the digest gives back nothing of the secret.
func Digest(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil)[:8])
}
