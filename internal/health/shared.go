package health

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/redis/go-redis/v9"
)

// Health shared by a fleet. A node that sees a channel fail (a cooldown, a
// model class's cooldown, a breaker that opens or closes, a spent quota)
// or that an admin steers
// (disable, enable, reset) applies the change at once, then publishes it:
//
//   - on a Redis pub/sub channel (prefix + "health"), which every node
//     subscribes to and applies as it arrives, so a cooldown set on one
//     node holds on the others within milliseconds;
//   - into a hash per channel ({c:name}:health), for the nodes that join
//     later or were cut off: a node loads it when it starts, and again each
//     time its subscription is restored.
//
// Times travel as the milliseconds left, and the hash keeps them on Redis's
// clock (TIME), so the nodes' clocks need not agree. Cooldown ends only
// move later (a shorter cooldown from another node does not shorten one).
// A breaker opened on one node is opened on the others (each then probes
// when it turns half-open); one that closes closes everywhere.

// healthScript stores a change in a channel's health hash, and returns the
// stored state as the milliseconds left of until, limited, quota and open
// (0 when past), disabled (0 or 1), and the last error and its reason (""
// when none), then for each model class still cooling its name, the
// milliseconds left of its until and limited, and its reason. KEYS: the
// hash. ARGV: the kind, the milliseconds left of until, limited, quota and
// open (0: unchanged), the error and its reason ("": unchanged), then for
// each model class a change is about its name, the milliseconds left of
// its until and limited (0: unchanged) and its reason ("": unchanged).
// Kind "sync" stores times as "cool" does; it is how a node brings its own
// state in and takes the fleet's. A class is kept in the fields cu:<class>
// (until), cl:<class> (limited) and cr:<class> (reason), dropped once its
// cooldown has ended.
var healthScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local kind = ARGV[1]
local fields = {'until', 'limited', 'quota', 'open'}
local function raise(f, left)
  if left > 0 and now + left > (tonumber(redis.call('HGET', KEYS[1], f)) or 0) then
    redis.call('HSET', KEYS[1], f, now + left)
  end
end
if kind == 'cool' or kind == 'open' or kind == 'sync' then
  for i, f in ipairs(fields) do raise(f, tonumber(ARGV[i + 1])) end
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[6], 'reason', ARGV[7]) end
  for i = 8, #ARGV - 3, 4 do
    local c = ARGV[i]
    raise('cu:' .. c, tonumber(ARGV[i + 1]))
    raise('cl:' .. c, tonumber(ARGV[i + 2]))
    if ARGV[i + 3] ~= '' then redis.call('HSET', KEYS[1], 'cr:' .. c, ARGV[i + 3]) end
  end
elseif kind == 'closed' then
  redis.call('HDEL', KEYS[1], 'open')
elseif kind == 'reset' then
  redis.call('HDEL', KEYS[1], 'until', 'limited', 'quota', 'open', 'error', 'reason')
  for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
    local p = string.sub(f, 1, 3)
    if p == 'cu:' or p == 'cl:' or p == 'cr:' then redis.call('HDEL', KEYS[1], f) end
  end
elseif kind == 'disable' then
  redis.call('HSET', KEYS[1], 'disabled', 1)
elseif kind == 'enable' then
  redis.call('HDEL', KEYS[1], 'disabled')
end
local h = redis.call('HMGET', KEYS[1], 'until', 'limited', 'quota', 'open', 'disabled', 'error', 'reason')
local out = {}
for i = 1, 4 do out[i] = math.max(0, (tonumber(h[i]) or 0) - now) end
out[5] = tonumber(h[5]) or 0
out[6] = h[6] or ''
out[7] = h[7] or ''
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(f, 1, 3) == 'cu:' then
    local c = string.sub(f, 4)
    local left = (tonumber(redis.call('HGET', KEYS[1], f)) or 0) - now
    if left > 0 then
      out[#out + 1] = c
      out[#out + 1] = left
      out[#out + 1] = math.max(0, (tonumber(redis.call('HGET', KEYS[1], 'cl:' .. c)) or 0) - now)
      out[#out + 1] = redis.call('HGET', KEYS[1], 'cr:' .. c) or ''
    else
      redis.call('HDEL', KEYS[1], f, 'cl:' .. c, 'cr:' .. c)
    end
  end
end
return out
`)

// Shared is the health a relay shares with its fleet, on the fleet's
// client: the channels shared with it (Channel.Share), the worker that
// publishes and stores their changes and syncs their state, and the
// subscription that applies the other nodes' changes.
type Shared struct {
	c       *fleet.Client
	publish chan change   // health changes of this node, to publish
	resync  chan struct{} // asks for a sync of every shared channel's health

	mu       sync.Mutex
	channels map[string]*Channel // the channels shared with it, by name
}

// NewShared shares health through the fleet of c: its publisher and its
// subscription run as c's background work until c stops, and each time
// Redis is back after an outage (c's OnUp) the node syncs.
func NewShared(c *fleet.Client) *Shared {
	s := &Shared{
		c:        c,
		publish:  make(chan change, 1024),
		resync:   make(chan struct{}, 1),
		channels: map[string]*Channel{},
	}
	c.OnUp(s.ResyncSoon)
	c.Go(s.publishHealth)
	c.Go(s.subscribeHealth)
	return s
}

// add shares h with s.
func (s *Shared) add(h *Channel) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.channels[h.name] = h
}

// forget stops sharing h with s, unless another channel of its name took
// its place.
func (s *Shared) forget(h *Channel) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.channels[h.name] == h {
		delete(s.channels, h.name)
	}
}

// channel is the channel named name shared with s, or nil.
func (s *Shared) channel(name string) *Channel {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.channels[name]
}

// healthKey is the hash that keeps a channel's health.
func (s *Shared) healthKey(channel string) string { return s.c.Key(fleet.Tag("c:", channel), "health") }

// healthTopic is the pub/sub channel of health changes.
func (s *Shared) healthTopic() string { return s.c.Prefix + "health" }

// ResyncSoon asks the publisher to bring this node's state in and take the
// fleet's, for every shared channel.
func (s *Shared) ResyncSoon() {
	select {
	case s.resync <- struct{}{}:
	default:
	}
}

// publishHealth sends this node's health changes, as many at once as have
// queued, and syncs when asked, until ctx ends. Admin changes that could
// not be sent wait for the next sync; the others need not, as a sync sends
// the state they left.
func (s *Shared) publishHealth(ctx context.Context) {
	pending := map[string]change{} // channel -> its last admin change not yet sent
	batch := make([]change, 0, 64)
	for {
		batch = batch[:0]
		select {
		case <-ctx.Done():
			return
		case c := <-s.publish:
			batch = append(batch, c)
		more:
			for len(batch) < cap(batch) {
				select {
				case c := <-s.publish:
					batch = append(batch, c)
				default:
					break more
				}
			}
			if err := s.send(batch); err != nil {
				for _, c := range batch {
					if c.Kind == changeDisable || c.Kind == changeEnable || c.Kind == changeReset {
						pending[c.Channel] = c
					}
				}
			}
		case <-s.resync:
			if len(pending) > 0 {
				batch = batch[:0]
				for _, c := range pending {
					batch = append(batch, c)
				}
				if s.send(batch) != nil {
					continue
				}
				clear(pending)
			}
			s.sync()
		}
	}
}

// send stores and publishes changes in one round trip.
func (s *Shared) send(batch []change) error {
	return s.c.Background("publish", func(ctx context.Context) error {
		_, err := s.c.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, c := range batch {
				msg, _ := json.Marshal(c)
				seen := " (seen by " + c.Node + ")"
				args := []any{c.Kind, c.Until, c.Limited, c.Quota, c.Open, c.Error, c.Reason + seen}
				if c.Class != "" { // the class's times and reason, not the channel's; its last error
					args = []any{c.Kind, 0, 0, 0, 0, c.Error, c.Reason + " (class " + c.Class + ")" + seen, c.Class, c.Until, c.Limited, c.Reason + seen}
				}
				healthScript.Eval(ctx, pipe, []string{s.healthKey(c.Channel)}, args...)
				pipe.Publish(ctx, s.healthTopic(), msg)
			}
			return nil
		})
		return err
	})
}

// sync sends the state of every shared channel of this node to Redis and
// applies what the fleet holds, in one round trip.
func (s *Shared) sync() {
	s.mu.Lock()
	names := make([]string, 0, len(s.channels))
	states := make([]*Channel, 0, len(s.channels))
	for name, h := range s.channels {
		names, states = append(names, name), append(states, h)
	}
	s.mu.Unlock()
	if len(names) == 0 {
		return
	}
	now := time.Now()
	cmds := make([]*redis.Cmd, len(names))
	steered := make([]uint64, len(names))
	for i, h := range states {
		steered[i] = h.steered.Load()
	}
	err := s.c.Background("sync", func(ctx context.Context) error {
		_, err := s.c.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for i, h := range states {
				cmds[i] = healthScript.Eval(ctx, pipe, []string{s.healthKey(names[i])}, h.own(now)...)
			}
			return nil
		})
		return err
	})
	if err != nil {
		return
	}
	now = time.Now()
	for i, h := range states {
		// a reset, enable or disable that came while the sync ran is newer
		// than what it read; the next sync brings the rest in
		if st, err := cmds[i].Slice(); err == nil && h.steered.Load() == steered[i] {
			h.applyStored(st, now, s.c.Node)
		}
	}
}

// subscribeHealth applies the health changes the other nodes publish,
// until ctx ends. Each time the subscription is made (again, after Redis
// was lost), the node syncs: what it missed meanwhile is in the hashes.
func (s *Shared) subscribeHealth(ctx context.Context) {
	s.c.Subscribe(ctx, s.healthTopic(), s.ResyncSoon, func(payload string) {
		var c change
		if json.Unmarshal([]byte(payload), &c) != nil || c.Node == s.c.Node {
			return
		}
		if h := s.channel(c.Channel); h != nil {
			h.apply(c, time.Now())
		}
	})
}
