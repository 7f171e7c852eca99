package health

import "time"

// Outcome is what one attempt on one channel came to. It decides whether the
// relay commits, passes the answer through, or fails over, and how the
// channel's health changes.
type Outcome uint8

// The outcomes of an attempt.
const (
	Success      Outcome = iota // 2xx: commit
	ClientError                 // the request's own fault: pass through, channel stays healthy
	Auth                        // the channel's credential or account is unusable
	RateLimited                 // 429: the channel's quota is exhausted for a while
	Overloaded                  // 529: the provider is overloaded, not the credential
	Transient                   // 5xx, network error, timeout, broken stream
	Canceled                    // the client went away: nobody's fault
	ModelRefused                // the channel may not serve this model: set aside for it alone
	LacksFeature                // the channel's wire does not support a feature the request carries: set aside for it alone
)

var outcomeNames = [...]string{"success", "client_error", "auth", "rate_limited", "overloaded", "transient", "canceled", "model_refused", "lacks_feature"}

// String is the outcome's name, as metrics, logs and the admin API say it.
func (o Outcome) String() string { return outcomeNames[o] }

// Retryable reports whether another channel should be tried.
func (o Outcome) Retryable() bool {
	switch o {
	case Auth, RateLimited, Overloaded, Transient, ModelRefused, LacksFeature:
		return true
	}
	return false
}

// ByClass reports whether the outcome is an upstream's limit, which cools
// the model class that answered rather than the channel (a 429, a 529).
func (o Outcome) ByClass() bool { return o == RateLimited || o == Overloaded }

// outcomeNamed is the outcome called name (success when none is).
func outcomeNamed(name string) Outcome {
	for i, n := range outcomeNames {
		if n == name {
			return Outcome(i)
		}
	}
	return Success
}

// Verdict is what the channel's health takes of an attempt's verdict: its
// outcome and what the relay learned along with it.
type Verdict struct {
	Outcome Outcome
	// Wait is the upstream's own retry hint (retry-after-ms, retry-after,
	// anthropic-ratelimit-*-reset), zero when it gave none.
	Wait   time.Duration
	Reason string // short and secret-free, for the admin API
	Model  string // with ModelRefused: the model set aside (the client's name)
	// Features are, with LacksFeature, the features the channel lacks,
	// which the request carried.
	Features []string
	// Class is, with an outcome ByClass, the model class it cools on the
	// channel; "": the whole channel (a resource's call, which no model
	// names).
	Class string
}
