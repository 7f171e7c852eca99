package statuspage

import (
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
)

// The rows of a snapshot: a channel, a key, a session and a fleet node as
// the page shows them, which are the rows of the admin API's GET
// /relay/channels, /relay/keys, /relay/sessions and /relay/fleet, field
// for field, so that the page's script reads the same JSON as the admin
// API gives. The relay fills them from its own.

// Channel is a channel's row of GET /relay/channels. State is cooldown while the channel or any
// of its model classes cools, and CooldownUntil is when the last of them
// ends (or the breaker turns half-open).
type Channel struct {
	Name            string     `json:"name"`
	Provider        string     `json:"provider"`
	Groups          []string   `json:"groups"`
	State           string     `json:"state"`
	CooldownUntil   *time.Time `json:"cooldown_until"`
	Inflight        int64      `json:"inflight"`
	Busy            bool       `json:"busy"`
	BusyUntil       *time.Time `json:"busy_until,omitempty"`
	Requests        uint64     `json:"requests"`
	Failures        uint64     `json:"failures"`
	EWMALatencyMs   float64    `json:"ewma_latency_ms"`
	LastError       string     `json:"last_error,omitempty"`
	LastErrorReason string     `json:"last_error_reason,omitempty"`
	LastErrorAt     *time.Time `json:"last_error_at,omitempty"`
	// ResetAt is when the channel was last reset: its last error and its
	// recent error rate may be from before it.
	ResetAt *time.Time `json:"reset_at,omitempty"`
	// Classes are the model classes cooling on the channel (a 429, a 529
	// or a spent anthropic-ratelimit-* quota for one of its models): it
	// serves the other classes meanwhile.
	Classes map[string]ClassCooldown `json:"classes,omitempty"`
	// RefusedModels are the models the upstream refused (403) on this
	// channel, set aside until the time given.
	RefusedModels map[string]time.Time `json:"refused_models,omitempty"`
	// Lacks are the features the upstream said it does not support, set
	// aside on this channel until the time given.
	Lacks map[string]time.Time `json:"lacks,omitempty"`
	// SpendUSD is what was spent on a channel with a spend cap, in the
	// current period of each of its caps (SpendCapUSD); absent for a
	// channel without one. When a cap is spent the channel's state is
	// capped (unless it is out for another reason too) until CappedUntil.
	SpendUSD    map[string]float64 `json:"spend_usd,omitempty"`
	SpendCapUSD map[string]float64 `json:"spend_cap_usd,omitempty"`
	CappedUntil *time.Time         `json:"capped_until,omitempty"`
}

// ChannelView is a channel's row in a snapshot: its row of GET
// /relay/channels, with what the ring tells of its recent traffic, which
// the page counts.
type ChannelView struct {
	Channel
	Recent ChannelRecent `json:"recent"`
}

// ClassCooldown is a model class cooling on a channel.
type ClassCooldown struct {
	State  string    `json:"state"` // cooldown
	Until  time.Time `json:"until"`
	Reason string    `json:"reason,omitempty"`
}

// Key is a key's row of GET /relay/keys. It never holds a secret or its
// digest.
type Key struct {
	Name     string `json:"name"`
	Kind     string `json:"kind"` // key
	Group    string `json:"group"`
	Priority string `json:"priority"`
	// Expires is when the key stops working; null: never.
	Expires  *time.Time `json:"expires"`
	Expired  bool       `json:"expired"`
	Disabled bool       `json:"disabled"`
	Limits   KeyLimits  `json:"limits"`
	// SpendUSD is what the key spent in the current day, week and month
	// (calendar periods in UTC) and in total; BudgetUSD its budgets, by
	// period, and RemainingUSD what is left of each.
	SpendUSD     map[string]float64 `json:"spend_usd"`
	BudgetUSD    map[string]float64 `json:"budget_usd,omitempty"`
	RemainingUSD map[string]float64 `json:"remaining_usd,omitempty"`
	// EstimatedUSD is the part of SpendUSD, by period, that estimates
	// cost (outputs and inputs of clients that left before the upstream
	// counted them); EstimatedPriceUSD the part charged for models the
	// price table does not know. Absent when none was.
	EstimatedUSD      map[string]float64 `json:"estimated_usd,omitempty"`
	EstimatedPriceUSD map[string]float64 `json:"estimated_price_usd,omitempty"`
	// HeldUSD is what the key's requests in flight and its batches hold
	// against its budgets now.
	HeldUSD float64 `json:"held_usd"`
}

// KeyLimits is a key's limits as configured, and what is in use now.
type KeyLimits struct {
	Rate string `json:"rate,omitempty"`
	// RateRemaining is how many requests the key may send now; absent when
	// the key has no rate, or when a fleet keeps it in Redis.
	RateRemaining *int64 `json:"rate_remaining,omitempty"`
	Tokens        string `json:"tokens,omitempty"`
	// TokensRemaining is what is left of the token limit now, negative
	// while the key is in debt; absent as RateRemaining is.
	TokensRemaining *int64 `json:"tokens_remaining,omitempty"`
	Concurrency     int64  `json:"concurrency,omitempty"`
	// Inflight counts the key's requests running on this relay now.
	Inflight int64 `json:"inflight"`
}

// Session is a live agent session's row of GET /relay/sessions. It names
// the session by a digest of its id, never the id.
type Session struct {
	// Session is the digest of the session id.
	Session string `json:"session"`
	// Key is the name of the key or user entry it is served as.
	Key   string `json:"key"`
	Group string `json:"group"`
	// SpendUSD is what its requests cost on this relay.
	SpendUSD float64 `json:"spend_usd"`
	// Budget, when it has a session_budget: the window's budget, what was
	// spent and is held in it, and when it renews.
	BudgetUSD      float64    `json:"budget_usd,omitempty"`
	WindowSpendUSD float64    `json:"window_spend_usd,omitempty"`
	HeldUSD        float64    `json:"held_usd,omitempty"`
	Renews         *time.Time `json:"renews,omitempty"`
	// Requests counts the requests its limits admitted.
	Requests int64 `json:"requests"`
	// LoopGuardHits counts the requests its loop guard refused; LoopRun is
	// how many in a row ended with the same tool call and result now.
	LoopGuardHits int       `json:"loop_guard_hits"`
	LoopRun       int       `json:"loop_run"`
	LastSeen      time.Time `json:"last_seen"`
	// Started is when this relay first saw it.
	Started time.Time `json:"started"`
}

// FleetNode is a node of the fleet as GET /relay/fleet lists it: its id,
// address, version, start, the blocks of large limits it holds (Leases;
// empty: none, and the fleet's limits are exact), when it was last seen,
// whether it is up or gone, and whether it is the node that answered.
type FleetNode = fleet.Node

// Lease is a block of a large limit a fleet node holds.
type Lease = fleet.Block
