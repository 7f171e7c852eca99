package health

import "time"

// Cooldowns per model class. Anthropic, Bedrock and Vertex limit each model
// class of an account separately: a busy Opus workload spends Opus's
// requests and tokens, not Sonnet's. So what an upstream says about a
// limit (a 429, a 529, an anthropic-ratelimit-* quota at 0) cools the
// channel for the class of the model that answered, and the channel keeps
// serving the other classes. Everything else that cools (5xx, network
// errors, a refused credential) and the breaker stay the channel's.
//
// Which class a model is on a channel is the relay's to say (its config's
// model_class lines, the families, the price rows): here a class is a
// name, bounded in length, and the classes cooling on one channel are
// bounded in number, whatever other nodes of a fleet publish.

// maxClassCooldowns bounds the classes remembered as cooling per channel.
// The classes a config can name are bounded already; this holds for what
// other nodes of a fleet publish too.
const maxClassCooldowns = 64

// MaxClassLen bounds a class name, as a model id is bounded.
const MaxClassLen = 256

// ClassCooldown is one class cooling on a channel, in Unix nanoseconds.
type ClassCooldown struct {
	Until      int64  // the end of its cooldown
	Limited    int64  // the end of the part an upstream's reset set (a 429's wait, a spent quota)
	Overloaded int64  // the end of the part an upstream's 529 set
	Reason     string // why, worded as the channel's cooldown reasons
}

// OutBy says what keeps the class out: the part of its cooldown that
// lasts longest.
func (e ClassCooldown) OutBy() OutBy {
	switch {
	case e.Limited >= e.Until:
		return OutReset
	case e.Overloaded >= e.Until:
		return OutOverload
	}
	return OutOther
}

// classCooldowns are the classes cooling on a channel, copied on write
// (with the channel's lock held) and read without the lock on every
// selection.
type classCooldowns struct {
	latest  int64 // the latest end among them: past it, no class cools
	byClass map[string]ClassCooldown
}

// ClassCooling reports whether any class cools on the channel at now: one
// atomic load, so that a selection resolves no class while none cools.
func (h *Channel) ClassCooling(now time.Time) bool {
	c := h.classes.Load()
	return c != nil && c.latest > now.UnixNano()
}

// ClassOut reports whether class cools on the channel at now, until when,
// and what keeps it out: only an upstream's reset (a 429's wait, a spent
// quota), only an upstream's overload (a 529), or both.
func (h *Channel) ClassOut(class string, now time.Time) (out bool, until time.Time, by OutBy) {
	c := h.classes.Load()
	n := now.UnixNano()
	if c == nil || c.latest <= n {
		return false, time.Time{}, OutOther
	}
	e, ok := c.byClass[class]
	if !ok || e.Until <= n {
		return false, time.Time{}, OutOther
	}
	return true, time.Unix(0, e.Until), e.OutBy()
}

// coolClass cools class until until (of which until limited is an
// upstream's reset, until overloaded an upstream's 529; 0: none) for
// reason ("": keep the reason it has); an end already past changes
// nothing. Ends only move later. Ended entries go; when maxClassCooldowns
// cool, the one that ends first makes room. It reports whether the end
// moved. h.mu is held.
func (h *Channel) coolClass(class string, until, limited, overloaded int64, reason string, now time.Time) bool {
	n := now.UnixNano()
	if class == "" || len(class) > MaxClassLen || until <= n {
		return false
	}
	next := &classCooldowns{byClass: map[string]ClassCooldown{}}
	if cur := h.classes.Load(); cur != nil {
		for k, v := range cur.byClass {
			if v.Until > n {
				next.byClass[k] = v
			}
		}
	}
	e, had := next.byClass[class]
	if !had && len(next.byClass) >= maxClassCooldowns {
		first := ""
		for k, v := range next.byClass {
			if first == "" || v.Until < next.byClass[first].Until {
				first = k
			}
		}
		delete(next.byClass, first)
	}
	moved := until > e.Until
	if moved {
		e.Until = until
	}
	e.Limited = max(e.Limited, limited)
	e.Overloaded = max(e.Overloaded, overloaded)
	if reason != "" {
		e.Reason = reason
	}
	next.byClass[class] = e
	for _, v := range next.byClass {
		next.latest = max(next.latest, v.Until)
	}
	h.classes.Store(next)
	return moved
}

// CoolingClasses lists the classes cooling at now with their cooldowns;
// nil when none does.
func (h *Channel) CoolingClasses(now time.Time) map[string]ClassCooldown {
	c := h.classes.Load()
	if c == nil || c.latest <= now.UnixNano() {
		return nil
	}
	out := map[string]ClassCooldown{}
	for k, v := range c.byClass {
		if v.Until > now.UnixNano() {
			out[k] = v
		}
	}
	return out
}
