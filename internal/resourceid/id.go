// Package resourceid makes and reads the ids the relay gives batches and
// files, and keeps the secret that seals them.
//
// A batch or a file lives at the upstream organisation of the channel that
// made it. The id a client sees names that channel and the upstream's own
// id, and carries a MAC over both and the key's group, so that the relay
// needs no look-up to route a later call, and a client can neither forge
// an id nor use another group's: any change to the id, or its use from
// another group, fails the MAC and is answered as an id that does not
// exist. Who made the item is recorded besides (internal/owners), and
// a call must pass both checks.
//
// An item id is the kind's own prefix (msgbatch_, file_, so SDKs that look
// at prefixes are content), then, in unpadded URL-safe base64:
//
//	tag | uvarint len(channel) | channel | upstream id | mac[:16]
//
// where tag says whether the upstream id began with the kind's prefix
// (which is then left out). A list cursor (cursor.go) has the same frame
// with its own tag.
package resourceid

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"strings"
)

// Kind is a stateful resource the relay routes by id.
type Kind uint8

// The kinds of resources.
const (
	// Batch is a message batch (the Message Batches API).
	Batch Kind = iota + 1
	// File is a file (the Files API).
	File
)

// Prefix is the one Anthropic's ids of the kind start with.
func (k Kind) Prefix() string {
	if k == Batch {
		return "msgbatch_"
	}
	return "file_"
}

// String names the kind in metrics and messages.
func (k Kind) String() string {
	if k == Batch {
		return "batches"
	}
	return "files"
}

// Noun is what the kind calls one of its items in messages.
func (k Kind) Noun() string {
	if k == Batch {
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
func resourceMAC(secret []byte, kind Kind, group string, payload []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(kind.Prefix()))
	m.Write([]byte{0})
	m.Write([]byte(group))
	m.Write([]byte{0})
	m.Write(payload)
	return m.Sum(nil)[:macSize]
}

// sealID encodes payload (which starts with its tag) as an id of kind for
// group.
func sealID(secret []byte, kind Kind, group string, payload []byte) string {
	payload = append(payload, resourceMAC(secret, kind, group, payload)...)
	return kind.Prefix() + idEncoding.EncodeToString(payload)
}

// openID returns the payload of an id of kind sealed for group, or nil
// when it is not one: another kind, another group, altered, or made with
// another secret.
func openID(secret []byte, kind Kind, group, id string) []byte {
	rest, ok := strings.CutPrefix(id, kind.Prefix())
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

// Item is the client's id of the upstream item up of kind, held by
// channel, for group.
func Item(secret []byte, kind Kind, group, channel, up string) string {
	tag := byte(tagItemRaw)
	if rest, ok := strings.CutPrefix(up, kind.Prefix()); ok {
		tag, up = tagItemPrefixed, rest
	}
	p := make([]byte, 0, 1+binary.MaxVarintLen64+len(channel)+len(up)+macSize)
	p = append(p, tag)
	p = binary.AppendUvarint(p, uint64(len(channel)))
	p = append(p, channel...)
	p = append(p, up...)
	return sealID(secret, kind, group, p)
}

// ParseItem returns the channel and upstream id an item id names, false
// when id is no item id of kind for group.
func ParseItem(secret []byte, kind Kind, group, id string) (channel, up string, ok bool) {
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
		up = kind.Prefix() + up
	}
	return channel, up, up != ""
}
