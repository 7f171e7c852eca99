package relay

import (
	"context"
	"encoding/json"
	"strings"
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

// Kinds of health change.
const (
	changeCool    = "cool"    // a cooldown, a 429's reset, or a spent quota: the times that moved
	changeOpen    = "open"    // the breaker opened
	changeClosed  = "closed"  // the breaker closed again after its probes
	changeDisable = "disable" // an admin disabled the channel
	changeEnable  = "enable"  // an admin enabled it
	changeReset   = "reset"   // an admin or a probe reset it
	changeSync    = "sync"    // a node's whole state, when it joins or rejoins
)

// healthChange is one change of a channel's health, as published. Times
// are in milliseconds from when it was sent.
type healthChange struct {
	Node    string `json:"node"`
	Channel string `json:"channel"`
	Kind    string `json:"kind"`
	// Class is the model class a cool change is about (its Until, Limited
	// and Reason); "": the channel
	Class   string `json:"class,omitempty"`
	Until   int64  `json:"until,omitempty"`   // cooldown
	Limited int64  `json:"limited,omitempty"` // the part of it a 429's reset set
	Quota   int64  `json:"quota,omitempty"`   // a spent quota
	Open    int64  `json:"open,omitempty"`    // the breaker stays open
	// Error and Reason say why, for the admin API of the other nodes.
	Error  string `json:"error,omitempty"`
	Reason string `json:"reason,omitempty"`
}

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

// share makes the channel's health and limits the fleet's (nil: this
// relay's own). Limits are kept in Redis only when the channel has some.
func (h *channelHealth) share(f *member) {
	h.fleet.Store(f)
	h.limits.Share(f.limitsOf(), fleet.Tag("c:", h.name))
	if f != nil {
		f.resyncSoon()
	}
}

// announce publishes a change this node made to the channel's health, when
// the channel is shared.
func (h *channelHealth) announce(c healthChange) {
	f := h.fleet.Load()
	if f == nil {
		return
	}
	c.Node, c.Channel = f.Node, h.name
	select {
	case f.publish <- c:
	default: // far behind: the next sync brings the state in
		fleet.Failed("publish")
	}
}

// overload reports whether the change is a cooldown another node's 529
// started, as it published it. A node's stored state says which error
// came last, not which cooldown it started: from it, a cooldown is taken
// without its cause (the refusals it makes are 503s).
func (c healthChange) overload() bool {
	return c.Node != "" && c.Error == outcomeOverloaded.String()
}

// apply applies a change another node published.
func (h *channelHealth) apply(c healthChange, now time.Time) {
	at := func(ms int64) int64 { return now.Add(time.Duration(ms) * time.Millisecond).UnixNano() }
	switch c.Kind {
	case changeCool:
		if c.Class != "" {
			h.applyClass(c, now)
			return
		}
		if c.Until > 0 {
			raiseTo(&h.until, at(c.Until))
		}
		if c.Limited > 0 {
			raiseTo(&h.limitedUntil, at(c.Limited))
		}
		if c.Until > 0 && c.overload() {
			raiseTo(&h.overloadedUntil, at(c.Until))
		}
		if c.Quota > 0 {
			raiseTo(&h.quotaUntil, at(c.Quota))
		}
		if c.Error != "" {
			reason := c.Reason // stored ones say by whom already
			if c.Node != "" {
				reason += " (seen by " + c.Node + ")"
			}
			h.mu.Lock()
			h.lastError, h.lastReason, h.lastErrorAt = outcomeNamed(c.Error), reason, now
			h.mu.Unlock()
		}
	case changeOpen:
		h.forceOpen()
	case changeClosed:
		h.closeBreaker()
	case changeDisable:
		h.steered.Add(1)
		h.disabled.Store(true)
	case changeEnable:
		h.steered.Add(1)
		h.disabled.Store(false)
	case changeReset:
		h.reset()
	}
}

// applyClass applies a model class's cooldown another node published.
func (h *channelHealth) applyClass(c healthChange, now time.Time) {
	at := func(ms int64) int64 {
		if ms <= 0 {
			return 0
		}
		return now.Add(time.Duration(ms) * time.Millisecond).UnixNano()
	}
	seen := ""
	if c.Node != "" {
		seen = " (seen by " + c.Node + ")"
	}
	reason := c.Reason
	if reason != "" {
		reason += seen // stored ones say by whom already
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	overloaded := int64(0)
	if c.overload() {
		overloaded = at(c.Until)
	}
	h.coolClass(c.Class, at(c.Until), at(c.Limited), overloaded, reason, now)
	if c.Error != "" {
		h.lastError, h.lastReason, h.lastErrorAt = outcomeNamed(c.Error), c.Reason+" (class "+c.Class+")"+seen, now
	}
}

// applyStored brings in the state stored in Redis (as healthScript returns
// it), when node joins or rejoins. The last error comes with a cooldown
// still running (the channel's or a class's), so that every node can say
// why a channel is out, unless node itself saw it; a class's reason
// likewise.
func (h *channelHealth) applyStored(st []any, now time.Time, node string) {
	if len(st) < 7 || (len(st)-7)%4 != 0 {
		return
	}
	for i := 7; i < len(st); i += 4 {
		class, _ := st[i].(string)
		until, _ := st[i+1].(int64)
		limited, _ := st[i+2].(int64)
		reason, _ := st[i+3].(string)
		if strings.HasSuffix(reason, "(seen by "+node+")") {
			reason = ""
		}
		h.applyClass(healthChange{Kind: changeCool, Class: class, Until: until, Limited: limited, Reason: reason}, now)
	}
	var ms [5]int64
	for i := range ms {
		ms[i], _ = st[i].(int64)
	}
	c := healthChange{Kind: changeCool, Until: ms[0], Limited: ms[1], Quota: ms[2]}
	cooling := ms[0] > 0 || ms[2] > 0 || len(st) > 7 // the channel, or a class of it
	if reason, _ := st[6].(string); cooling && !strings.HasSuffix(reason, "(seen by "+node+")") {
		c.Error, _ = st[5].(string)
		c.Reason = reason
	}
	h.apply(c, now)
	if ms[3] > 0 {
		h.forceOpen()
	}
	h.disabled.Store(ms[4] == 1)
}

// own is the channel's state on this node, as a sync sends it: the
// script's arguments after the hash's key.
func (h *channelHealth) own(now time.Time) []any {
	left := func(a int64) int64 { return max(0, (a-now.UnixNano())/int64(time.Millisecond)) }
	args := []any{changeSync, left(h.until.Load()), left(h.limitedUntil.Load()), left(h.quotaUntil.Load()), left(h.openUntil.Load()), "", ""}
	for class, c := range h.coolingClasses(now) {
		args = append(args, class, left(c.until), left(c.limited), "")
	}
	return args
}

// outcomeNamed is the outcome called name (success when none is).
func outcomeNamed(name string) outcome {
	for i, n := range outcomeNames {
		if n == name {
			return outcome(i)
		}
	}
	return outcomeSuccess
}

// healthKey is the hash that keeps a channel's health.
func (f *member) healthKey(channel string) string { return f.Key(fleet.Tag("c:", channel), "health") }

// healthTopic is the pub/sub channel of health changes.
func (f *member) healthTopic() string { return f.Prefix + "health" }

// resyncSoon asks the publisher to bring this node's state in and take the
// fleet's, for every shared channel.
func (f *member) resyncSoon() {
	select {
	case f.resync <- struct{}{}:
	default:
	}
}

// publishHealth sends this node's health changes, as many at once as have
// queued, and syncs when asked, until ctx ends. Admin changes that could
// not be sent wait for the next sync; the others need not, as a sync sends
// the state they left.
func (f *member) publishHealth(ctx context.Context) {
	pending := map[string]healthChange{} // channel -> its last admin change not yet sent
	batch := make([]healthChange, 0, 64)
	for {
		batch = batch[:0]
		select {
		case <-ctx.Done():
			return
		case c := <-f.publish:
			batch = append(batch, c)
		more:
			for len(batch) < cap(batch) {
				select {
				case c := <-f.publish:
					batch = append(batch, c)
				default:
					break more
				}
			}
			if err := f.send(batch); err != nil {
				for _, c := range batch {
					if c.Kind == changeDisable || c.Kind == changeEnable || c.Kind == changeReset {
						pending[c.Channel] = c
					}
				}
			}
		case <-f.resync:
			if len(pending) > 0 {
				batch = batch[:0]
				for _, c := range pending {
					batch = append(batch, c)
				}
				if f.send(batch) != nil {
					continue
				}
				clear(pending)
			}
			f.sync()
		}
	}
}

// send stores and publishes changes in one round trip.
func (f *member) send(batch []healthChange) error {
	return f.Background("publish", func(ctx context.Context) error {
		_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, c := range batch {
				msg, _ := json.Marshal(c)
				seen := " (seen by " + c.Node + ")"
				args := []any{c.Kind, c.Until, c.Limited, c.Quota, c.Open, c.Error, c.Reason + seen}
				if c.Class != "" { // the class's times and reason, not the channel's; its last error
					args = []any{c.Kind, 0, 0, 0, 0, c.Error, c.Reason + " (class " + c.Class + ")" + seen, c.Class, c.Until, c.Limited, c.Reason + seen}
				}
				healthScript.Eval(ctx, pipe, []string{f.healthKey(c.Channel)}, args...)
				pipe.Publish(ctx, f.healthTopic(), msg)
			}
			return nil
		})
		return err
	})
}

// sync sends the state of every shared channel of this node to Redis and
// applies what the fleet holds, in one round trip.
func (f *member) sync() {
	var names []string
	var states []*channelHealth
	channelStates.Range(func(k, v any) bool {
		if h := v.(*channelHealth); h.fleet.Load() == f {
			names, states = append(names, k.(string)), append(states, h)
		}
		return true
	})
	if len(names) == 0 {
		return
	}
	now := time.Now()
	cmds := make([]*redis.Cmd, len(names))
	steered := make([]uint64, len(names))
	for i, h := range states {
		steered[i] = h.steered.Load()
	}
	err := f.Background("sync", func(ctx context.Context) error {
		_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for i, h := range states {
				cmds[i] = healthScript.Eval(ctx, pipe, []string{f.healthKey(names[i])}, h.own(now)...)
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
			h.applyStored(st, now, f.Node)
		}
	}
}

// subscribeHealth applies the health changes the other nodes publish,
// until ctx ends. Each time the subscription is made (again, after Redis
// was lost), the node syncs: what it missed meanwhile is in the hashes.
func (f *member) subscribeHealth(ctx context.Context) {
	f.Subscribe(ctx, f.healthTopic(), f.resyncSoon, func(payload string) {
		var c healthChange
		if json.Unmarshal([]byte(payload), &c) != nil || c.Node == f.Node {
			return
		}
		if h := findChannel(c.Channel); h != nil && h.fleet.Load() == f {
			h.apply(c, time.Now())
		}
	})
}
