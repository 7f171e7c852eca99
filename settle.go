package relay

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/sse"
	"github.com/tidwall/gjson"
)

// Output is billed when a client leaves. The upstream goes on generating
// after a client closes its connection, and reports what the answer cost
// only at its end (a stream's message_delta, a message's usage), so a
// client that took the content and left would otherwise be billed its input
// alone. When a stream's client leaves after part of the content, or a
// non-streaming request's client before the answer, the attempt reads on
// for settle_grace from the client's leaving, writing nothing more, and
// takes the usage the end reports. Without it in time (the grace ends, the
// upstream breaks), a stream's output is estimated from the content its
// client was sent, and the request is marked estimated. Either way the key's
// spend, its token limits, its end user's and the channel's see the output.
//
// A stream whose client leaves before its content ends at once, and a
// non-streaming request whose answer did not come within the grace is
// abandoned; either way the upstream took its input and bills it, so the
// request is charged that input (leftBefore): as the upstream counted it
// (a stream's message_start), else the input estimate, marked estimated.
// A client cannot leave a large prompt unpaid by hanging up early. The
// grace overlaps dedup_grace: both count from the client's leaving, and a
// request that another follows reads to its end anyway (dedup.go).

const defaultSettleGrace = 2 * time.Second

// errSettleGrace is the cause that ends an attempt whose client left, when
// settle_grace is over.
var errSettleGrace = errors.New("settle_grace is over")

// detached is the parent of an attempt's context: the values of its
// client's request, and never an end of its own, so that the client's
// leaving does not cut the upstream off by itself (deadline.leave decides).
// It lives in the attempt's deadline, so it costs no allocation.
type detached struct{ context.Context }

func (detached) Deadline() (time.Time, bool) { return time.Time{}, false }
func (detached) Done() <-chan struct{}       { return nil }
func (detached) Err() error                  { return nil }

// What the client's leaving does to an attempt (deadline.phase).
const (
	phaseEnd    uint32 = iota // it ends the attempt at once: nothing was made for the client yet
	phaseReadOn               // the attempt reads on for the grace
	phaseLeft                 // the client has left
)

// watch starts watching the client's context (the request's; a lead's,
// which ends after dedup_grace): its end is the client leaving. A lead's
// context takes the function itself.
func (d *deadline) watch(client context.Context) {
	if a, ok := client.(afterFuncer); ok {
		d.unwatch = a.AfterFunc(d.leave)
		return
	}
	d.unwatch = context.AfterFunc(client, d.leave)
}

// readOn says that from now on the attempt is worth reading on after its
// client leaves: a non-streaming request has been sent, a stream's content
// has been sent to the client.
func (d *deadline) readOn() { d.phase.CompareAndSwap(phaseEnd, phaseReadOn) }

// gone reports whether the client has left.
func (d *deadline) gone() bool { return d.phase.Load() == phaseLeft }

// leave is the client leaving, as the watch or a failed write finds it;
// only the first call counts. An attempt that is not worth reading on is
// canceled at once; one that is ends settle_grace after the client left.
func (d *deadline) leave() {
	p := d.phase.Swap(phaseLeft)
	if p == phaseLeft {
		return
	}
	r := d.relay
	now := r.now()
	grace := r.settleGrace - now.Sub(d.in.leftAt(now))
	if p != phaseReadOn || grace <= 0 {
		d.cancel(context.Canceled)
		return
	}
	d.settling.Store(r.graceTimer(grace, d.graceOver))
}

func (d *deadline) graceOver() { d.cancel(errSettleGrace) }

// end stops the attempt's timers and its watch of the client. An attempt
// whose client left and that is not done is canceled, whatever its
// upstream answered meanwhile: nobody is left to fail over for, and the
// channel is not judged by what the client's leaving made of it.
func (d *deadline) end(res *attemptResult) {
	d.timer.Stop()
	if d.unwatch != nil {
		d.unwatch()
	}
	if t := d.settling.Load(); t != nil {
		t.Stop()
	}
	if !res.done && d.gone() {
		res.verdict = verdict{outcome: outcomeCanceled, reason: "client canceled"}
	}
}

// leftAt records that the request's client left, at now, unless an earlier
// time is recorded (a lead records when its own client left, before the
// attempt sees it), and returns when it left.
func (in *inbound) leftAt(now time.Time) time.Time {
	in.left.CompareAndSwap(0, now.UnixNano())
	return time.Unix(0, in.left.Load())
}

// settle reads the rest of a stream whose client left, nothing of it
// written, until the upstream ends it, breaks, or settle_grace is over: the
// final usage of its message_delta is the answer's. Without it, the output
// is the estimate of the content the client was sent. ev is the event read
// when the client was found gone, if err is nil.
func (s *streamAttempt) settle(rd *sse.Reader, ev sse.Event, err error) attemptResult {
	s.deadline.leave() // the grace runs from now, if the watch has not seen it yet
	for err == nil {
		if string(ev.Name) == "message_delta" && gjson.ValidBytes(ev.Data) {
			s.in.end.counted(ev.Name, ev.Data)
		}
		if string(ev.Name) == "message_stop" {
			s.drain(rd)
			break
		}
		ev, err = rd.Next()
	}
	s.in.end.finished(false)
	return attemptResult{verdict: verdict{outcome: outcomeCanceled, reason: "client gone"}, channel: s.ch, done: true}
}

// The estimate of a stream's output. What a client was sent is weighed as
// a tokenizer would count it: each word (a run of ASCII letters and
// digits), each punctuation mark, each other character (CJK scripts take
// about one token a character), newlines and tabs, in twentieths of a
// token. The weights were fitted to the published Claude tokenizer on
// English prose, technical docs, licenses, Go and Python code, JSON and
// Chinese, streamed in deltas of one to six tokens: the estimate is within
// 4% of the real count on each, where bytes/4 is off by up to 32% (code and
// JSON have far more tokens a byte than prose).
const (
	unitsPerToken = 20
	unitsWord     = 21
	unitsPunct    = 14
	unitsOther    = 18 // a character outside ASCII
	unitsNewline  = 25
	unitsTab      = 22
)

// estimatedOutput is the output of the content counted so far, rounded up.
func (u *usage) estimatedOutput() int64 {
	return (u.content + unitsPerToken - 1) / unitsPerToken
}

// deltaContent weighs the content of a content_block_delta event (text,
// a tool's input JSON, thinking), in units; 0 for any other delta. It is
// on every stream's path, so Anthropic's own framing of the event is
// found without a parse, and any other by gjson.
func deltaContent(data []byte) int64 {
	s := jsonscan.String(data)
	if rest, ok := strings.CutPrefix(s, `{"type":"content_block_delta","index":`); ok {
		i := 0
		for i < len(rest) && '0' <= rest[i] && rest[i] <= '9' {
			i++
		}
		if obj, ok := strings.CutPrefix(rest[i:], `,"delta":{`); ok {
			return objectContent(obj) // it stops at the end of the delta object
		}
	}
	delta := gjson.Get(s, "delta")
	if !delta.IsObject() {
		return 0
	}
	return objectContent(delta.Raw[1:])
}

// objectContent weighs the text, partial_json and thinking strings of a
// delta object, valid JSON (the event was checked), from just past its
// opening brace.
func objectContent(obj string) (units int64) {
	i := 0
	for {
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] != '"' {
			return units
		}
		keyEnd := stringEnd(obj, i)
		key := obj[i+1 : keyEnd-1]
		i = skipSpace(obj, keyEnd)
		i = skipSpace(obj, i+1) // past ':'
		if i >= len(obj) {
			return units
		}
		if obj[i] == '"' {
			end := stringEnd(obj, i)
			if key == "text" || key == "partial_json" || key == "thinking" {
				units += stringContent(obj[i+1 : end-1])
			}
			i = end
		} else {
			i = valueEnd(obj, i)
		}
		i = skipSpace(obj, i)
		if i >= len(obj) || obj[i] != ',' {
			return units
		}
		i++
	}
}

// Classes of the bytes of a string's body, for stringContent.
const (
	bytePunct     = iota // ASCII punctuation and symbols, control characters
	byteAlnum            // an ASCII letter or digit
	byteSpace            // a space or a carriage return: free
	byteNewline          // \n
	byteTab              // \t
	byteLead             // the first byte of a character outside ASCII
	byteFollow           // a following byte of one
	byteBackslash        // an escape
)

var (
	byteClass = func() (c [256]uint8) {
		for b := range 256 {
			switch {
			case 'a' <= b && b <= 'z', 'A' <= b && b <= 'Z', '0' <= b && b <= '9':
				c[b] = byteAlnum
			case b == ' ', b == '\r':
				c[b] = byteSpace
			case b == '\n':
				c[b] = byteNewline
			case b == '\t':
				c[b] = byteTab
			case b == '\\':
				c[b] = byteBackslash
			case b >= 0xc0:
				c[b] = byteLead
			case b >= 0x80:
				c[b] = byteFollow
			}
		}
		return c
	}()
	classUnits = [...]int64{bytePunct: unitsPunct, byteNewline: unitsNewline, byteTab: unitsTab, byteLead: unitsOther, byteBackslash: 0}
)

// stringContent weighs the body of a JSON string as the text it encodes.
func stringContent(s string) (units int64) {
	word := false
	for i := 0; i < len(s); i++ {
		k := byteClass[s[i]]
		if k == byteAlnum {
			if !word {
				units += unitsWord
				word = true
			}
			continue
		}
		word = false
		if k == byteBackslash && i+1 < len(s) {
			i++
			switch s[i] {
			case 'n':
				k = byteNewline
			case 't':
				k = byteTab
			case 'r', 'b', 'f':
				k = byteSpace
			case 'u':
				k = byteSpace
				if i+4 < len(s) {
					r := hex4(s[i+1 : i+5])
					i += 4
					switch {
					case r >= 0xdc00 && r <= 0xdfff: // the second half of a pair, counted with the first
					case r >= 0x80:
						k = byteLead
					default:
						k = byteClass[r]
						if k == byteAlnum {
							units += unitsWord
							word = true
							continue
						}
					}
				}
			default: // \" \\ \/
				k = bytePunct
			}
		}
		units += classUnits[k]
	}
	return units
}

// hex4 reads four hex digits; a bad digit reads as 0.
func hex4(s string) (r int) {
	for i := 0; i < 4; i++ {
		c := s[i]
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			c = 0
		}
		r = r<<4 | int(c)
	}
	return r
}

func skipSpace(s string, i int) int {
	for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
		i++
	}
	return i
}

// stringEnd returns the index just past the JSON string that starts at i.
func stringEnd(s string, i int) int {
	for i++; i < len(s); i++ {
		switch s[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return len(s)
}

// valueEnd returns the index just past the JSON value (not a string) that
// starts at i.
func valueEnd(s string, i int) int {
	depth := 0
	for ; i < len(s); i++ {
		switch s[i] {
		case '"':
			i = stringEnd(s, i) - 1
		case '{', '[':
			depth++
		case '}', ']':
			if depth == 0 {
				return i
			}
			depth--
			if depth == 0 {
				return i + 1
			}
		case ',':
			if depth == 0 {
				return i
			}
		}
	}
	return i
}

// estimated accounts a request whose output was estimated: it is counted,
// and the part of its cost that the estimate makes is recorded in its
// principal's spend as estimated.
func (r *Relay) estimated(in *inbound, group string) {
	metricEstimated.WithLabelValues(group).Inc()
	rates, _ := r.ratesFor(in.grant.target, in.grant.counted)
	if rates == nil || in.who.state == nil || in.who.state.spend == nil {
		return
	}
	switch {
	case in.end.answered != nil: // its output is the estimate
		known := in.end.usage
		known.output = 0
		in.who.state.spend.ChargedEstimate(r.now(), in.end.cost-rates.Cost(known.priced())*in.end.answered.priceFactor, money.EstimateOutput)
	case in.end.leftOn != nil: // its input is the estimate, and all it cost
		in.who.state.spend.ChargedEstimate(r.now(), in.end.cost, money.EstimateOutput)
	}
}

// leftBefore charges a request whose client left before the answer of an
// attempt its upstream had accepted: the upstream processed, and bills,
// its input. It is the input the upstream counted (a stream's
// message_start, held), or failing that the input estimate, and then the
// request is marked estimated. (A non-streaming request whose answer came
// within settle_grace is charged that answer's usage instead: its attempt
// was done.)
func (in *inbound) leftBefore(res attemptResult) {
	if !res.accepted || res.channel == nil || res.prompt == (usage{}) {
		return
	}
	in.end.leftDuring(res.channel, res.prompt, res.estimatedInput)
}
