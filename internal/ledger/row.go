package ledger

import "time"

// Row is one request's record, as the relay hands it to a Writer. Its
// strings may refer to what the request holds: the writer copies none of
// them until it writes the row, and keeps none after. The session id is
// digested by the writer, off the request path; the raw id is never
// stored. A caller that must bound what a queued row holds (a session id
// as long as a header) digests it itself and says so (SessionDigested).
type Row struct {
	// At is when the request was accounted, at its end.
	At time.Time
	// ID is the request's id, unique: the table's key is (At, ID).
	ID string
	// Key is the name of the key the request came with (for an
	// identity, its user entry's).
	Key string
	// User is the identity the request came as; "" for a key's own.
	User string
	// Group is the key's group.
	Group string
	// Channel is the channel that answered; "" for none.
	Channel string
	// Model is the model the request asked for.
	Model string
	// Served is the model that served it: the one usage answers group by.
	Served string
	// Cause is the request's cause as relay_requests_total counts it
	// (ok, client, upstream, relay), or batch for a batch's results.
	Cause string
	// Session is the agent session the request was in: its id, digested
	// by the writer, or its digest already (SessionDigested); "" for none.
	Session string
	// Status is the HTTP status the client got.
	Status int
	// Input, Output, CacheRead and CacheWrite are the request's tokens.
	Input      int64
	Output     int64
	CacheRead  int64
	CacheWrite int64
	// CostNano is the request's cost in nano-USD, rounded as the
	// budgets' spend counts it.
	CostNano int64
	// ToolNano is the part of CostNano that server tools cost.
	ToolNano int64
	// Estimated says the tokens are an estimate: the output whose final
	// count never came, or the input of a client that left before any
	// answer.
	Estimated bool
	// Incomplete says the answer did not complete: the tokens are the
	// ones seen.
	Incomplete bool
	// EstimatedPrice says the cost is at an unpriced model's estimate.
	EstimatedPrice bool
	// SessionDigested says Session is its digest already.
	SessionDigested bool
	// Duration is the request's time, from its arrival to its answer's
	// end.
	Duration time.Duration
	// FirstByte is the time to the answer's first byte.
	FirstByte time.Duration
}
