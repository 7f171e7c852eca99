// Package limits keeps the limits of keys, user entries, end users,
// sessions and channels: a request rate, a token limit that may go into
// debt, and a number of requests in flight (Limiter), and a group's
// retry budget (RetryBudget).
//
// A Limiter keeps its limits on this relay, or, shared (Limiter.Share),
// in the fleet's Redis for every relay at once (Shared): there a
// request's limits are admitted in one script call with its holds of its
// budgets, all or none (TakeAll, with the holds behind Holds), and large
// limits are leased to each relay in blocks it admits from without a
// round trip (fleet_leases.go, fleet_slots.go). What a request took is
// given back off its path, by workers that run with the fleet's client.
//
// The package never reads a request: callers hand it the limits (Spec),
// the estimate of a request's tokens and the holds' prepared parts.
package limits
