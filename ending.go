package relay

import (
	"time"

	"github.com/caddy-relay/relay/internal/money"
	"go.uber.org/zap/zapcore"
)

// The outcome of a request: what the client got, what it cost and what it
// took. Every step after admission writes to it, and only through the
// methods of this file (a test fails on a write anywhere else), so what an
// outcome can be is read here in one place, and account reads it whole.

// ending is how the request ended, written by the attempt, stream and
// account steps; zero until they run.
type ending struct {
	status     int           // sent to the client; 0 until then
	cause      string        // of a failure's answer, for the cause label; "" until then
	errCode    string        // of the relay's own error answer: its error.code, else its type; "" none
	attempts   int           // made so far
	answered   *channel      // the channel whose answer the client got
	firstByte  time.Duration // until the client's response headers
	chain      []attemptRecord
	usage      usage
	incomplete bool // the answer did not complete: tokens are the ones seen
	estimated  bool // its usage is an estimate: its output (the final count never came), or the input of a client that left before any answer (settle.go)
	// estimatedPrice says that its cost is at the estimate of a model the
	// price table does not know (unpriced.go)
	estimatedPrice bool
	// leftOn, when its client left before the answer, is the channel whose
	// upstream was working on it: the input it took is charged (settle.go)
	leftOn *channel
	cost   float64 // in USD: list price x price_factor of the channel that answered; set by account (price)
	wasted int64   // input tokens of attempts abandoned on the way (relay_wasted_tokens_total)
	shared string  // what answered it instead of an upstream (dedup.go); "": none
	// batch is what the request charged for the batch results it
	// accounted (resource_batches.go); nil for every other request
	batch *batchCharge
}

// sent notes the status the client got and when its first byte went: the
// recorder's, once (recorder.go).
func (e *ending) sent(status int, firstByte time.Duration) {
	e.status, e.firstByte = status, firstByte
}

// clientLeft notes a request whose client left before any answer.
func (e *ending) clientLeft() { e.status, e.incomplete = statusClientClosed, true }

// begin gives the chain of attempts its first storage (the request's own
// array, so a request of up to four attempts allocates none).
func (e *ending) begin(chain []attemptRecord) { e.chain = chain }

// attempted records one attempt in the chain.
func (e *ending) attempted(r attemptRecord) { e.chain = append(e.chain, r) }

// attempts is the chain as the log line writes it.
func (e *ending) attemptsLog() zapcore.ArrayMarshaler { return (*attemptChain)(&e.chain) }

// tries sets the number of attempts made so far; another adds one.
func (e *ending) tries(n int) { e.attempts = n }
func (e *ending) another()    { e.attempts++ }

// retry starts an attempt's usage from none: only the answer that reaches
// the client counts.
func (e *ending) retry() { e.usage = usage{} }

// counted reads usage from a stream's event.
func (e *ending) counted(name, data []byte) { e.usage.fromEvent(name, data) }

// countedMessage reads usage from a whole message.
func (e *ending) countedMessage(body []byte) { e.usage.fromMessage(body) }

// committed notes the channel whose answer the client gets.
func (e *ending) committed(ch *channel) { e.answered = ch }

// cutOn notes an answer made for the client on ch that never reached it
// whole (its client left while it came): its bill is the client's.
func (e *ending) cutOn(ch *channel) { e.answered, e.incomplete = ch, true }

// cut notes an answer that did not reach the client whole.
func (e *ending) cut() { e.incomplete = true }

// whole notes whether an answer reached the client whole.
func (e *ending) whole(ok bool) { e.incomplete = !ok }

// finished ends a stream, whole when ok: one that did not end whole leaves
// the client with a partial answer whose output the upstream did not
// report, billed the estimate of the content the client was sent.
func (e *ending) finished(ok bool) {
	e.incomplete = !ok
	if e.incomplete && !e.usage.final {
		e.usage.output = max(e.usage.output, e.usage.estimatedOutput())
		e.estimated = true
	}
}

// leftDuring notes a client that left before the answer while ch worked
// on it: the input ch took (prompt; estimated when the upstream had not
// counted it) is charged (settle.go).
func (e *ending) leftDuring(ch *channel, prompt usage, estimated bool) {
	e.usage, e.leftOn, e.incomplete = prompt, ch, true
	e.estimated = e.estimated || estimated
}

// failed notes the relay's own error answer: its cause label and its
// error.code (else its type).
func (e *ending) failed(cause, code string) { e.cause, e.errCode = cause, code }

// upstreamAnswered notes an upstream's answer passed on as the failure's
// answer, and whose fault it was.
func (e *ending) upstreamAnswered(ch *channel, cause string) { e.answered, e.cause = ch, cause }

// priced sets the request's cost, and whether it is at the estimate of an
// unpriced model.
func (e *ending) priced(cost float64, estimatedPrice bool) {
	e.cost = cost
	e.estimatedPrice = e.estimatedPrice || estimatedPrice
}

// addCost adds to the request's cost (a batch's results, model by model).
func (e *ending) addCost(cost float64, estimatedPrice bool) {
	e.cost += cost
	e.estimatedPrice = e.estimatedPrice || estimatedPrice
}

// wastedTokens counts input tokens of an abandoned attempt.
func (e *ending) wastedTokens(n int64) { e.wasted += n }

// sharedBy notes what answered the request instead of an upstream.
func (e *ending) sharedBy(how string) { e.shared = how }

// batchResults notes a batch's results accounted: their usage, whether
// they were all there, and that the request charges them.
func (e *ending) batchResults(total usage, complete bool) {
	e.usage, e.incomplete = total, !complete
	e.cost = 0
}

// chargesBatch marks the request as the one that accounts a batch's
// results.
func (e *ending) chargesBatch() { e.batch = &batchCharge{} }

// batchModel adds one model's part of the batch's charge.
func (e *ending) batchModel(m batchModel) {
	if e.batch != nil {
		e.batch.models = append(e.batch.models, m)
	}
}

// batchPayer names the spend account the batch's charge goes to.
func (e *ending) batchPayer(a *money.Account) {
	if e.batch != nil {
		e.batch.payer = a
	}
}

// charged is the channel whose upstream the request's usage is charged
// for: the one whose answer the client got, or the one that was working
// on it when its client left; nil: none.
func (e *ending) charged() *channel {
	if e.answered != nil {
		return e.answered
	}
	return e.leftOn
}
