package relay

import (
	"cmp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/affinity"
	"github.com/caddy-relay/relay/internal/idle"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
)

// Group is a set of channels that serves the keys that name it.
type Group struct {
	// Name identifies the group; keys name it.
	Name string `json:"name"`

	// Channels lists the names of the group's channels. A channel may be in
	// several groups; its health is shared.
	Channels []string `json:"channels"`

	// Retries is how many further attempts a request may make after its
	// first, each on a channel it has not tried yet. Default: 2.
	Retries *int `json:"retries,omitempty"`

	// ExposeChannel adds the x-relay-channel response header naming the
	// channel that answered.
	ExposeChannel bool `json:"expose_channel,omitempty"`

	// RetryBudget caps the group's retries, across all its requests, at
	// this fraction (0 to 1) of its requests over the last 10 seconds, so
	// an outage does not multiply the load on the upstreams. A request
	// whose retry is refused gets the last upstream answer. Default: 0.2.
	RetryBudget *float64 `json:"retry_budget,omitempty"`

	// RetryBudgetFloor is the rate of retries per second always allowed,
	// whatever the ratio, so a quiet group can still fail over. Default: 10.
	RetryBudgetFloor *float64 `json:"retry_budget_floor,omitempty"`

	// MaxQueue bounds the requests waiting in the group's queue for a busy
	// channel; past it a request gets 429 rate_limit_error, code
	// queue_timeout. 0 keeps the default; a negative value disables
	// queueing. Default: 1000.
	MaxQueue int `json:"max_queue,omitempty"`

	// MaxWait is how long a request of each priority class (realtime,
	// normal, batch) may wait in the queue before its 429 queue_timeout.
	// Default: realtime 10s, normal 30s, batch 5m.
	MaxWait map[string]caddy.Duration `json:"max_wait,omitempty"`

	// Policy picks among the live channels of the best tier: `weighted`
	// (default) by weight at random; `adaptive` by weight scaled down by
	// load, recent failures and latency, so traffic drains from a channel
	// that degrades; `sticky` keeps each session on one channel while it
	// stays live, so the prompt cache keeps hitting.
	Policy string `json:"policy,omitempty"`

	// Splits sends a share of sessions (or keys, for requests without a
	// session) to a channel, whatever its priority: a canary. The others
	// never reach it while another channel is live. By channel name, shares
	// from 0 to 1.
	Splits map[string]float64 `json:"splits,omitempty"`

	// Fallbacks lets a request for a model be served by channels of the
	// listed models, in order, when no channel of the model itself is live
	// (only then). By the requested model's name.
	Fallbacks map[string][]string `json:"fallbacks,omitempty"`

	// WaitForRecovery lets a request whose every channel is cooling down
	// wait up to this long for the first to recover, instead of getting
	// the 503 no_healthy_channel at once. Default: 0 (no wait).
	WaitForRecovery caddy.Duration `json:"wait_for_recovery,omitempty"`

	// Cache turns on the group's response cache: identical requests are
	// answered from it, byte for byte, without an upstream. Off by default.
	Cache *ResponseCache `json:"cache,omitempty"`

	// Budgets cap what the group spends, all its keys and users together,
	// each as `<amount>usd/<period>` with period day, week or month
	// (calendar periods in UTC) or total (never renews), at most one per
	// period. A request holds its worst case against the group's budgets
	// as against its key's, and is refused with 429 budget_exceeded when
	// it cannot fit. The group's spend counts from its first request,
	// budget or none.
	Budgets []string `json:"budgets,omitempty"`

	// BudgetWarn is the share of a group budget at which the relay logs a
	// warning, once per period. Default: 0.8.
	BudgetWarn float64 `json:"budget_warn,omitempty"`

	// CacheAffinity sends a request whose prompt prefix (up to a
	// cache_control breakpoint) is warm in a channel's prompt cache to
	// that channel, when it is a live channel of the best tier, whatever
	// the policy would pick in the tier: another session or key of the
	// group with the same system prompt and tools reads the cache instead
	// of writing it again. The relay remembers which channel served each
	// prefix for the breakpoint's TTL (5m or 1h), per node, or in Redis
	// for a fleet. Default: true; false turns it off.
	CacheAffinity *bool `json:"cache_affinity,omitempty"`
	// ThinkingFailover says what a conversation carrying thinking blocks
	// signed by one signature domain may do when none of that domain's
	// channels can serve it. Unset (the default): it stays in its domain,
	// and gets 503 capability_not_available naming thinking_signature when
	// the group has no channel of it. `strip`: it may go to a channel of
	// another domain, the thinking blocks that domain did not sign removed
	// from the body sent to it (counted in relay_thinking_stripped_total).
	ThinkingFailover string `json:"thinking_failover,omitempty"`
	// SessionLimits hold each agent session of the group's keys and users
	// to a budget, a rate and a loop guard, unless the key or user entry
	// sets its own.
	SessionLimits
	// BudgetDegrade serves the messages of the group's keys and users more
	// cheaply as the tightest budget that applies to each (its key's or
	// user's, the group's, or its session's session_budget) nears its end, as a key's budget_degrade
	// does; a key or user entry with steps of its own follows its own.
	BudgetDegrade []BudgetDegrade `json:"budget_degrade,omitempty"`
}

// Policies.
const (
	policyWeighted = "weighted"
	policyAdaptive = "adaptive"
	policySticky   = "sticky"
)

// group is a provisioned Group.
type group struct {
	name        string
	channels    []*channel
	retries     int
	expose      bool
	models      []string      // models listed by its channels' `models` lines, in their order
	catalog     *modelCatalog // what GET /v1/models shows (models.go)
	state       *groupState   // retry budget and queue, kept across reloads
	budgetRatio float64
	budgetFloor float64 // retries per second
	waitMax     time.Duration
	maxQueue    int
	maxWait     [priorityCount]time.Duration
	policy      string
	splits      []groupSplit
	fallbacks   map[string][]string // model -> the models that may serve it
	cache       *responseCache      // nil: none
	// maxPriceFactor is the highest price_factor of its channels: what a
	// request's worst case is held at
	maxPriceFactor float64
	spend          *money.Account // what the group spent, and its budgets
	capped         bool           // a channel of it has a spend cap
	affinity       bool           // prompt-cache affinity is on (affinity.go)
	table          *affinity.Table
	stripThinking  bool // thinking_failover strip
	// signers: who signed a request's thinking blocks can change where it
	// goes (its channels span several signature domains, or it strips),
	// so inspect reads them (inspect_messages.go)
	signers    bool
	sessions   *sessionRules // its session limits; nil: none
	degrade    []degradeRule // its budget_degrade steps, by share
	degradeCfg []BudgetDegrade
}

// provisionGroups builds the groups and takes their state (retry budget,
// queue) from the process-wide pool.
func (r *Relay) provisionGroups(channels map[string]*channel) error {
	r.groups = make(map[string]*group, len(r.Groups))
	for _, cfg := range r.Groups {
		g := &group{name: cfg.Name, retries: defaultRetries, expose: cfg.ExposeChannel,
			budgetRatio: limits.DefaultRetryBudget, budgetFloor: limits.DefaultRetryBudgetFloor, waitMax: time.Duration(cfg.WaitForRecovery),
			maxQueue: defaultMaxQueue, maxWait: defaultMaxWait, policy: cmp.Or(cfg.Policy, policyWeighted), fallbacks: cfg.Fallbacks,
			stripThinking: cfg.ThinkingFailover == thinkingFailoverStrip}
		for name, share := range cfg.Splits {
			g.splits = append(g.splits, groupSplit{ch: channels[name], share: share})
		}
		slices.SortFunc(g.splits, func(a, b groupSplit) int { return strings.Compare(a.ch.name, b.ch.name) })
		if cfg.Retries != nil {
			g.retries = *cfg.Retries
		}
		if cfg.RetryBudget != nil {
			g.budgetRatio = *cfg.RetryBudget
		}
		if cfg.RetryBudgetFloor != nil {
			g.budgetFloor = *cfg.RetryBudgetFloor
		}
		if cfg.MaxQueue != 0 {
			g.maxQueue = max(cfg.MaxQueue, 0)
		}
		for class, d := range cfg.MaxWait {
			p, _ := priorityByName(class)
			g.maxWait[p] = time.Duration(d)
		}
		g.sessions = (*sessionRules)(nil).under(&cfg.SessionLimits)
		st, _, err := groupStates.LoadOrNew(cfg.Name, func() (caddy.Destructor, error) { return new(groupState), nil })
		if err != nil {
			return err
		}
		r.held.addGroup(cfg.Name)
		g.state = st.(*groupState)
		if g.spend, err = r.groupSpend(cfg); err != nil {
			return err
		}
		g.state.spend.Store(g.spend)
		if cfg.Cache != nil {
			g.cache = g.state.cacheFor(*cfg.Cache)
		}
		if g.affinity = cfg.CacheAffinity == nil || *cfg.CacheAffinity; g.affinity {
			g.table = g.state.affinityTable()
		}
		every := false // a channel serves every model
		for _, name := range cfg.Channels {
			ch := channels[name]
			g.channels = append(g.channels, ch)
			every = every || ch.models == nil
			g.maxPriceFactor = max(g.maxPriceFactor, ch.priceFactor)
			g.capped = g.capped || ch.spend != nil
			for _, m := range ch.modelNames {
				if !slices.Contains(g.models, m) {
					g.models = append(g.models, m)
				}
			}
		}
		g.catalog = newModelCatalog(g.models, every, r.prices)
		g.degrade, g.degradeCfg = degradeRules(cfg.BudgetDegrade), cfg.BudgetDegrade
		if err := checkDegradeModels(cfg.BudgetDegrade, g, "group "+strconv.Quote(g.name)); err != nil {
			return err
		}
		r.groups[cfg.Name] = g
	}
	return nil
}

// groupsOf lists, for each channel of the config, the groups that name it,
// in config order; a channel no group names has none (an empty list). It
// walks the groups once: asked channel by channel, a config of thousands of
// channels in hundreds of groups walked every group for every channel.
func (r *Relay) groupsOf() map[string][]string {
	out := make(map[string][]string, len(r.Channels))
	for _, cfg := range r.Channels {
		out[cfg.Name] = []string{}
	}
	for _, g := range r.Groups {
		for _, name := range g.Channels {
			if gs := out[name]; len(gs) == 0 || gs[len(gs)-1] != g.Name {
				out[name] = append(gs, g.Name)
			}
		}
	}
	return out
}

// groupStates holds each group's retry budget and queue by group name,
// process-wide, so a reload forgets neither the retries of the last seconds
// nor the requests waiting.
var groupStates = caddy.NewUsagePool()

// groupState is what a group keeps across reloads.
type groupState struct {
	budget limits.RetryBudget
	queue  waitQueue
	mu     sync.Mutex
	cache  *responseCache // the last config's, kept while its settings stay
	// affinity is its prompt-cache affinity records, made at the first
	// config that turns it on
	affinity *affinity.Table
	// spend is the group's spend account (spend_config.go), for the status
	// page
	spend atomic.Pointer[money.Account]
	// sessions are its keys' agent sessions (sessions.go); nil until the
	// first one
	sessions atomic.Pointer[idle.Cache[*principalSessions]]
	// sessionsKept counts the sessions in sessions, which it bounds
	sessionsKept atomic.Int64
}

// cacheFor returns the group's response cache for cfg: the one it has
// when its settings are the same, so a reload keeps the answers.
func (s *groupState) cacheFor(cfg ResponseCache) *responseCache {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cache == nil || s.cache.cfg != cfg {
		s.cache = newResponseCache(cfg)
	}
	return s.cache
}

// Destruct implements caddy.Destructor.
func (*groupState) Destruct() error { return nil }
