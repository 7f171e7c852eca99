package health

import (
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
)

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

// change is one change of a channel's health, as published. Times are in
// milliseconds from when it was sent.
type change struct {
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

// announce publishes a change this node made to the channel's health, when
// the channel is shared.
func (h *Channel) announce(c change) {
	s := h.shared.Load()
	if s == nil {
		return
	}
	c.Node, c.Channel = s.c.Node, h.name
	select {
	case s.publish <- c:
	default: // far behind: the next sync brings the state in
		fleet.Failed("publish")
	}
}

// overload reports whether the change is a cooldown another node's 529
// started, as it published it. A node's stored state says which error
// came last, not which cooldown it started: from it, a cooldown is taken
// without its cause (the refusals it makes are 503s).
func (c change) overload() bool {
	return c.Node != "" && c.Error == Overloaded.String()
}

// apply applies a change another node published.
func (h *Channel) apply(c change, now time.Time) {
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
func (h *Channel) applyClass(c change, now time.Time) {
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
func (h *Channel) applyStored(st []any, now time.Time, node string) {
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
		h.applyClass(change{Kind: changeCool, Class: class, Until: until, Limited: limited, Reason: reason}, now)
	}
	var ms [5]int64
	for i := range ms {
		ms[i], _ = st[i].(int64)
	}
	c := change{Kind: changeCool, Until: ms[0], Limited: ms[1], Quota: ms[2]}
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
func (h *Channel) own(now time.Time) []any {
	left := func(a int64) int64 { return max(0, (a-now.UnixNano())/int64(time.Millisecond)) }
	args := []any{changeSync, left(h.until.Load()), left(h.limitedUntil.Load()), left(h.quotaUntil.Load()), left(h.openUntil.Load()), "", ""}
	for class, c := range h.CoolingClasses(now) {
		args = append(args, class, left(c.Until), left(c.Limited), "")
	}
	return args
}
