package relay

import (
	"cmp"
	"fmt"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
)

// validateConfig checks what can be checked without resolving secrets. The
// Caddyfile adapter runs it too, so `caddy adapt` reports these errors.
func (r *Relay) validateConfig() error {
	if r.MaxBodySize < 0 || r.MaxResponseSize < 0 || r.MaxUploadSize < 0 || r.ReadBodyTimeout < 0 || r.DecodeMemory < 0 {
		return fmt.Errorf("max_body_size, max_response_size, max_upload_size, read_body_timeout and decode_memory must not be negative")
	}
	if err := r.Tuning.validate(); err != nil {
		return err
	}
	if r.Ledger != nil {
		if err := r.Ledger.Validate(); err != nil {
			return errAt([]string{"ledger"}, "%v", err)
		}
	}
	switch r.UpstreamRatelimitHeaders {
	case "", ratelimitReplace, ratelimitPass:
	default:
		return errAt([]string{"upstream_ratelimit_headers"}, "upstream_ratelimit_headers must be replace or pass, not %q", r.UpstreamRatelimitHeaders)
	}
	channels := make(map[string]*Channel, len(r.Channels))
	for i, ch := range r.Channels {
		if ch == nil || ch.Name == "" {
			return fmt.Errorf("channel #%d has no name", i+1)
		}
		if _, dup := channels[ch.Name]; dup {
			return errAt([]string{"channel", ch.Name}, "channel %q is defined twice", ch.Name)
		}
		channels[ch.Name] = ch
		if err := ch.validate(); err != nil {
			return within(err, fmt.Sprintf("channel %q", ch.Name), "channel", ch.Name)
		}
	}
	groups := make(map[string]bool, len(r.Groups))
	for i, g := range r.Groups {
		if g == nil || g.Name == "" {
			return fmt.Errorf("group #%d has no name", i+1)
		}
		if groups[g.Name] {
			return errAt([]string{"group", g.Name}, "group %q is defined twice", g.Name)
		}
		groups[g.Name] = true
		if err := g.validate(channels); err != nil {
			return within(err, "", "group", g.Name)
		}
	}
	for model, p := range r.Pricing {
		if !validModelName(model) {
			return errAt([]string{"pricing", model}, "pricing: %q is not a model name", model)
		}
		if err := p.Validate(); err != nil {
			return errAt([]string{"pricing", model}, "pricing %q: %v", model, err)
		}
	}
	if len(r.Keys) == 0 && len(r.Users) == 0 && r.KeysFile == "" {
		return fmt.Errorf("no key is configured: every request would be refused")
	}
	names := make(map[string]string, len(r.Keys)+len(r.Users)) // name -> what has it
	for i, k := range r.Keys {
		key := []string{"key", "#" + strconv.Itoa(i+1)}
		if err := k.check(i, groups); err != nil {
			return within(err, "", key...)
		}
		if k.Name != "" {
			if was, dup := names[k.Name]; dup {
				return errAt(append(key, "name"), "%s and key #%d have the same name %q", was, i+1, k.Name)
			}
			names[k.Name] = "key #" + strconv.Itoa(i+1)
		}
	}
	return r.validateUsers(groups, names)
}

// check checks the key at i of the config or of the keys file, but for the
// names it shares with the others. Where an error is, is relative to the
// key.
func (k *Key) check(i int, groups map[string]bool) error {
	if k == nil || k.Secret == "" {
		return errAt(nil, "key #%d has no secret", i+1)
	}
	if k.Group == "" {
		return errAt(nil, "%s names no group", k.label(i))
	}
	if !groups[k.Group] {
		return errAt([]string{k.Group}, "%s names unknown group %q", k.label(i), k.Group)
	}
	if hexDigest, ok := strings.CutPrefix(k.Secret, sha256Prefix); ok {
		if _, ok := decodeDigest(hexDigest); !ok {
			return errAt(nil, "%s: sha256: must be followed by 64 hex digits", k.label(i))
		}
	}
	if err := k.KeyOptions.validate(); err != nil {
		return within(err, k.label(i))
	}
	if strings.HasPrefix(k.Name, userStatePrefix) {
		return errAt([]string{"name"}, "%s: a key's name may not start with %q, which names user entries", k.label(i), userStatePrefix)
	}
	for _, prefix := range [...]string{money.GroupPrefix, money.ChannelPrefix, sessionSpendPrefix} {
		if strings.HasPrefix(k.Name, prefix) {
			return errAt([]string{"name"}, "%s: a key's name may not start with %q, which names the spend of groups and channels", k.label(i), prefix)
		}
	}
	return nil
}

// validateUsers checks the identity placeholder and the user entries;
// names are the names of the keys, which theirs may not take.
func (r *Relay) validateUsers(groups map[string]bool, names map[string]string) error {
	switch {
	case r.Identity != "" && !requestPlaceholder(r.Identity):
		// anything else could resolve to an identity for a request no
		// handler authenticated, which would then need no key
		return errAt([]string{"identity"}, "identity must be one placeholder of the request that an authentication handler sets, such as {http.auth.user.id}, not %q", r.Identity)
	case r.Identity != "" && len(r.Users) == 0:
		return errAt([]string{"identity"}, "identity is set but no user entry is: every authenticated request would be refused (add user <id> <group>, or user * <group>)")
	case r.Identity == "" && len(r.Users) > 0:
		return errAt([]string{"user", "#1"}, "user entries need identity <placeholder>, such as identity {http.auth.user.id}, to know who the client is")
	}
	ids := make(map[string]bool, len(r.Users))
	for i, u := range r.Users {
		at := []string{"user", "#" + strconv.Itoa(i+1)}
		if u == nil || u.ID == "" {
			return errAt(at, "user #%d has no id", i+1)
		}
		label := u.label()
		if ids[u.ID] {
			return errAt(at, "%s is given twice", label)
		}
		ids[u.ID] = true
		if u.Group == "" {
			return errAt(at, "%s names no group", label)
		}
		if !groups[u.Group] {
			return errAt(append(at, u.Group), "%s names unknown group %q", label, u.Group)
		}
		if err := u.KeyOptions.validate(); err != nil {
			return within(err, label, at...)
		}
		name := cmp.Or(u.Name, userStatePrefix+u.ID)
		if was, dup := names[name]; dup {
			return errAt(append(at, "name"), "%s and %s have the same name %q", was, label, name)
		}
		names[name] = label
	}
	return nil
}

// requestPlaceholder reports whether s is exactly one placeholder of the
// request ({http.*}), which resolves empty when nothing set it.
func requestPlaceholder(s string) bool {
	name, ok := strings.CutPrefix(s, "{")
	name, closed := strings.CutSuffix(name, "}")
	return ok && closed && strings.HasPrefix(name, "http.") && !strings.ContainsAny(name, "{}")
}

// validate checks a key's or a user entry's options, saying which is
// wrong.
func (o *KeyOptions) validate() error {
	if _, ok := priorityByName(o.Priority); !ok {
		return errAt([]string{"priority"}, "priority must be realtime, normal or batch, not %q", o.Priority)
	}
	if err := checkLimits(o.Rate, o.Tokens, o.Concurrency); err != nil {
		return err
	}
	if _, err := limits.ParseRate(o.UserRate); err != nil {
		return errAt([]string{"user_rate"}, "user_rate: %v", err)
	}
	if _, err := limits.ParseRate(o.UserTokens); err != nil {
		return errAt([]string{"user_tokens"}, "user_tokens: %v", err)
	}
	if _, err := money.ParseBudgets(o.Budgets); err != nil {
		return errAt([]string{"budget"}, "%v", err)
	}
	if o.BudgetWarn < 0 || o.BudgetWarn > 1 {
		return errAt([]string{"budget_warn"}, "budget_warn must be a share between 0 and 1 (or 0%% to 100%%)")
	}
	if err := checkDegrade(o.BudgetDegrade); err != nil {
		return errAt([]string{"budget_degrade"}, "%v", err)
	}
	if _, err := parseExpires(o.Expires); err != nil {
		return errAt([]string{"expires"}, "expires: %v", err)
	}
	return o.SessionLimits.validate()
}
