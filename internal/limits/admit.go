package limits

import (
	"context"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/redis/go-redis/v9"
)

// Admission. A request's limits (its key's, its end user's, its
// channel's) are admitted together, and with them its holds of its
// budgets, all or none: in one script call when one fleet keeps them
// (fleet.AdmitScript), with no round trip when this node's blocks serve
// them all. The holds are the spend accounts': the limits take them as
// parts of the admission they do not read (Hold), and leave their
// verdict to them (Holds).

// Ask is one limiter's part of a request's admission: the tokens it
// charges (-1: not held to tokens), and what it admitted (or, refused,
// what it has left).
type Ask struct {
	Limiter  *Limiter // nil: none
	Estimate int64    // tokens to charge; -1: not held to tokens
	Grant    Grant    // what it admitted, or, refused, what it has left
}

// Hold is one hold's part of an admission, prepared by the holds'
// owner: its keys and arguments of fleet.AdmitScript, its member in the
// account's holds, and, once Redis answered, what the script said of it.
type Hold struct {
	// Member is the hold's member in the account's holds:
	// <lease id>=<billionths of a dollar>
	Member string
	// Keys are the account's holds, its held total, and a spend total
	// per budget
	Keys []string
	// Args are the hold's arguments of the script: its member, expiry
	// (ms), how long the account's hold keys are kept at least (ms),
	// amount, number of budgets, and per budget its cap and what this
	// relay spent that Redis has not yet added
	Args []any
	// Answer is the script's verdict on the hold: {verdict (0 taken, 1
	// wait for holds in flight, 2 refused: what was spent and the hold
	// exceed a budget), the budget's index (1-based, in the order of
	// its keys), what was spent in its period, what the account held}
	Answer [4]int64
	// Of is the owner's own record of the hold, for it to read the
	// answer by (the limits never look at it)
	Of any
}

// Holds are a request's holds of its budgets, which its admission
// takes with its limits, all or none. A is what they answer when they are
// not all taken (its zero value: taken).
type Holds[A any] interface {
	// Pending reports whether there are holds to take.
	Pending() bool
	// Fleet is the fleet that keeps every hold; nil when one is kept on
	// this relay.
	Fleet() *Shared
	// Reserve takes every hold on this relay, or none (false, and why).
	Reserve(now time.Time) (A, bool)
	// Unreserve gives back every hold taken, unused.
	Unreserve()
	// Shares judges, on what this relay knows, whether the request fits
	// its group's shares of the caps it holds against (false, and why).
	Shares(now time.Time) (A, bool)
	// Parts prepares each hold's part of the fleet's admission, each a
	// lease of the fleet's.
	Parts(now time.Time) []*Hold
	// Refused is the answer when the fleet did not take the hold part i.
	Refused(i int, part *Hold) A
	// Admitted records that the fleet took every part, each held as a
	// lease this node renews until its owner drops it.
	Admitted(parts []*Hold)
}

// TakeAll admits one request against the limiters of asks (a request's
// key's and end user's limits, when they go with its first channel, and
// that channel's) and its holds (hs; nil: none), all or nothing: in one
// round trip when one fleet keeps them, and in none when this node's
// blocks of them serve it (fleet_leases.go). refused is the ask whose
// limiter refused (-1: none; with ScopeFleetDown, the fleet's store did
// not answer and on_error says deny); ans says why the holds were not
// taken (its zero value: they were, or there were none). Each admitted
// ask's Grant is to give back with Done.
func TakeAll[A any](now time.Time, asks []Ask, hs Holds[A]) (refused int, scope Scope, wait time.Duration, ans A) {
	var f *Shared
	local := false // the holds are this relay's
	pending := hs != nil && hs.Pending()
	if pending {
		if f = hs.Fleet(); f == nil {
			a, ok := hs.Reserve(now)
			if !ok {
				return -1, ScopeNone, 0, a
			}
			local = true
		}
	}
	if f == nil {
		for i := range asks {
			if asks[i].Limiter != nil {
				if s := asks[i].Limiter.shared.Load(); s != nil {
					f = s.f
					break
				}
			}
		}
	}
	held := true
	switch {
	case f == nil:
		refused, scope, wait = inTurn(now, asks, nil, (*Limiter).Take)
	case local || !pending:
		refused, scope, wait, ans, held = takeShared[A](f, now, asks, nil)
	default:
		refused, scope, wait, ans, held = takeShared(f, now, asks, hs)
	}
	if local && (refused >= 0 || !held) {
		hs.Unreserve()
	}
	return refused, scope, wait, ans
}

// inTurn admits one request against the limiters of asks that skip does
// not name (nil: all), one after the other with take; when one refuses,
// what the others admitted is given back. It returns the ask that
// refused (-1: none).
func inTurn(now time.Time, asks []Ask, skip func(int) bool, take func(*Limiter, time.Time, int64) (Grant, Scope, time.Duration)) (int, Scope, time.Duration) {
	for i := range asks {
		a := &asks[i]
		if a.Limiter == nil || skip != nil && skip(i) {
			continue
		}
		g, scope, wait := take(a.Limiter, now, a.Estimate)
		if scope != ScopeNone {
			giveBackAsks(now, asks[:i], skip)
			a.Grant = g
			return i, scope, wait
		}
		a.Grant = g
	}
	return -1, ScopeNone, 0
}

// GiveBack gives back what every ask admitted.
func GiveBack(now time.Time, asks []Ask) { giveBackAsks(now, asks, nil) }

// giveBackAsks gives back what the asks that skip does not name admitted.
func giveBackAsks(now time.Time, asks []Ask, skip func(int) bool) {
	for i := range asks {
		if a := &asks[i]; a.Limiter != nil && (skip == nil || !skip(i)) {
			a.Limiter.Done(now, a.Grant, 0)
			a.Grant = Grant{}
		}
	}
}

// takeShared is TakeAll for a request whose limits f keeps (some
// of them) and whose holds it keeps (hs; nil: none): the limits f keeps
// go in one script with the holds (in a Redis Cluster, one pipeline of a
// script each), and only when this node's blocks do not serve them all;
// the others are taken first, on their own. While Redis does not answer,
// the holds are taken on this relay, with the limits, as the limits are
// (or, on_error deny, refused). held is false when the holds were not
// taken, ans then says why.
func takeShared[A any](f *Shared, now time.Time, asks []Ask, hs Holds[A]) (refused int, scope Scope, wait time.Duration, ans A, held bool) {
	var inScript [4]bool
	for i := range asks {
		if l := asks[i].Limiter; l != nil {
			if s := l.shared.Load(); s != nil && s.f == f {
				inScript[i] = true
			}
		}
	}
	isIn := func(i int) bool { return inScript[i] }
	if i, scope, wait := inTurn(now, asks, isIn, (*Limiter).Take); i >= 0 {
		return i, scope, wait, ans, true
	}
	undo := func() { // what was taken outside the script
		giveBackAsks(now, asks, isIn)
	}
	if hs != nil { // a group's share of a channel cap's room, as this relay sees it
		if a, ok := hs.Shares(now); !ok {
			return -1, ScopeNone, 0, a, false
		}
	}
	var calls [4]*admitCall
	var which [4]int
	var hcs []*Hold
	r, rscope, rwait, notHeld := -1, ScopeNone, time.Duration(0), -1
	n, err := f.prepareAll(&now, asks, isIn, &calls, &which)
	if err == nil {
		if hs != nil {
			hcs = hs.Parts(now)
		}
		r, rscope, rwait, notHeld, err = f.admitAny(now, calls[:n], hcs)
	}
	switch {
	case err != nil && f.Deny:
		undo()
		return 0, ScopeFleetDown, 0, ans, true
	case err != nil: // Redis is down: this relay's own holds and limits meanwhile
		if hs != nil {
			if a, ok := hs.Reserve(now); !ok {
				undo()
				return -1, ScopeNone, 0, a, false
			}
		}
		notIn := func(i int) bool { return !inScript[i] }
		if i, scope, wait := inTurn(now, asks, notIn, (*Limiter).takeLocal); i >= 0 {
			if hs != nil {
				hs.Unreserve()
			}
			undo()
			return i, scope, wait, ans, true
		}
		return -1, ScopeNone, 0, ans, true
	case notHeld >= 0:
		undo()
		return -1, ScopeNone, 0, hs.Refused(notHeld, hcs[notHeld]), false
	case r >= 0:
		undo()
		i := which[r]
		a := &asks[i]
		a.Grant, _, _, _ = a.Limiter.settle(now, calls[r].s, calls[r].g, rscope, rwait, nil)
		return i, rscope, rwait, ans, true
	}
	for k := range n {
		a := &asks[which[k]]
		a.Grant, _, _, _ = a.Limiter.settle(now, calls[k].s, calls[k].g, ScopeNone, 0, nil)
	}
	if hs != nil {
		for _, h := range hcs {
			f.hold(leaseRef{h.Keys[0], h.Member}, true)
		}
		hs.Admitted(hcs)
	}
	return -1, ScopeNone, 0, ans, true
}

// readHolds reads the verdicts on holds from the admission script's
// answer (res, the holds' part of it), into each hold's answer. It
// returns the hold not taken (-1: every one was): the first refused,
// else the last that waits.
func readHolds(res []int64, holds []*Hold) (int, error) {
	notHeld := -1
	for i, h := range holds {
		v := res[4*i:]
		copy(h.Answer[:], v[:4])
		if v[0] == 0 {
			continue
		}
		if j := v[1]; j < 1 || j > int64(len(h.Keys)-2) {
			return -1, fleet.ErrDown // not an answer of this script
		}
		notHeld = i
		if v[0] == 2 {
			break
		}
	}
	return notHeld, nil
}

// AdmitHolds takes holds alone (a batch's), as a request's are taken:
// all or none, in one round trip. It returns the hold not taken (-1:
// every one was; its answer says why); err when Redis did not answer.
// The caller records each hold taken with HoldLease.
func (f *Shared) AdmitHolds(now time.Time, hcs []*Hold) (int, error) {
	_, _, _, notHeld, err := f.admitAny(now, nil, hcs)
	return notHeld, err
}

// admitAny is admitAll, but in a Redis Cluster, where one script cannot
// touch two things' keys (a key's and its channel's, a key's account and
// its group's), each thing and each hold takes a script of its own, all
// sent in one pipeline (to the nodes that hold their slots, at once); what
// was taken is given back when another refused. notHeld is then the first
// hold refused, else the first that waits (-1: none).
func (f *Shared) admitAny(now time.Time, calls []*admitCall, hcs []*Hold) (refused int, scope Scope, wait time.Duration, notHeld int, err error) {
	if !f.Cluster || len(calls)+len(hcs) < 2 {
		return f.admitAll(now, calls, hcs)
	}
	refused, notHeld = -1, -1
	cmds := make([]*redis.Cmd, len(calls)+len(hcs))
	asked := len(hcs) > 0
	for _, c := range calls {
		asked = asked || c.redis
	}
	if asked {
		err = f.Do("admit", func(ctx context.Context) error {
			_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
				for i, c := range calls {
					if c.redis {
						c.sent = true
						cmds[i] = fleet.AdmitScript.Eval(ctx, pipe, c.keys, append([]any{1, 0}, c.args...)...)
					}
				}
				for i, h := range hcs {
					cmds[len(calls)+i] = fleet.AdmitScript.Eval(ctx, pipe, h.Keys, append([]any{0, 0}, h.Args...)...)
				}
				return nil
			})
			return err
		})
	}
	failed := false
	type answer struct {
		left     Headroom
		got      taken
		admitted bool
		lost     bool // its answer did not come
	}
	got := make([]answer, len(calls))
	for i, c := range calls {
		if !c.redis {
			got[i].admitted = true
			continue
		}
		res, e := cmds[i].Int64Slice()
		if e != nil || len(res) != fleet.AdmitAnswer {
			failed, got[i].lost = true, true
			continue
		}
		left, s, w, taken := c.read(now, res)
		got[i] = answer{left: left, got: taken, admitted: s == ScopeNone}
		if s != ScopeNone && refused < 0 {
			refused, scope, wait = i, s, w
		}
	}
	taken := make([]bool, len(hcs))
	for i, h := range hcs {
		res, e := cmds[len(calls)+i].Int64Slice()
		if e != nil || len(res) != 4 {
			failed = true
			continue
		}
		k, e := readHolds(res, hcs[i:i+1])
		switch {
		case e != nil:
			failed = true
		case k < 0:
			taken[i] = true
		case notHeld < 0 || h.Answer[0] == 2 && hcs[notHeld].Answer[0] != 2:
			notHeld = i
		}
	}
	if !failed && refused < 0 && notHeld < 0 {
		for i, c := range calls {
			c.g = c.granted(now, got[i].left, got[i].got)
		}
		return -1, ScopeNone, 0, -1, nil
	}
	// not admitted: what the others took goes back
	for i, c := range calls {
		if c.redis && got[i].admitted {
			g := c.granted(now, got[i].left, got[i].got)
			c.s.giveBack(c.spec, g, -g.Charged)
			c.g = Grant{Left: g.Left}
			continue
		}
		var lost []string
		if got[i].lost {
			lost = c.lostBlock()
		}
		c.down = got[i].lost
		c.undo()
		f.releaseSlots(c.s, lost)
		c.g = Grant{Left: c.refusedLeft(got[i].left)}
	}
	for i, h := range hcs {
		if taken[i] {
			f.queueRelease(release{holdSet: h.Keys[0], holdTotal: h.Keys[1], member: h.Member})
		}
	}
	if failed {
		return -1, ScopeNone, 0, -1, fleet.ErrDown
	}
	return refused, scope, wait, notHeld, nil
}
