package statuspage

import (
	"sync"
	"time"
)

// The last requests this node answered: a ring of RecentSize slots,
// allocated once per process and written once per request, at its end,
// by the relay's accounting. Writing a slot copies the strings the
// request already held and allocates nothing. The ring is never shared
// in a fleet, and outlives reloads, as the channels' health does.

// RecentSize is how many requests the ring keeps.
const RecentSize = 1000

// ChainSize is how many attempts of a request the ring keeps by name; the
// count of attempts is kept whole.
const ChainSize = 4

// Success is the outcome of an attempt whose answer the client got: every
// other outcome counts as a failure in a channel's recent traffic.
const Success = "success"

// Request is one request as the page shows it, filled by the relay when
// the request ends. Its strings are those the request already held (its
// id, key and channel names, its model, the names of its outcomes), so
// recording it allocates nothing.
type Request struct {
	// At is when the request arrived.
	At time.Time
	ID string
	// Key is the name of the key or user entry it was served as; "" for
	// none.
	Key string
	// Model is the model asked for; Served the one that served it.
	Model  string
	Served string
	// Channel is the channel whose answer the client got; "" for none.
	Channel string
	// Chain and Outcomes are the channel and the outcome (Success, or how
	// the attempt failed) of its first ChainSize attempts; Attempts
	// counts them all.
	Chain    [ChainSize]string
	Outcomes [ChainSize]string
	Attempts int
	// Status is the status the client got; Stream whether it asked for a
	// stream.
	Status    int
	Stream    bool
	FirstByte time.Duration
	Duration  time.Duration
	// Input and Output are its tokens, CostUSD what it cost.
	Input   int64
	Output  int64
	CostUSD float64
	// Code is the error code of the relay's own answer; "" for none.
	Code string

	seq uint64 // its place in the ring, set when it is recorded
}

// ring is the last RecentSize requests of this node: a fixed array,
// written under a short lock.
type ring struct {
	mu   sync.Mutex
	next uint64 // the seq of the next slot written; slot seq-1 is the newest
	rows [RecentSize]Request
}

// recent is the process-wide ring.
var recent = new(ring)

// Record writes r into the ring of the last requests, over the oldest;
// the relay calls it once per request, at its end. It allocates nothing.
func Record(r *Request) { recent.record(r) }

// record writes r's slot.
func (g *ring) record(r *Request) {
	g.mu.Lock()
	g.next++
	s := &g.rows[(g.next-1)%RecentSize]
	*s = *r
	s.seq = g.next
	g.mu.Unlock()
}

// since copies the rows written after seq, oldest first, and returns the
// newest seq.
func (g *ring) since(seq uint64) ([]Request, uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	first := max(seq+1, g.next-min(g.next, RecentSize)+1)
	out := make([]Request, 0, g.next+1-min(first, g.next+1))
	for s := first; s <= g.next; s++ {
		out = append(out, g.rows[(s-1)%RecentSize])
	}
	return out, g.next
}

// requestRow is a ring slot as the page gets it.
type requestRow struct {
	Seq         uint64    `json:"seq"`
	At          time.Time `json:"at"`
	ID          string    `json:"id"`
	Key         string    `json:"key"`
	Model       string    `json:"model"`
	Served      string    `json:"served,omitempty"`
	Channel     string    `json:"channel"`
	Chain       []string  `json:"chain"` // channel:outcome per attempt
	Attempts    int       `json:"attempts"`
	Status      int       `json:"status"`
	Stream      bool      `json:"stream"`
	FirstByteMs float64   `json:"first_byte_ms"`
	DurationMs  float64   `json:"duration_ms"`
	Input       int64     `json:"input_tokens"`
	Output      int64     `json:"output_tokens"`
	CostUSD     float64   `json:"cost_usd"`
	// Code is the error code of the relay's own answer, or how the last
	// attempt ended when an upstream's failure was passed on.
	Code string `json:"code,omitempty"`
}

func (s *Request) row() requestRow {
	r := requestRow{
		Seq: s.seq, At: time.Unix(0, s.At.UnixNano()).UTC(), ID: s.ID, Key: s.Key, Model: s.Model,
		Channel: s.Channel, Attempts: s.Attempts, Status: s.Status, Stream: s.Stream,
		FirstByteMs: ms(s.FirstByte), DurationMs: ms(s.Duration),
		Input: s.Input, Output: s.Output, CostUSD: s.CostUSD, Code: s.Code, Chain: []string{},
	}
	if s.Served != s.Model {
		r.Served = s.Served
	}
	n := 0
	for i := range min(s.Attempts, ChainSize) {
		if s.Chain[i] != "" {
			r.Chain = append(r.Chain, s.Chain[i]+":"+s.Outcomes[i])
			n = i + 1
		}
	}
	if r.Code == "" && s.Status >= 400 && n > 0 {
		r.Code = s.Outcomes[n-1] // an upstream's failure passed on: how the last attempt ended
	}
	return r
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
