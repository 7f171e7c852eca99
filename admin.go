package relay

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI is the `admin.api.relay` module: it shows and steers channel
// health through Caddy's admin endpoint. It holds no state; it reads the
// process-wide channel states, so it sees every channel of every loaded
// config and survives reloads.
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.relay",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes implements caddy.AdminRouter. Every answer is JSON, errors
// included: the routes take every method and refuse the wrong ones
// themselves (405, with Allow), and any other path under /relay/ is a JSON
// 404.
func (a adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/relay/channels", Handler: only(http.MethodGet, a.list)},
		{Pattern: "/relay/channels/{name}/{action}", Handler: only(http.MethodPost, a.act)},
		{Pattern: "/relay/fleet", Handler: only(http.MethodGet, a.fleet)},
		{Pattern: "/relay/keys", Handler: only(http.MethodGet, a.keys)},
		{Pattern: "/relay/keys/{name}/spend/reset", Handler: only(http.MethodPost, a.resetSpend)},
		{Pattern: "/relay/sessions", Handler: only(http.MethodGet, a.sessions)},
		{Pattern: "/relay/usage", Handler: only(http.MethodGet, a.usage)},
		{Pattern: "/relay/", Handler: plainErrors(func(_ http.ResponseWriter, r *http.Request) error {
			return caddy.APIError{HTTPStatus: http.StatusNotFound,
				Err: fmt.Errorf("no relay admin route %s (GET /relay/channels, POST /relay/channels/<name>/reset|disable|enable, GET /relay/fleet, GET /relay/keys, POST /relay/keys/<name>/spend/reset[?period=day|week|month|total], GET /relay/sessions[?top=N], GET /relay/usage)", r.URL.Path)}
		})},
	}
}

// only serves h for method alone, and answers other methods 405 with
// Allow.
func only(method string, h caddy.AdminHandlerFunc) caddy.AdminHandlerFunc {
	return plainErrors(func(w http.ResponseWriter, r *http.Request) error {
		if r.Method != method {
			w.Header().Set("Allow", method)
			return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed,
				Err: fmt.Errorf("method %s is not allowed on %s; use %s", r.Method, r.URL.Path, method)}
		}
		return h(w, r)
	})
}

// plainErrors writes h's error as Caddy's admin API does ({"error": ...},
// and a log line), but without escaping <, > and & as \u003c: the
// messages name routes such as /relay/channels/<name>/reset for a person
// to read.
func plainErrors(h caddy.AdminHandlerFunc) caddy.AdminHandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		err := h(w, r)
		if err == nil {
			return nil
		}
		apiErr, ok := err.(caddy.APIError)
		if !ok {
			apiErr = caddy.APIError{HTTPStatus: http.StatusInternalServerError, Err: err}
		}
		if apiErr.Message == "" && apiErr.Err != nil {
			apiErr.Message = apiErr.Err.Error()
		}
		status := cmp.Or(apiErr.HTTPStatus, http.StatusInternalServerError)
		caddy.Log().Named("admin.api").Error("request error", zap.Error(err), zap.Int("status_code", status))
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		enc := json.NewEncoder(w)
		enc.SetEscapeHTML(false)
		return enc.Encode(apiErr)
	}
}

// list answers GET /relay/channels: every channel's state and counters,
// sorted by name.
func (adminAPI) list(w http.ResponseWriter, r *http.Request) error {
	now := time.Now()
	rows := []channelStatus{}
	channelStates.Range(func(k, v any) bool {
		rows = append(rows, v.(*channelHealth).status(k.(string), now))
		return true
	})
	slices.SortFunc(rows, func(a, b channelStatus) int { return strings.Compare(a.Name, b.Name) })
	return writeAdminJSON(w, rows)
}

// act answers POST /relay/channels/<name>/reset|disable|enable with the
// channel's new status.
func (adminAPI) act(w http.ResponseWriter, r *http.Request) error {
	st, err := steerChannel(r.PathValue("name"), r.PathValue("action"))
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: err}
	}
	return writeAdminJSON(w, st)
}

// steerChannel resets, disables or enables the channel named name, and
// returns its new status; the error says which of the two is unknown.
// Disabling drains: attempts in flight finish, new requests skip the
// channel. The admin API and the status page both steer through here.
func steerChannel(name, action string) (channelStatus, error) {
	h := findChannel(name)
	if h == nil {
		return channelStatus{}, fmt.Errorf("unknown channel %q", name)
	}
	switch action {
	case "reset":
		h.Reset()
	case "disable":
		h.Disable()
	case "enable":
		h.Enable()
	default:
		return channelStatus{}, fmt.Errorf("unknown action %q: use reset, disable or enable", action)
	}
	return h.status(name, time.Now()), nil
}

// keys answers GET /relay/keys: every key of every loaded relay handler,
// its limits and what is in use, sorted by name; never a secret or its
// digest.
func (adminAPI) keys(w http.ResponseWriter, r *http.Request) error {
	rows := []keyStatus{}
	for _, k := range provisionedKeys.current() {
		rows = append(rows, k.status(k.relay.now()))
	}
	slices.SortFunc(rows, func(a, b keyStatus) int {
		return cmp.Or(strings.Compare(a.Name, b.Name), strings.Compare(a.Kind, b.Kind))
	})
	return writeAdminJSON(w, rows)
}

// resetSpend answers POST /relay/keys/<name>/spend/reset: what the key or
// user entry of that name (as GET /relay/keys shows it) spent in its
// current periods, or in the one given as ?period=, goes to zero
// (internal/money's spend_reset.go). The answer is its row of GET /relay/keys.
func (adminAPI) resetSpend(w http.ResponseWriter, r *http.Request) error {
	periods, err := money.ResetPeriods(r.URL.Query()["period"])
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	name := r.PathValue("name")
	k := findKey(name)
	switch {
	case k == nil:
		return caddy.APIError{HTTPStatus: http.StatusNotFound,
			Err: fmt.Errorf("unknown key %q: GET /relay/keys lists the keys and user entries by name", name)}
	case k.id == anyIdentity:
		return caddy.APIError{HTTPStatus: http.StatusBadRequest,
			Err: fmt.Errorf("%q is user *: each identity it serves has a spend of its own, which this route does not reset", name)}
	}
	now := k.relay.now()
	if err := k.resetSpend(now, periods); err != nil {
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable,
			Err: fmt.Errorf("key %q: the fleet's storage (Redis) did not answer, and nothing was reset: %w", name, err)}
	}
	return writeAdminJSON(w, k.status(now))
}

// findKey returns the key or user entry named name, as GET /relay/keys
// shows it (a relay key before a user entry of the same name), or nil.
func findKey(name string) *key {
	var found *key
	for _, k := range provisionedKeys.current() {
		if k.name == name && (found == nil || k.kind() < found.kind()) {
			found = k
		}
	}
	return found
}

// findChannel returns the state of the channel named name, or nil.
func findChannel(name string) *channelHealth {
	var found *channelHealth
	channelStates.Range(func(k, v any) bool {
		if k.(string) == name {
			found = v.(*channelHealth)
			return false
		}
		return true
	})
	return found
}

func writeAdminJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// channelStatus is one row of GET /relay/channels. State is cooldown
// while the channel or any of its model classes cools, and CooldownUntil
// is when the last of them ends (or the breaker turns half-open).
type channelStatus struct {
	Name            string     `json:"name"`
	Provider        string     `json:"provider"`
	Groups          []string   `json:"groups"`
	State           string     `json:"state"`
	CooldownUntil   *time.Time `json:"cooldown_until"`
	Inflight        int64      `json:"inflight"`
	Busy            bool       `json:"busy"`
	BusyUntil       *time.Time `json:"busy_until,omitempty"`
	Requests        uint64     `json:"requests"`
	Failures        uint64     `json:"failures"`
	EWMALatencyMs   float64    `json:"ewma_latency_ms"`
	LastError       string     `json:"last_error,omitempty"`
	LastErrorReason string     `json:"last_error_reason,omitempty"`
	LastErrorAt     *time.Time `json:"last_error_at,omitempty"`
	// ResetAt is when the channel was last reset: its last error and its
	// recent error rate may be from before it.
	ResetAt *time.Time `json:"reset_at,omitempty"`
	// Classes are the model classes cooling on the channel (a 429, a 529
	// or a spent anthropic-ratelimit-* quota for one of its models): it
	// serves the other classes meanwhile.
	Classes map[string]classStatus `json:"classes,omitempty"`
	// RefusedModels are the models the upstream refused (403) on this
	// channel, set aside until the time given.
	RefusedModels map[string]time.Time `json:"refused_models,omitempty"`
	// Lacks are the features the upstream said it does not support (a 400
	// in its refusal's words, for a request that carried them), set aside
	// on this channel until the time given.
	Lacks map[string]time.Time `json:"lacks,omitempty"`
	// SpendUSD is what was spent on a channel with a spend cap, in the
	// current period of each of its caps (SpendCapUSD); absent for a
	// channel without one. When a cap is spent the channel's state is
	// capped (unless it is out for another reason too) until CappedUntil.
	SpendUSD    map[string]float64 `json:"spend_usd,omitempty"`
	SpendCapUSD map[string]float64 `json:"spend_cap_usd,omitempty"`
	CappedUntil *time.Time         `json:"capped_until,omitempty"`
}

func (h *channelHealth) status(name string, now time.Time) channelStatus {
	st := channelStatus{
		Name:     name,
		State:    h.State(now),
		Inflight: h.limits.Inflight(),
		Requests: h.Requests(),
		Failures: h.Failures(),
		Groups:   []string{},
	}
	if ok, until := h.Available(now); !ok && !until.IsZero() {
		st.CooldownUntil = &until
	}
	for class, c := range h.CoolingClasses(now) {
		if st.Classes == nil {
			st.Classes = map[string]classStatus{}
		}
		until := time.Unix(0, c.Until).UTC()
		st.Classes[class] = classStatus{State: stateCooldown, Until: until, Reason: c.Reason}
		if !h.Disabled() && (st.CooldownUntil == nil || until.After(*st.CooldownUntil)) {
			st.CooldownUntil = &until
		}
	}
	if busy, until, _ := h.busy(now); busy {
		st.Busy = true
		if !until.IsZero() {
			st.BusyUntil = &until
		}
	}
	if a := h.spend.Load(); a != nil { // on its relay's clock
		spent, caps := a.Spent(time.Time{})
		st.SpendUSD, st.SpendCapUSD = map[string]float64{}, map[string]float64{}
		for p := range money.NumPeriods {
			if caps[p] > 0 {
				st.SpendUSD[p.String()], st.SpendCapUSD[p.String()] = spent[p], caps[p]
			}
		}
		if capped, until := a.Capped(time.Time{}); capped {
			st.CappedUntil = &until
			if st.State == stateHealthy {
				st.State = stateCapped
			}
		}
	}
	st.RefusedModels = setAsideUntil(h.Refused(), now)
	st.Lacks = setAsideUntil(h.Lacking(), now)
	st.EWMALatencyMs = math.Round(h.Latency()*100) / 100
	st.Provider = h.owner().provider
	if g := h.groups(); g != nil {
		st.Groups = g
	}
	if last, reason, at := h.LastError(); !at.IsZero() {
		st.LastError, st.LastErrorReason, st.LastErrorAt = last.String(), reason, &at
	}
	if at := h.ResetAt(); !at.IsZero() {
		st.ResetAt = &at
	}
	return st
}

// classStatus is a model class cooling on a channel.
type classStatus struct {
	State  string    `json:"state"` // cooldown
	Until  time.Time `json:"until"`
	Reason string    `json:"reason,omitempty"`
}

// setAsideUntil lists the entries of a set-aside map (refused models,
// lacking features) that have not ended; nil when none.
func setAsideUntil(m map[string]int64, now time.Time) map[string]time.Time {
	var out map[string]time.Time
	for name, until := range m {
		if until > now.UnixNano() {
			if out == nil {
				out = map[string]time.Time{}
			}
			out[name] = time.Unix(0, until).UTC()
		}
	}
	return out
}

// keyStatus is one row of GET /relay/keys. It never holds a secret or its
// digest: a row is made from a provisioned key, which keeps neither.
type keyStatus struct {
	Name     string `json:"name"`
	Kind     string `json:"kind"` // key
	Group    string `json:"group"`
	Priority string `json:"priority"`
	// Expires is when the key stops working; null: never.
	Expires  *time.Time   `json:"expires"`
	Expired  bool         `json:"expired"`
	Disabled bool         `json:"disabled"`
	Limits   limitsStatus `json:"limits"`
	// SpendUSD is what the key spent in the current day, week and month
	// (calendar periods in UTC) and in total; BudgetUSD its budgets, by
	// period, and RemainingUSD what is left of each.
	SpendUSD     map[string]float64 `json:"spend_usd"`
	BudgetUSD    map[string]float64 `json:"budget_usd,omitempty"`
	RemainingUSD map[string]float64 `json:"remaining_usd,omitempty"`
	// EstimatedUSD is the part of SpendUSD, by period, that estimates
	// cost: outputs estimated after their client left (the final count did
	// not come within settle_grace), and the input of requests whose client
	// left before the upstream counted it; absent when none was. In a fleet, what this
	// relay estimated since it started.
	EstimatedUSD map[string]float64 `json:"estimated_usd,omitempty"`
	// EstimatedPriceUSD is the part of SpendUSD, by period, charged for
	// models the price table does not know, at the dearest row of their
	// family; absent when none was. A `pricing` row for the model ends it.
	// In a fleet, what this relay charged so since it started.
	EstimatedPriceUSD map[string]float64 `json:"estimated_price_usd,omitempty"`
	// HeldUSD is what the key's requests in flight and its batches hold
	// against its budgets now (in a fleet, every relay's, as of the last
	// sync); a key without budgets holds nothing.
	HeldUSD float64 `json:"held_usd"`
}

// limitsStatus is a key's limits as configured, and what is in use now.
type limitsStatus struct {
	Rate string `json:"rate,omitempty"`
	// RateRemaining is how many requests the key may send now; absent when
	// the key has no rate, or when a fleet keeps it in Redis.
	RateRemaining *int64 `json:"rate_remaining,omitempty"`
	Tokens        string `json:"tokens,omitempty"`
	// TokensRemaining is what is left of the token limit now, negative
	// while the key is in debt; absent as RateRemaining is.
	TokensRemaining *int64 `json:"tokens_remaining,omitempty"`
	Concurrency     int64  `json:"concurrency,omitempty"`
	// Inflight counts the key's requests running on this relay now.
	Inflight int64 `json:"inflight"`
}

// status is the key's row in GET /relay/keys at now. Whatever is added to a
// key (budgets, spend) shows here.
func (k *key) status(now time.Time) keyStatus {
	st := keyStatus{
		Name:     k.name,
		Kind:     k.kind(),
		Group:    k.group.name,
		Priority: k.prio.String(),
		Expired:  !k.expires.IsZero() && !now.Before(k.expires),
		Disabled: k.disabled,
		Limits:   limitsStatus{Rate: k.opts.Rate, Tokens: k.opts.Tokens},
	}
	if !k.expires.IsZero() {
		at := k.expires.UTC()
		st.Expires = &at
	}
	var limits *limits.Limiter
	var account *money.Account
	if k.active.Load() {
		if k.limits == nil || k.state.spend == nil {
			return st // user *: each identity has its own limits and spend
		}
		limits, account = k.limits, k.state.spend
	} else {
		limits, account = k.dormant(now)
	}
	st.Limits.Concurrency, st.Limits.Inflight = limits.MaxConcurrency(), limits.Inflight()
	if k.active.Load() || k.relay.fleet == nil {
		st.Limits.RateRemaining, st.Limits.TokensRemaining = limits.Remaining(now)
	} // else what is left is the fleet's, not shown, as for a key in use
	spent, caps := account.Spent(now)
	st.HeldUSD = account.HeldUSD()
	st.SpendUSD = map[string]float64{}
	for p := range money.NumPeriods {
		if p == money.PeriodTotal && caps[p] <= 0 {
			continue // counted only with a total budget
		}
		st.SpendUSD[p.String()] = spent[p]
		if caps[p] > 0 {
			if st.BudgetUSD == nil {
				st.BudgetUSD, st.RemainingUSD = map[string]float64{}, map[string]float64{}
			}
			st.BudgetUSD[p.String()], st.RemainingUSD[p.String()] = caps[p], max(0, (money.ToNano(caps[p])-money.ToNano(spent[p])).USD())
		}
	}
	output, price := account.Estimates(now)
	if output != [money.NumPeriods]float64{} {
		st.EstimatedUSD = map[string]float64{}
		for p := range money.NumPeriods {
			st.EstimatedUSD[p.String()] = output[p]
		}
	}
	if price != [money.NumPeriods]float64{} {
		st.EstimatedPriceUSD = map[string]float64{}
		for p := range money.NumPeriods {
			st.EstimatedPriceUSD[p.String()] = price[p]
		}
	}
	return st
}

// dormant is the state a key that has served no request yet would take:
// its limits untouched, and what it spent before, as stored. (A key with
// budgets takes its state when its config loads.)
func (k *key) dormant(now time.Time) (*limits.Limiter, *money.Account) {
	lim, _ := limits.Parse(k.opts.Rate, k.opts.Tokens, k.opts.Concurrency) // validated already
	l := new(limits.Limiter)
	l.Configure(lim, now)
	return l, money.Stored(k.stateID)
}

// usage answers GET /relay/usage from the ledger: {"rows": [...]}, or CSV
// with one header row, written as the database gives the rows (a name
// that a spreadsheet would take for a formula behind a ').
func (adminAPI) usage(w http.ResponseWriter, r *http.Request) error {
	q, err := ledger.ParseQuery(r.URL.Query(), time.Now())
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: err}
	}
	l, err := ledger.Current()
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: err}
	}
	return ledger.WriteUsage(w, r, l, q)
}

// Interface guards
var (
	_ caddy.Module      = (*adminAPI)(nil)
	_ caddy.AdminRouter = (*adminAPI)(nil)
)
