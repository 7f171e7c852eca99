// Package signatures keeps the thinking signatures the relay learned:
// which signature domain (the accounts whose signatures an upstream
// accepts) signed each signature of the answers it passed to clients, so
// that a conversation that sends them back goes to channels of that
// domain. A Table is this process's; given a fleet's Shared, what it
// learns travels to the other relays, and theirs to it.
//
// The package knows nothing of the relay: it takes the raw JSON strings of
// signatures and the names of domains.
package signatures

import (
	"bytes"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/cespare/xxhash/v2"
	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// MaxDomainLen bounds a configured signature domain's name.
const MaxDomainLen = 128

// ValidDomain reports whether s may name a signature domain: letters,
// digits and - _ . : / @, at most MaxDomainLen bytes.
func ValidDomain(s string) bool {
	if s == "" || len(s) > MaxDomainLen {
		return false
	}
	for _, c := range []byte(s) {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', strings.IndexByte("-_.:/@", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// Max bounds the signatures Learned remembers; the oldest learned go
// first. A long Claude Code session carries one per turn, and each turn's
// answer brings new ones to learn.
const Max = 100_000

// Table maps the digest of a signature to the domain of the channel whose
// answer carried it. It holds no secret: a digest and a domain's name.
//
// Every block of every request that carries signed thinking is looked up,
// and a request may carry tens of thousands: a lookup only reads (Peek,
// under the read lock), so one tenant's blocks never queue another's; the
// oldest learned signature is the first forgotten.
type Table struct {
	mu  sync.RWMutex
	lru *simplelru.LRU[uint64, string]
	// some: it has learned a signature; until then no request's signer
	// can be known
	some atomic.Bool
}

// Learned is the process's table, kept across config reloads, as the
// sessions it serves outlive them.
var Learned = NewTable(Max)

// NewTable is an empty table of at most size signatures.
func NewTable(size int) *Table {
	lru, _ := simplelru.NewLRU[uint64, string](size, nil)
	return &Table{lru: lru}
}

// Learn remembers that domain signed the signature whose digest is d,
// and, when s is not nil, shares it with s's fleet (off the caller's
// path).
func (t *Table) Learn(d uint64, domain string, s *Shared) {
	t.learn(d, domain)
	if s != nil {
		s.share(entry{d, domain})
	}
}

// learn remembers that domain signed the signature whose digest is d.
func (t *Table) learn(d uint64, domain string) {
	t.mu.Lock()
	t.lru.Add(d, domain)
	t.mu.Unlock()
	if !t.some.Load() {
		t.some.Store(true)
	}
}

// DomainOf is the domain that signed the signature whose digest is d; ""
// when the table does not know it.
func (t *Table) DomainOf(d uint64) string {
	t.mu.RLock()
	domain, _ := t.lru.Peek(d)
	t.mu.RUnlock()
	return domain
}

// Some reports whether t has learned a signature: until then no request's
// signer can be known, and a request's signatures need not be read.
func (t *Table) Some() bool { return t.some.Load() }

// Digest is the digest of a raw JSON string holding a signature: of its
// content, unescaped, so the signature an answer carried and the one a
// client sends back digest alike whichever way a JSON encoder wrote it.
func Digest(raw []byte) uint64 {
	inner := raw[1 : len(raw)-1]
	if bytes.IndexByte(inner, '\\') >= 0 {
		return xxhash.Sum64(jsonscan.AppendUnquote(nil, raw))
	}
	return xxhash.Sum64(inner)
}
