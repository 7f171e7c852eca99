package fakeupstream

import (
	"github.com/caddy-relay/relay/internal/apirules"
)

// A fake upstream is strict by default: before its handler sees a request,
// it refuses what the real API of the request's wire refuses, with that
// API's status and error shape, so that a relay bug only the real API would
// catch fails a test. The rules are internal/apirules' (which provider mock
// applies too): credentials the upstream accepts, the API version, the
// bodies' required and unknown fields (a body that is not a JSON object is
// refused), the cache breakpoints, the rules on thinking blocks; the wire
// is told by the path. Any other path is the handler's alone.

// Key is the credential a fake upstream accepts unless told otherwise
// (AcceptKeys): the tests' channels give it as their api_key.
const Key = "sk-ant-api03-fake-upstream-key"

// requestID is the request id of the fake's refusals and errors.
const requestID = "req_fake_error"

// An Option changes what a fake upstream accepts.
type Option func(*Upstream)

// AcceptKeys makes the upstream accept keys in place of Key: for a channel
// whose credential a test names itself (a second organisation, a Bedrock API
// key, an OpenAI key).
func AcceptKeys(keys ...string) Option {
	return func(u *Upstream) { u.keys = keys }
}

// Lenient lets every request through to the handler unchecked: for a test
// whose upstream is deliberately not the real API (an odd reseller, a
// handler that judges requests itself). Say why where it is used.
func Lenient() Option {
	return func(u *Upstream) { u.lenient = true }
}

// Refusals lists what the upstream refused so far, one line a request: the
// method, the path and the refusal's message. One that records nothing
// keeps none.
func (u *Upstream) Refusals() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.refused...)
}

// rulesOf is the upstream's view of the real API's rules: its keys, its
// request id, and its account's signatures when it has one.
func (u *Upstream) rulesOf() apirules.Rules {
	r := apirules.Rules{Accepts: u.accepts, RequestID: requestID}
	if u.account != "" {
		r.Thinking = u.signed // thinking.go
	}
	return r
}

func (u *Upstream) accepts(key string) bool {
	for _, k := range u.keys {
		if key == k {
			return true
		}
	}
	return false
}
