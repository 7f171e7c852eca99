package relay

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddy-relay/relay/internal/signatures"
)

// validate checks a group against the channels of its config.
func (g *Group) validate(channels map[string]*Channel) error {
	if len(g.Channels) == 0 {
		return fmt.Errorf("group %q lists no channels", g.Name)
	}
	seen := make(map[string]bool, len(g.Channels))
	for _, name := range g.Channels {
		if channels[name] == nil {
			return errAt([]string{"channels", name}, "group %q names unknown channel %q", g.Name, name)
		}
		if seen[name] {
			return errAt([]string{"channels", name}, "group %q lists channel %q twice", g.Name, name)
		}
		seen[name] = true
	}
	if g.Retries != nil && *g.Retries < 0 {
		return errAt([]string{"retries"}, "group %q: retries must not be negative", g.Name)
	}
	if g.RetryBudget != nil && (*g.RetryBudget < 0 || *g.RetryBudget > 1) {
		return errAt([]string{"retry_budget"}, "group %q: retry_budget must be between 0 and 1 (0%% to 100%%)", g.Name)
	}
	if g.RetryBudgetFloor != nil && *g.RetryBudgetFloor < 0 {
		return errAt([]string{"retry_budget"}, "group %q: retry_budget_floor must not be negative", g.Name)
	}
	if _, err := money.ParseBudgets(g.Budgets); err != nil {
		return errAt([]string{"budget"}, "group %q: %v", g.Name, err)
	}
	if g.BudgetWarn < 0 || g.BudgetWarn > 1 {
		return errAt([]string{"budget_warn"}, "group %q: budget_warn must be a share between 0 and 1 (or 0%% to 100%%)", g.Name)
	}
	if err := g.SessionLimits.validate(); err != nil {
		return within(err, "group "+strconv.Quote(g.Name))
	}
	if err := checkDegrade(g.BudgetDegrade); err != nil {
		return errAt([]string{"budget_degrade"}, "group %q: %v", g.Name, err)
	}
	if g.WaitForRecovery < 0 {
		return errAt([]string{"wait_for_recovery"}, "group %q: wait_for_recovery must not be negative", g.Name)
	}
	switch g.ThinkingFailover {
	case "", thinkingFailoverStrip:
	default:
		return errAt([]string{"thinking_failover"}, "group %q: thinking_failover is %q or unset, not %q", g.Name, thinkingFailoverStrip, g.ThinkingFailover)
	}
	switch g.Policy {
	case "", policyWeighted, policyAdaptive, policySticky:
	default:
		return errAt([]string{"policy"}, "group %q: unknown policy %q (weighted, adaptive, sticky)", g.Name, g.Policy)
	}
	for name, share := range g.Splits {
		if !seen[name] {
			return errAt([]string{"split", name}, "group %q: split names %q, which is not one of its channels", g.Name, name)
		}
		if share <= 0 || share > 1 {
			return errAt([]string{"split", name}, "group %q: split %q must be a share above 0%% and at most 100%%", g.Name, name)
		}
	}
	for model, fbs := range g.Fallbacks {
		if !validModelName(model) || len(fbs) == 0 {
			return errAt([]string{"fallback", model}, "group %q: fallback takes a model and the models that may serve it", g.Name)
		}
		for _, fb := range fbs {
			if !validModelName(fb) || fb == model {
				return errAt([]string{"fallback", model}, "group %q: fallback for %q: %q is not another model", g.Name, model, fb)
			}
		}
	}
	for class, d := range g.MaxWait {
		if _, ok := priorityByName(class); !ok || class == "" {
			return errAt([]string{"max_wait", class}, "group %q: max_wait: unknown class %q (realtime, normal, batch)", g.Name, class)
		}
		if d <= 0 {
			return errAt([]string{"max_wait", class}, "group %q: max_wait %s must be positive", g.Name, class)
		}
	}
	return nil
}

func (ch *Channel) checkFeatures() error {
	seen := map[string]string{}
	for _, l := range []struct {
		opt   string
		names []string
	}{{"supports", ch.Supports}, {"allow", ch.Allow}, {"lacks", ch.Lacks}, {"strip", ch.Strip}} {
		for _, name := range l.names {
			if err := features.CheckNames(l.opt, []string{name}); err != nil {
				return &configError{at: []string{l.opt, name}, err: err}
			}
			if prev, ok := seen[name]; ok && prev != l.opt && !(prev == "supports" && l.opt == "allow") {
				return errAt([]string{l.opt, name}, "%s: %q is on the %s line too: a channel supports, lacks or strips a feature", l.opt, name, prev)
			}
			seen[name] = l.opt
		}
	}
	return nil
}

// validate checks the channel's own options; its provider checks its own.
func (ch *Channel) validate() error {
	if _, err := parseModels(ch.Models); err != nil {
		return &configError{at: []string{"models"}, err: err}
	}
	for _, m := range ch.ModelClasses {
		if err := m.validate(); err != nil {
			return &configError{at: []string{"model_class", m.Match}, err: err}
		}
	}
	if ch.Priority < 0 {
		return errAt([]string{"priority"}, "priority must not be negative")
	}
	if ch.Weight < 0 || ch.Weight > maxWeight {
		return errAt([]string{"weight"}, "weight must be between 0 and %d", maxWeight)
	}
	if err := ch.checkFeatures(); err != nil {
		return err
	}
	if d := ch.SignatureDomain; d != "" && !signatures.ValidDomain(d) {
		return errAt([]string{"signature_domain"}, "signature_domain %q: letters, digits and - _ . : / @ only, at most %d characters", d, signatures.MaxDomainLen)
	}
	if err := checkLimits(ch.Rate, ch.Tokens, ch.Concurrency); err != nil {
		return err
	}
	if _, err := money.ParseBudgets(ch.SpendCaps); err != nil {
		return errAt([]string{"spend_cap"}, "spend_cap: %v", err)
	}
	if f := ch.PriceFactor; f != nil && (!(*f > 0) || math.IsInf(*f, 0)) {
		return errAt([]string{"price_factor"}, "price_factor must be a number above 0, the channel's price over the list price (0.8 for 80%%), not %v", *f)
	}
	if p := ch.Probe; p != nil {
		probe := []string{"probe"}
		if p.Interval < 0 {
			return errAt(probe, "probe: interval must not be negative")
		}
		if p.Path != "" && routeByPath(p.Path) == 0 {
			return errAt(probe, "probe: path must be /v1/messages or /v1/messages/count_tokens, not %q", p.Path)
		}
		if p.Body != "" && !json.Valid([]byte(p.Body)) {
			return errAt(probe, "probe: body is not valid JSON")
		}
	}
	return ch.Tuning.validate()
}

// maxWeight bounds a channel's weight, so the weights of a group can never
// add up past what a pick can draw from.
const maxWeight = 1_000_000

// parseModels reads `name` and `name=upstream_name` entries into a map from
// the name clients send to the name the upstream wants. nil means every
// model.
func parseModels(entries []string) (map[string]string, error) {
	if len(entries) == 0 {
		return nil, nil
	}
	m := make(map[string]string, len(entries))
	for _, e := range entries {
		name, upstream, mapped := strings.Cut(e, "=")
		if !mapped {
			upstream = name
		}
		if modelIDProblem(name) != "" || modelIDProblem(upstream) != "" {
			return nil, fmt.Errorf("models: malformed entry %q: want name or name=upstream_name, without spaces, quotes or a second '='", e)
		}
		if _, dup := m[name]; dup {
			return nil, fmt.Errorf("models: %q is listed twice", name)
		}
		m[name] = upstream
	}
	return m, nil
}

// validModelName accepts the characters model ids use across providers
// (letters, digits and -._:@/), so a name can be spliced into JSON as is.
func validModelName(s string) bool {
	if s == "" {
		return false
	}
	for _, c := range []byte(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case c == '-' || c == '.' || c == '_' || c == ':' || c == '@' || c == '/':
		default:
			return false
		}
	}
	return true
}
