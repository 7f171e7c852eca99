package limits

import (
	"context"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/redis/go-redis/v9"
)

// Leases of large limits. A request rate or a token limit large enough
// that a node's share of it is many requests or tokens is not asked of
// Redis at every request: a node takes a block of it in one script call
// (the admission script of the request that needs it), admits from the
// block with no round trip until the block is spent or its lease ends, and
// gives back what it did not use when the lease ends, when the limit
// changes, or when the node stops. Large concurrency limits are leased in
// blocks of slots (fleet_slots.go); budgets are never leased.
//
//   - Size: a block is a tenth of a node's even share of the limit,
//     n / (10 x nodes) for a limit of n requests or tokens a period, with
//     nodes the relays up in the fleet (heartbeats). A limit is leased only
//     when that is at least minRateBlock requests or minTokenBlock tokens;
//     smaller limits, and any limit while the node does not know how many
//     relays are up, take a round trip per request as before.
//   - Lease: a block is used for a tenth of the limit's period (the time
//     the limit takes to refill a node's even share of one block... at
//     the fleet's full rate, one block per node), at least minBlockLease
//     and at most the storage's `lease`, on this node's clock.
//   - Error: a node holds at most one block of each limit. What the fleet
//     admits in any window differs from what the exact limit would by at
//     most the blocks held at the window's edges: one block per node, so
//     at most n/10 fleet-wide (and less when the limit is nearly spent,
//     as Redis then grants smaller blocks).
//
// A rate's block advances the limit's GCRA arrival time by the block's
// requests at once; giving back moves it back by the unused ones. A token
// block takes its tokens out of the bucket; the node charges its requests'
// estimates and corrections to the block while it lasts (the block may go
// into debt, as the bucket may), and gives back the rest, or charges the
// debt, when it ends. A correction that comes after its block ended goes to
// the node's next block, or to Redis (off the request's path, as without
// leases) when it holds none: either way it is counted once.

// Lease sizing.
const (
	leaseShare    = 10     // a block is a tenth of a node's even share
	minRateBlock  = 10     // requests: a smaller rate block is not worth it
	minTokenBlock = 10_000 // tokens
	minBlockLease = 100 * time.Millisecond
)

// block is what this node holds of one limit of a sharedLimit: a rate's
// requests or a token bucket's tokens, taken from Redis to admit from
// locally. Guarded by its sharedLimit's mu.
type block struct {
	gen   uint64    // changes whenever the block ends, or a new one starts
	until time.Time // when its lease ends; zero: no block held
	left  float64   // requests or tokens left (tokens: below zero in debt)
	size  int64     // the block asked for: the size in force
	nodes int64     // the relays up it was sized for
	// per is the limit's emission interval (a rate's block) or its tokens
	// a ms (a token block), burst its size, as when the block was taken:
	// what is left is given back by them
	per, burst float64
	refill     *refill // a request is taking the next block
	// what Redis said the limit had left once the block was taken, and
	// when it is full again: the rate limit headers of the requests the
	// block admits count on it
	fleetLeft int64
	full      time.Time
}

// held reports whether a block is held (its lease may have ended).
func (b *block) held() bool { return !b.until.IsZero() }

// live reports whether the block may admit at now.
func (b *block) live(now time.Time) bool { return b.held() && now.Before(b.until) }

// end ends the block, returning what is to be given back: the requests or
// tokens left (tokens: a debt is negative, to be charged).
func (b *block) end(next *uint64) float64 {
	if !b.held() {
		return 0
	}
	rest := b.left
	*next++
	*b = block{gen: *next, refill: b.refill}
	return rest
}

// blockSize is the block of a limit of n a period this node takes, or 0
// when the limit is not leased: too small a share, or the number of
// relays up not known yet.
func (f *Shared) blockSize(n float64, least int64) int64 {
	if f.noLeases.Load() {
		return 0
	}
	nodes := f.RelaysUp()
	if nodes <= 0 {
		return 0
	}
	b := int64(n / float64(leaseShare*nodes))
	if b < least {
		return 0
	}
	return b
}

// blockLease is how long a block of a limit of period lasts.
func (f *Shared) blockLease(period time.Duration) time.Duration {
	return min(max(period/leaseShare, minBlockLease), f.Lease)
}

// leaseBlocks records that s holds a block, for the worker that ends
// blocks whose lease ran out.
func (f *Shared) leaseBlocks(s *sharedLimit) {
	f.blocksMu.Lock()
	f.blocks[s] = struct{}{}
	f.blocksMu.Unlock()
	select {
	case f.blocksNew <- struct{}{}:
	default:
	}
}

// expireBlocks ends the blocks whose lease ran out and gives back what is
// left of them, off the request's path, until ctx ends.
func (f *Shared) expireBlocks(ctx context.Context) {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		next := f.endBlocks(f.now(), false)
		wait := time.Hour
		if !next.IsZero() {
			wait = max(next.Sub(f.now()), time.Millisecond)
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-f.blocksNew:
		}
	}
}

// endBlocks ends the blocks whose lease ended at now (every block, with
// all set) and queues what is left of them to be given back; it returns
// the earliest end of the blocks still held (zero: none).
func (f *Shared) endBlocks(now time.Time, all bool) time.Time {
	f.blocksMu.Lock()
	list := make([]*sharedLimit, 0, len(f.blocks))
	for s := range f.blocks {
		list = append(list, s)
	}
	f.blocksMu.Unlock()
	var next time.Time
	for _, s := range list {
		r, held := s.endBlocks(now, all)
		if r.requests > 0 || r.tokens != 0 {
			f.queueRelease(r)
		}
		slots, until := s.endSlots(now, all)
		if slots && (next.IsZero() || until.Before(next)) {
			next = until
		}
		held = held || slots
		if !held {
			f.blocksMu.Lock()
			if s.holdsNone() {
				delete(f.blocks, s)
			}
			f.blocksMu.Unlock()
			continue
		}
		for _, b := range []*block{&s.rb, &s.tb} {
			s.mu.Lock()
			if b.held() && (next.IsZero() || b.until.Before(next)) {
				next = b.until
			}
			s.mu.Unlock()
		}
	}
	return next
}

// endBlocks ends the blocks of s whose lease ended at now (all: every
// one), but not one a request is replacing, and returns the release that
// gives back what is left, and whether s still holds a block.
func (s *sharedLimit) endBlocks(now time.Time, all bool) (release, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var requests, emission, tokens, perMs, burst float64
	if b := &s.rb; b.held() && (all || !b.live(now)) {
		emission = b.per
		requests = b.end(&s.gens)
	}
	if b := &s.tb; b.held() && (all || !b.live(now)) {
		perMs, burst = b.per, b.burst
		tokens = b.end(&s.gens)
	}
	return blockRelease(s, requests, emission, tokens, perMs, burst), s.rb.held() || s.tb.held()
}

// holdsNone reports whether s holds no block and is taking none.
func (s *sharedLimit) holdsNone() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return !s.rb.held() && !s.tb.held() && !s.cb.held() && s.refills.Load() == 0
}

// giveBackRateScript gives back requests of a rate's block that were not
// used: the arrival time moves back by them (never before now). KEYS: the
// rate's arrival time. ARGV: the emission interval in ms, the requests.
var giveBackRateScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tat = tonumber(redis.call('GET', KEYS[1]) or 0)
tat = tat - tonumber(ARGV[1]) * tonumber(ARGV[2])
if tat > now then
  redis.call('SET', KEYS[1], tat, 'PX', math.ceil(tat - now) + 1000)
else
  redis.call('DEL', KEYS[1])
end
return 0
`)

// emission is the rate's emission interval in ms; 0 for no rate.
func (l Spec) emission() float64 {
	if l.Rate.N <= 0 {
		return 0
	}
	return float64(l.Rate.Period.Milliseconds()) / l.Rate.N
}

// tokensPerMs is the token limit's refill in tokens a ms; 0 for none.
func (l Spec) tokensPerMs() float64 {
	if l.Tokens.N <= 0 {
		return 0
	}
	return l.Tokens.N / float64(l.Tokens.Period.Milliseconds())
}

// maxBlockInfos bounds the blocks a node lists in its heartbeat.
const maxBlockInfos = 100

// blockInfos lists the blocks this node holds, the largest errors first,
// at most maxBlockInfos.
func (f *Shared) blockInfos(now time.Time) []fleet.Block {
	f.blocksMu.Lock()
	list := make([]*sharedLimit, 0, len(f.blocks))
	for s := range f.blocks {
		list = append(list, s)
	}
	f.blocksMu.Unlock()
	out := []fleet.Block{}
	for _, s := range list {
		s.mu.Lock()
		for kind, b := range map[string]*block{"requests": &s.rb, "tokens": &s.tb} {
			if b.live(now) {
				out = append(out, fleet.Block{Limit: s.thing, Kind: kind, Block: b.size, Left: int64(math.Floor(b.left)),
					Nodes: b.nodes, MaxFleetError: b.size * b.nodes, Until: f.wallTime(now, b.until)})
			}
		}
		if b := &s.cb; b.held() {
			held := int64(len(b.ids))
			out = append(out, fleet.Block{Limit: s.thing, Kind: "concurrency", Block: b.size, Left: held - b.used, Held: held,
				Nodes: b.nodes, MaxFleetError: b.size * b.nodes, Until: f.wallTime(now, b.until)})
		}
		s.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b fleet.Block) int {
		if a.MaxFleetError != b.MaxFleetError {
			return int(b.MaxFleetError - a.MaxFleetError)
		}
		return strings.Compare(a.Limit+a.Kind, b.Limit+b.Kind)
	})
	if len(out) > maxBlockInfos {
		out = out[:maxBlockInfos]
	}
	return out
}

// wallTime is the wall-clock time of t, a time on the clock of now, in UTC.
func (f *Shared) wallTime(now, t time.Time) time.Time {
	return time.Now().Add(t.Sub(now)).UTC().Truncate(time.Millisecond)
}

// endAllBlocks ends every block of s, and gives back what is left of them
// off the request's path: its limits changed, or are no longer the
// fleet's. Slots that requests use go back as each ends.
func (s *sharedLimit) endAllBlocks() {
	if r, _ := s.endBlocks(time.Time{}, true); r.requests > 0 || r.tokens != 0 {
		s.f.queueRelease(r)
	}
	s.endSlots(time.Time{}, true)
}

// lastLeft is what Redis last said the limits had left (not known: it was
// never asked).
func (s *sharedLimit) lastLeft() Headroom {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}
