package relay

import (
	"bytes"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/money"
)

// Input from outside the body. A request's hold counts its prompt from the
// body (its input estimate), but a prompt can come from elsewhere: a
// document or image by file_id or URL, a container upload, what an MCP
// server or a server tool (web search, web fetch, code execution, tool
// search) brings in. A request of 16 output tokens whose prompt is a
// 190,000-token file held almost nothing, and 30 of them at once spent
// seventeen times their budget. So a request with a budget or a spend cap
// that may pull input from outside holds its input at a floor (hold_floor;
// default the model's context window at its input price), capped by what
// is left of its tightest budget: the floor holds the budget's room, the
// next such request waits for it to settle, and spend may exceed a budget
// only by one floor's error, never by the count of requests.
//
// Only requests that a budget or a cap counts look (planHolds); what they
// look at is the feature bits inspect found and three substrings of the
// body, which a body can hide only behind escapes of plain letters that no
// JSON encoder writes, and which are taken as a reference too.

// defaultContextWindow and longContextWindow are a model's context window
// in tokens, without and with the 1M context (the context-1m beta, a [1m]
// variant).
const (
	defaultContextWindow = 200_000
	longContextWindow    = 1_000_000
)

// context1m is the beta that asks for the 1M context.
const context1m = "context-1m-2025-08-07"

// outsideFeatures are the features that bring input from outside the body.
var outsideFeatures = features.Bit("mcp_servers") | features.Bit("container") | features.Bit("web_search") | features.Bit("web_fetch") |
	features.Bit("code_execution") | features.Bit("tool_search")

// Substrings of a body that references input outside it (a container
// upload names its file by file_id, which mayReferenceFiles finds). Each
// costs a pass over the body; "url" about 1 µs for 10 KB of prose.
var (
	urlKey      = []byte(`"url"`) // a URL source's type, or an MCP server's url
	letterEscap = []byte(`\u00`)  // the start of an escape that may hide a letter
)

// readsOutside reports whether the request may pull input from outside its
// body.
func (in *inbound) readsOutside() bool {
	if in.ask.needs.Set&outsideFeatures != 0 {
		return true
	}
	body := in.ask.body
	return mayReferenceFiles(body) || bytes.Contains(body, urlKey) || escapesLetters(body)
}

// escapesLetters reports whether body writes an ASCII letter as a \u00XX
// escape, which encoders never do and which could hide a key the relay
// looks for ("\u0075rl").
func escapesLetters(body []byte) bool {
	for {
		i := bytes.Index(body, letterEscap)
		if i < 0 || i+6 > len(body) {
			return false
		}
		if c := hex2(body[i+4], body[i+5]); 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' {
			return true
		}
		body = body[i+4:]
	}
}

// hex2 is the byte two hex digits write; -1 when they are not hex.
func hex2(a, b byte) int {
	d := func(c byte) int {
		switch {
		case '0' <= c && c <= '9':
			return int(c - '0')
		case 'a' <= c && c <= 'f':
			return int(c-'a') + 10
		case 'A' <= c && c <= 'F':
			return int(c-'A') + 10
		}
		return -256
	}
	return d(a)<<4 | d(b)
}

// contextWindow is the context window of a request for model, in tokens;
// long: it asks for the 1M context by its beta.
func contextWindow(model string, long bool) int64 {
	if long || strings.Contains(model, "[1m]") {
		return longContextWindow
	}
	return defaultContextWindow
}

// floorOf is the input a request that reads from outside its body holds
// at least, in USD at list price: hold_floor, or a context window of
// window tokens at the input price of rates (its long-prompt tier's, when
// the window reaches it).
func (r *Relay) floorOf(rates *money.Rates, window int64) float64 {
	if r.HoldFloor != nil {
		return *r.HoldFloor
	}
	return float64(window) * rates.InputAt(window)
}

// floorRoom is the most a floor may raise a request's hold to: what is left
// of the tightest budget of accts at now (what was spent, not what is
// held: a hold that waits for another must not shrink to slip in beside
// it); with no budget, the most any capped channel of g has left. 0: no
// bound is known.
func floorRoom(accts []*money.Account, g *group, now time.Time) money.NanoUSD {
	room, known := money.NanoUSD(0), false
	for _, a := range accts {
		a.Rooms(now, func(b money.Room) {
			if left := max(0, b.Limit-b.Spent); !known || left < room {
				room, known = left, true
			}
		})
	}
	if known {
		return room
	}
	for _, ch := range g.channels {
		if ch.spend == nil {
			continue
		}
		ch.spend.Rooms(now, func(b money.Room) {
			room = max(room, b.Limit-b.Spent)
		})
	}
	return room
}

// outsideKeys are what a batch request's params hold when they bring input
// from outside them, besides what readsOutside looks for: the fields and
// server tool types that do.
var outsideKeys = [...][]byte{[]byte(`"mcp_servers"`), []byte(`"container"`), []byte(`"web_search_`),
	[]byte(`"web_fetch_`), []byte(`"code_execution_`), []byte(`"tool_search_tool_`)}

// rawReadsOutside is readsOutside for a body that inspect did not read (a
// batch's request).
func rawReadsOutside(body []byte) bool {
	if mayReferenceFiles(body) || bytes.Contains(body, urlKey) || escapesLetters(body) {
		return true
	}
	for _, k := range outsideKeys {
		if bytes.Contains(body, k) {
			return true
		}
	}
	return false
}
