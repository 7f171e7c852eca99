package relay

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/money"
)

// Cooldowns per model class. Anthropic, Bedrock and Vertex limit each model
// class of an account separately: a busy Opus workload spends Opus's
// requests and tokens, not Sonnet's. So what an upstream says about a
// limit (a 429, a 529, an anthropic-ratelimit-* quota at 0) cools the
// channel for the class of the model that answered, and the channel keeps
// serving the other classes. Everything else that cools (5xx, network
// errors, a refused credential) and the breaker stay the channel's.
//
// A model's class is the class of the upstream model id the channel sends
// (after its `models` mapping): that is the model whose limit answered.
// It is, in order: the class of the channel's first `model_class` line
// whose glob matches the id; the family the id names (opus, sonnet,
// haiku); the built-in or configured price row the id is, or is a dated
// snapshot or variant of; for a model the channel lists in `models`, the
// id itself; else `other`. A client chooses the model, so a class is
// always one of a bounded set that the config and the price list name:
// a channel without `models`, which serves any name a client sends, puts
// every model none of the rules names in the one class `other`.
//
// The cooldowns themselves are the channel's health's (internal/health),
// kept by the class's name; which class a model is on a channel is said
// here, from the channel's config and the price list.

// classOther is the class of every model no rule names, on a channel that
// does not list its models.
const classOther = "other"

// classFamilies are the classes a model id names by a word of its own.
var classFamilies = [...]string{"opus", "sonnet", "haiku"}

// maxClassLen bounds a class name, as a model id is bounded: as the
// channels' health bounds the classes it keeps.
const maxClassLen = health.MaxClassLen

// the two bounds are one: this does not compile when they part
var _ = [1]struct{}{}[maxModelLen-maxClassLen]

// ModelClass names the model class of the upstream models whose ids match
// a glob: what a 429, a 529 or a spent anthropic-ratelimit-* quota cools on
// the channel, instead of the whole channel.
type ModelClass struct {
	// Match is a glob over the upstream model id the channel sends (after
	// its `models` mapping): `*` matches any run of characters, every
	// other character itself. `*opus*` matches claude-opus-4-1 and
	// us.anthropic.claude-opus-4-1-20250805-v1:0.
	Match string `json:"match"`

	// Class is the name of the class: letters, digits and - _ . (at most
	// 256). Models of one class share its cooldowns on the channel. `other`
	// is reserved for the models no line names.
	Class string `json:"class"`
}

// validate checks a model_class line.
func (m ModelClass) validate() error {
	pattern := strings.ReplaceAll(m.Match, "*", "")
	switch {
	case m.Match == "":
		return fmt.Errorf("model_class: want a glob of upstream model ids, * for any characters")
	case pattern != "" && !validModelName(pattern):
		return fmt.Errorf("model_class: match %q: only letters, digits, - . _ : @ / and * may appear", m.Match)
	case !validClassName(m.Class):
		return fmt.Errorf("model_class: class %q: want letters, digits and - _ . (at most %d)", m.Class, maxClassLen)
	case m.Class == classOther:
		return fmt.Errorf("model_class: class %q is the class of the models no line names; choose another name", m.Class)
	}
	return nil
}

// validClassName accepts letters, digits and -_. up to maxClassLen.
func validClassName(s string) bool {
	if s == "" || len(s) > maxClassLen {
		return false
	}
	for _, c := range []byte(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case c == '-' || c == '_' || c == '.':
		default:
			return false
		}
	}
	return true
}

// globMatch reports whether s matches pattern, whose `*` matches any run
// of characters (none included) and every other byte itself.
func globMatch(pattern, s string) bool {
	star, resume := -1, 0 // the last star's index in pattern, and where s resumed after it
	p, i := 0, 0
	for i < len(s) {
		switch {
		case p < len(pattern) && pattern[p] == '*':
			star, resume = p, i
			p++
		case p < len(pattern) && pattern[p] == s[i]:
			p++
			i++
		case star >= 0: // the star takes one more byte
			resume++
			p, i = star+1, resume
		default:
			return false
		}
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}

// familyOf is the family a model id names by a word of its own (opus,
// sonnet, haiku: between non-letters or at an end), "" when none.
func familyOf(id string) string {
	for _, f := range classFamilies {
		for from := 0; from+len(f) <= len(id); {
			i := strings.Index(id[from:], f)
			if i < 0 {
				break
			}
			i += from
			end := i + len(f)
			if (i == 0 || !isLetter(id[i-1])) && (end == len(id) || !isLetter(id[end])) {
				return f
			}
			from = i + 1
		}
	}
	return ""
}

func isLetter(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }

// classRows are the names of the price rows (built in, and the config's
// `pricing`) that name no family, the longest first: each is a class of
// its own, for the model and its dated snapshots and variants.
func classRows(pb money.Pricebook) []string {
	var rows []string
	for name := range pb {
		if familyOf(name) == "" {
			rows = append(rows, name)
		}
	}
	slices.SortFunc(rows, func(a, b string) int {
		if len(a) != len(b) {
			return len(b) - len(a)
		}
		return strings.Compare(a, b)
	})
	return rows
}

// classify is the class of the upstream model id on the channel; listed
// says that the channel lists the model in `models`.
func (ch *channel) classify(id string, listed bool) string {
	for _, r := range ch.classRules {
		if globMatch(r.Match, id) {
			return r.Class
		}
	}
	if f := familyOf(id); f != "" {
		return f
	}
	for _, row := range ch.classRows {
		if id == row || strings.HasPrefix(id, row) && money.VariantSuffix(id[len(row):]) {
			return row
		}
	}
	if listed {
		return id
	}
	return classOther
}

// classOf is the class a request for model (the client's name, or a
// fallback's) is cooled and checked by on the channel.
func (ch *channel) classOf(model string) string {
	if c, ok := ch.classes[model]; ok {
		return c
	}
	return ch.classify(ch.upstreamModel(model), false)
}

// provisionClasses resolves the channel's classes: the class of each model
// it lists, and the names its classes may have (for the gauge's labels).
func (ch *channel) provisionClasses(rules []ModelClass, rows []string) {
	ch.classRules, ch.classRows = rules, rows
	names := map[string]bool{}
	if ch.models != nil {
		ch.classes = make(map[string]string, len(ch.models))
		for client, up := range ch.models {
			c := ch.classify(up, true)
			ch.classes[client] = c
			names[c] = true
		}
	} else {
		for _, r := range rules {
			names[r.Class] = true
		}
		for _, f := range classFamilies {
			names[f] = true
		}
		for _, row := range rows {
			names[row] = true
		}
		names[classOther] = true
	}
	ch.classNames = make([]string, 0, len(names))
	for n := range names {
		ch.classNames = append(ch.classNames, n)
	}
	slices.Sort(ch.classNames)
}

// classAvailable is classOut as the selector asks it: whether the
// channel may serve model at now, and if not, until when and what keeps
// it out.
func (ch *channel) classAvailable(model string, now time.Time) (ok bool, until time.Time, by health.OutBy) {
	out, until, by := ch.classOut(model, now)
	return !out, until, by
}

// classOut reports whether the class of model cools on the channel at now,
// until when, and what keeps it out: only an upstream's reset (a 429's
// wait, a spent quota), only an upstream's overload (a 529), or both.
// With no class cooling it reads one atomic and resolves no class.
func (ch *channel) classOut(model string, now time.Time) (out bool, until time.Time, by health.OutBy) {
	if !ch.health.ClassCooling(now) {
		return false, time.Time{}, health.OutOther
	}
	return ch.health.ClassOut(ch.classOf(model), now)
}

// observeQuota reads the anthropic-ratelimit-* headers of an upstream's
// answer to a request for model: a limit whose remaining count is 0 cools
// the model's class on the channel until its reset, so the relay stops
// before the upstream's 429. Like a 429's wait, it is capped by the
// channel's max_cooldown. The class is resolved only when a limit is spent.
func (ch *channel) observeQuota(hdr http.Header, now time.Time, model string) {
	if t, reason := spentQuota(hdr, now, ch.cooldown.Max); !t.IsZero() {
		ch.health.QuotaSpent(ch.classOf(model), t, reason, now)
	}
}

// quotaReasons word a spent limit, as the reason of a class's cooldown.
var quotaReasons = func() (out [len(rateLimitHeaders)]string) {
	for i, names := range rateLimitHeaders {
		out[i] = strings.ToLower(names.remaining) + ": 0"
	}
	return out
}()

// spentQuota is the latest reset, at most limit from now, of the
// anthropic-ratelimit-* limits whose remaining count is 0, and the header
// that said so; zero when none is spent.
func spentQuota(hdr http.Header, now time.Time, limit time.Duration) (until time.Time, reason string) {
	for i, names := range rateLimitHeaders {
		// the names are canonical: read the map without Get's
		// canonicalizing, on every answer
		if v := hdr[names.remaining]; len(v) == 0 || v[0] != "0" {
			continue
		}
		t, err := time.Parse(time.RFC3339, hdr.Get(names.reset))
		if err != nil || !t.After(now) {
			continue
		}
		if lim := now.Add(limit); t.After(lim) {
			t = lim
		}
		if t.After(until) {
			until, reason = t, quotaReasons[i]
		}
	}
	return until, reason
}
