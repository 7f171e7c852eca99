package relay

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/money"
)

// scopeChannel is a channel of scopeRelay: its upstream's handler, its
// spend caps and its priority.
type scopeChannel struct {
	h     http.Handler
	caps  []string
	prio  int
	up    *fakeupstream.Upstream
	state string // its name, once provisioned
}

// scopeRelay is a relay of two keys without budgets, sk-<name>-a and
// sk-<name>-b, in group name (made unique in the process, as holdRelay
// does, and shaped by group), whose channels <name>-0, <name>-1... are
// chs, on the strict fake upstream. Its model m-hold costs nothing for
// input and $0.01 an output token, as holdRelay's. Its clock is 23:00 UTC.
func scopeRelay(t *testing.T, name *string, group func(*Group), chs ...*scopeChannel) (*Relay, *fakeClock) {
	t.Helper()
	*name += "-" + strconv.FormatInt(holdRelays.Add(1), 10)
	n := *name
	r := &Relay{Pricing: map[string]Price{"m-hold": {Input: 0, Output: 10_000}}}
	g := &Group{Name: n}
	for i, c := range chs {
		c.up = fakeupstream.New(t, c.h)
		if gt, ok := c.h.(*gate); ok {
			t.Cleanup(gt.openAll) // before the upstream closes, whatever the test did
		}
		c.state = n + "-" + strconv.Itoa(i)
		r.Channels = append(r.Channels, &Channel{Name: c.state, Priority: c.prio, SpendCaps: c.caps,
			UpstreamRaw: upstream("anthropic", "url", c.up.URL, "api_key", fakeupstream.Key)})
		g.Channels = append(g.Channels, c.state)
	}
	if group != nil {
		group(g)
	}
	r.Groups = []*Group{g}
	for _, k := range []string{"a", "b"} {
		r.Keys = append(r.Keys, &Key{Secret: "sk-" + n + "-" + k, Group: n, KeyOptions: KeyOptions{Name: n + "-" + k}})
	}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Date(2030, time.March, 15, 23, 0, 0, 0, time.UTC)}
	r.now = clock.now
	return r, clock
}

// scopeMetric reads the series of the spend collector's metric name for
// scope's who, in period; false when there is none.
func scopeMetric(t *testing.T, name, scope, who, period string) (float64, bool) {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(money.SpendCollector)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["scope"] == scope && labels[scope] == who && labels["period"] == period {
				for _, other := range [...]string{money.OfKey.String(), money.OfGroup.String(), money.OfChannel.String(), money.OfSession.String()} {
					if other != scope && labels[other] != "" {
						t.Errorf("%s of %s %q has label %s=%q", name, scope, who, other, labels[other])
					}
				}
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

// channelRow is the channel's row of GET /relay/channels.
func channelRow(t *testing.T, name string) channelStatus {
	t.Helper()
	w := httptest.NewRecorder()
	if err := (adminAPI{}).list(w, httptest.NewRequest(http.MethodGet, "/relay/channels", nil)); err != nil {
		t.Fatal(err)
	}
	var rows []channelStatus
	if err := json.Unmarshal(w.Body.Bytes(), &rows); err != nil {
		t.Fatal(err)
	}
	for _, row := range rows {
		if row.Name == name {
			return row
		}
	}
	t.Fatalf("GET /relay/channels has no channel %q: %s", name, w.Body)
	return channelStatus{}
}

// TestAGroupBudgetHoldsItsKeysTogether: two keys without budgets of their
// own share their group's $1 a day. Their requests in flight hold against
// it together: one that would fit once they settle waits, one that could
// never fit is refused at once, naming the group; the group's spend is
// the sum of its keys'.
func TestAGroupBudgetHoldsItsKeysTogether(t *testing.T) {
	g, name := newGate(), "scope-group"
	r, _ := scopeRelay(t, &name, func(g *Group) { g.Budgets = []string{"1usd/day"} }, &scopeChannel{h: g})
	acct := r.groups[name].spend
	keyA, keyB := "sk-"+name+"-a", "sk-"+name+"-b"

	a := serveAsync(t, r, keyA, holdBody(60)) // holds $0.60 of the group's $1
	g.arrival(t, "A")
	b := serveAsync(t, r, keyB, holdBody(60)) // another key: $1.20 would be held
	waitFor(t, "B queued on the group's budget", 5*time.Second, func() bool { return queuedOn(r, name, acct) })
	w, _ := serveHandler(t, r, newRequest(holdBody(101), keyB))
	if typ, code, msg := budgetError(t, w); w.Code != 429 || typ != "rate_limit_error" || code != "budget_exceeded" ||
		!strings.Contains(msg, `group "`+name+`" cannot afford`) {
		t.Fatalf("a request over the group's budget: %d %s", w.Code, w.Body)
	}
	if w.Header().Get("Retry-After") != "3600" || w.Header().Get("X-Should-Retry") != "false" {
		t.Errorf("retry-after %q (want 3600, to midnight), x-should-retry %q", w.Header().Get("Retry-After"), w.Header().Get("X-Should-Retry"))
	}
	if held := acct.HeldUSD(); held != 0.6 {
		t.Errorf("the group holds %v, want A's 0.60", held)
	}
	for _, g := range (statusSource{}).Snapshot(time.Now()).Groups {
		if g.Name == name && (g.HeldUSD != 0.6 || g.BudgetUSD["day"] != 1 || g.SpendUSD["day"] != 0 || len(g.BudgetUSD) != 1) {
			t.Errorf("the status page's row of the group: %+v; want $0.60 held of a $1 daily budget", g)
		}
	}

	g.answer <- struct{}{} // A costs $0.10: B fits beside it
	if w := a.wait(t, "A"); w.Code != 200 {
		t.Fatalf("A: %d %s", w.Code, w.Body)
	}
	g.arrival(t, "B, once A settled")
	g.openAll()
	if w := b.wait(t, "B"); w.Code != 200 {
		t.Fatalf("B: %d %s", w.Code, w.Body)
	}
	if spent, ok := scopeMetric(t, "relay_spend_usd", "group", name, "day"); !ok || spent < 0.1999 || spent > 0.2001 {
		t.Errorf("relay_spend_usd of the group today: %v (%v), want its two keys' 0.20", spent, ok)
	}
	if budget, ok := scopeMetric(t, "relay_budget_usd", "group", name, "day"); !ok || budget != 1 {
		t.Errorf("relay_budget_usd of the group: %v (%v), want 1", budget, ok)
	}
	for _, k := range []string{name + "-a", name + "-b"} {
		if _, spent := heldAndSpent(t, k); spent != 0.1 {
			t.Errorf("key %s spent %v, want 0.10", k, spent)
		}
	}
	if acct.HeldUSD() != 0 || !acct.Idle() {
		t.Errorf("the group still holds %v", acct.HeldUSD())
	}
}

// TestAGroupSpendsWithoutABudget: a group without a budget still counts
// what its keys spend, so that a budget added later finds the period's
// spend; a budget added by a reload then refuses at once.
func TestAGroupSpendsWithoutABudget(t *testing.T) {
	name := "scope-nobudget"
	up := &scopeChannel{h: fakeupstream.Message("ok")}
	r, _ := scopeRelay(t, &name, nil, up)
	for _, k := range []string{"a", "b", "a"} {
		if w, _ := serveHandler(t, r, newRequest(holdBody(10), "sk-"+name+"-"+k)); w.Code != 200 {
			t.Fatalf("%d %s", w.Code, w.Body)
		}
	}
	// fakeupstream.Message reports 5 output tokens: $0.05 each
	if spent, ok := scopeMetric(t, "relay_spend_usd", "group", name, "month"); !ok || spent < 0.1499 || spent > 0.1501 {
		t.Fatalf("relay_spend_usd of a group without a budget: %v (%v), want 0.15", spent, ok)
	}
	if _, ok := scopeMetric(t, "relay_spend_usd", "group", name, "day"); ok {
		t.Error("a group without a daily budget exports its daily spend")
	}
	// the same group, reloaded with a budget it has spent already
	cfg := *r.Groups[0]
	cfg.Budgets = []string{"0.15usd/month"}
	ch := &Channel{Name: r.Channels[0].Name, UpstreamRaw: upstream("anthropic", "url", up.up.URL, "api_key", fakeupstream.Key)}
	key := &Key{Secret: "sk-" + name + "-b", Group: name, KeyOptions: KeyOptions{Name: name + "-b"}}
	r2 := &Relay{Pricing: r.Pricing, Channels: []*Channel{ch}, Groups: []*Group{&cfg}, Keys: []*Key{key}}
	provisionHandler(t, r2)
	r2.now = r.now
	w, _ := serveHandler(t, r2, newRequest(holdBody(1), "sk-"+name+"-b"))
	if _, code, msg := budgetError(t, w); w.Code != 429 || code != "budget_exceeded" || !strings.Contains(msg, `group "`+name+`" has spent $0.15 of its monthly $0.15 budget`) {
		t.Fatalf("a group whose new budget is spent: %d %s", w.Code, w.Body)
	}
}

// TestACappedChannelLeavesSelection: a channel of spend_cap $0.20 a day
// serves until its cap is spent, then leaves selection as capped until
// midnight, and requests go to the next channel; with none left, 503
// no_healthy_channel names the cap, retry-after to midnight. After
// midnight it serves again.
func TestACappedChannelLeavesSelection(t *testing.T) {
	name := "scope-cap"
	capped := &scopeChannel{h: fakeupstream.Message("ok"), caps: []string{"0.2usd/day"}, prio: 1}
	next := &scopeChannel{h: fakeupstream.Message("ok"), prio: 2}
	r, clock := scopeRelay(t, &name, nil, capped, next)
	key := "sk-" + name + "-a"
	send := func() *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(holdBody(5), key)) // holds $0.05; costs $0.05
		return w
	}
	for i := range 4 {
		if w := send(); w.Code != 200 {
			t.Fatalf("request %d: %d %s", i, w.Code, w.Body)
		}
	}
	if capped.up.Hits() != 4 || next.up.Hits() != 0 {
		t.Fatalf("within the cap: %d on the capped channel, %d on the next; want 4 and 0", capped.up.Hits(), next.up.Hits())
	}
	row := channelRow(t, capped.state)
	if row.State != stateCapped || row.CappedUntil == nil || !row.CappedUntil.Equal(time.Date(2030, time.March, 16, 0, 0, 0, 0, time.UTC)) ||
		row.SpendUSD["day"] != 0.2 || row.SpendCapUSD["day"] != 0.2 {
		t.Fatalf("a channel that spent its cap: %+v", row)
	}
	if spent, ok := scopeMetric(t, "relay_spend_usd", "channel", capped.state, "day"); !ok || spent != 0.2 {
		t.Errorf("relay_spend_usd of the capped channel: %v (%v)", spent, ok)
	}
	if _, ok := scopeMetric(t, "relay_spend_usd", "channel", next.state, "month"); ok {
		t.Error("a channel without a cap has a spend series")
	}
	if w := send(); w.Code != 200 || capped.up.Hits() != 4 || next.up.Hits() != 1 {
		t.Fatalf("capped: %d, %d and %d hits; want the next channel to serve", w.Code, capped.up.Hits(), next.up.Hits())
	}

	if _, err := steerChannel(next.state, "disable"); err != nil {
		t.Fatal(err)
	}
	w := send()
	if _, code, msg := budgetError(t, w); w.Code != 503 || code != "no_healthy_channel" ||
		!strings.Contains(msg, "has spent its daily spend_cap") || strings.Contains(msg, "$") || strings.Contains(msg, capped.state) {
		t.Fatalf("no channel left but a capped one (named by its cap, never by its channel or its spend, which other groups share): %d %s", w.Code, w.Body)
	}
	if w.Header().Get("Retry-After") != "3600" {
		t.Errorf("retry-after %q, want 3600 (midnight)", w.Header().Get("Retry-After"))
	}

	clock.advance(time.Hour)
	if w := send(); w.Code != 200 || capped.up.Hits() != 5 {
		t.Fatalf("the next day: %d, %d hits on the capped channel", w.Code, capped.up.Hits())
	}
	if row := channelRow(t, capped.state); row.State != stateHealthy || row.CappedUntil != nil || row.SpendUSD["day"] != 0.05 {
		t.Fatalf("the next day: %+v", row)
	}
}

// TestAChannelCapHoldsRequestsInFlight: requests in flight on a capped
// channel hold their worst case against its cap, so a request whose hold
// would pass the cap goes to the next channel while they run, not after
// they spent it.
func TestAChannelCapHoldsRequestsInFlight(t *testing.T) {
	g, name := newGate(), "scope-capheld"
	capped := &scopeChannel{h: g, caps: []string{"0.25usd/day"}, prio: 1}
	next := &scopeChannel{h: fakeupstream.Message("ok"), prio: 2}
	r, _ := scopeRelay(t, &name, nil, capped, next)
	key := "sk-" + name + "-a"
	acct := groupChannel(t, r, name, capped.state).spend

	first := serveAsync(t, r, key, holdBody(10)) // $0.10 held on the cap
	g.arrival(t, "the first")
	second := serveAsync(t, r, key, holdBody(10)) // $0.20
	g.arrival(t, "the second")
	if held := acct.HeldUSD(); held != 0.2 {
		t.Fatalf("two requests in flight hold %v of the cap, want 0.20", held)
	}
	// a third would hold $0.30 of $0.25: it goes to the next channel
	if w, _ := serveHandler(t, r, newRequest(holdBody(10), key)); w.Code != 200 || next.up.Hits() != 1 {
		t.Fatalf("a request the cap cannot hold: %d %s, %d on the next channel", w.Code, w.Body, next.up.Hits())
	}
	if channelRow(t, capped.state).State != stateHealthy {
		t.Error("a channel whose cap is held but not spent shows as capped")
	}
	g.openAll()
	for which, s := range map[string]*sent{"first": first, "second": second} {
		if w := s.wait(t, which); w.Code != 200 {
			t.Fatalf("%s: %d %s", which, w.Code, w.Body)
		}
	}
	// each cost $0.10 (the gate's 10 output tokens)
	if held, row := acct.HeldUSD(), channelRow(t, capped.state); held != 0 || row.SpendUSD["day"] != 0.2 {
		t.Fatalf("settled: %v held, %v spent on the cap; want nothing held, 0.20 spent", held, row.SpendUSD["day"])
	}
}

// TestAFailoverMovesTheChannelHold: a request whose capped channel fails
// before its answer gives that cap its hold back, unspent, and the
// channel that serves it is charged.
func TestAFailoverMovesTheChannelHold(t *testing.T) {
	name := "scope-capmove"
	failing := &scopeChannel{h: fakeupstream.Error(529, "overloaded_error", "Overloaded"), caps: []string{"1usd/day"}, prio: 1}
	serving := &scopeChannel{h: fakeupstream.Message("ok"), caps: []string{"1usd/month"}, prio: 2}
	r, _ := scopeRelay(t, &name, func(g *Group) { g.Budgets = []string{"10usd/day"} }, failing, serving)
	if w, _ := serveHandler(t, r, newRequest(holdBody(50), "sk-"+name+"-a")); w.Code != 200 || failing.up.Hits() != 1 || serving.up.Hits() != 1 {
		t.Fatalf("%d %s; %d and %d hits", w.Code, w.Body, failing.up.Hits(), serving.up.Hits())
	}
	for _, c := range []struct {
		a            *money.Account
		held, spent  float64
		what, period string
	}{
		{groupChannel(t, r, name, failing.state).spend, 0, 0, "the channel that failed", "day"},
		{groupChannel(t, r, name, serving.state).spend, 0, 0.05, "the channel that served", "month"},
		{r.groups[name].spend, 0, 0.05, "the group", "day"},
	} {
		spent, _ := c.a.Spent(r.now())
		if held := c.a.HeldUSD(); held != c.held || spent[periodOf(t, c.period)] != c.spent {
			t.Errorf("%s: held %v, spent %v; want %v and %v", c.what, held, spent[periodOf(t, c.period)], c.held, c.spent)
		}
	}
}

// groupChannel is the channel named ch of r's group.
func groupChannel(t *testing.T, r *Relay, group, ch string) *channel {
	t.Helper()
	for _, c := range r.groups[group].channels {
		if c.name == ch {
			return c
		}
	}
	t.Fatalf("group %q has no channel %q", group, ch)
	return nil
}

// periodOf is the period named name.
func periodOf(t *testing.T, name string) money.Period {
	t.Helper()
	for p := range money.NumPeriods {
		if p.String() == name {
			return p
		}
	}
	t.Fatalf("no period %q", name)
	return 0
}

// TestABatchHoldsItsGroupsBudget: a batch of a key without a budget
// holds its worst case against its group's, and one over it is refused
// before the upstream sees it; a batch over what a capped channel has
// left is not sent there.
func TestABatchHoldsItsGroupsBudget(t *testing.T) {
	store, name := fakeupstream.NewStore("scope"), "scope-batch"
	r, _ := scopeRelay(t, &name, func(g *Group) { g.Budgets = []string{"1usd/day"} }, &scopeChannel{h: store, caps: []string{"0.5usd/day"}})
	acct := r.groups[name].spend
	call := func(body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/v1/messages/batches", strings.NewReader(body))
		req.Header.Set("X-Api-Key", "sk-"+name+"-a")
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("Content-Type", "application/json")
		w, _ := serveHandler(t, r, req)
		return w
	}
	batch := func(n, maxTokens int) string {
		reqs := make([]string, n)
		for i := range reqs {
			reqs[i] = fmt.Sprintf(`{"custom_id":"r%d","params":%s}`, i, holdBody(maxTokens))
		}
		return `{"requests":[` + strings.Join(reqs, ",") + `]}`
	}
	// $0.005 a token at the batch price: 300 requests of 100 are $150
	w := call(batch(300, 100))
	if _, code, msg := budgetError(t, w); w.Code != 429 || code != "budget_exceeded" || !strings.Contains(msg, `group "`+name+`"`) {
		t.Fatalf("a batch over the group's budget: %d %s", w.Code, w.Body)
	}
	// $0.60: within the group's $1, over the channel's $0.50
	w = call(batch(12, 10))
	if _, code, msg := budgetError(t, w); w.Code != 503 || code != "no_healthy_channel" || !strings.Contains(msg, "spend_cap") {
		t.Fatalf("a batch over the channel's cap: %d %s", w.Code, w.Body)
	}
	if store.Batches() != 0 {
		t.Fatalf("the upstream made %d batches of refused creates", store.Batches())
	}
	if w := call(batch(2, 10)); w.Code != 200 {
		t.Fatalf("a batch that fits: %d %s", w.Code, w.Body)
	}
	if held := acct.HeldUSD(); held != 0.1 {
		t.Errorf("the group holds %v for the batch, want 0.10", held)
	}
}

// TestBudgetAlertsCoverEveryScope runs the budget alerts on what two
// relays exported, each of a group with a budget and a capped channel:
// the alerts name the group or the channel whose budget is spent or
// nearly, and series of several groups (whose key label is empty) do not
// break their joins.
func TestBudgetAlertsCoverEveryScope(t *testing.T) {
	promtool := needTool(t, "promtool", "apt-get install -y prometheus")
	spentName, nearName := "alert-scope-spent", "alert-scope-near"
	// two answers of $0.05 each: $0.10 spent by each group and channel
	spent := &scopeChannel{h: fakeupstream.Message("ok"), caps: []string{"1usd/day"}}
	rs, _ := scopeRelay(t, &spentName, func(g *Group) { g.Budgets = []string{"0.1usd/day"} }, spent)
	near := &scopeChannel{h: fakeupstream.Message("ok"), caps: []string{"0.1usd/day"}}
	rn, _ := scopeRelay(t, &nearName, func(g *Group) { g.Budgets = []string{"0.12usd/day"} }, near)
	for _, c := range []struct {
		r    *Relay
		name string
	}{{rs, spentName}, {rn, nearName}} {
		for range 2 {
			if w, _ := serveHandler(t, c.r, newRequest(holdBody(5), "sk-"+c.name+"-a")); w.Code != 200 {
				t.Fatalf("%s: %d %s", c.name, w.Code, w.Body)
			}
		}
	}
	series := spendSeries(t, func(label, value string) bool {
		return (label == "group" || label == "channel") && strings.HasPrefix(value, "alert-scope-")
	})
	rules, err := filepath.Abs("examples/prometheus/relay-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	exprs := alertExprs(t, rules)
	promtoolTest(t, promtool, rules, series, fmt.Sprintf(`      - expr: %q
        eval_time: 5m
        exp_samples:
          - labels: '{group=%q,period="day",scope="group"}'
            value: 0.1
      - expr: %q
        eval_time: 5m
        exp_samples:
          - labels: '{group=%q,period="day",scope="group"}'
            value: 0.1
          - labels: '{channel=%q,period="day",scope="channel"}'
            value: 0.1
`, exprs["RelayBudgetNearlySpent"], nearName, exprs["RelayBudgetExhausted"], spentName, near.state), "the budget alerts of groups and channels")
}

// spendSeries renders the spend collector's series that have a label
// keep takes as promtool's input series, each steady for 10 minutes.
func spendSeries(t *testing.T, keep func(label, value string) bool) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(money.SpendCollector)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var series strings.Builder
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var pairs []string
			kept := false
			for _, l := range m.GetLabel() {
				pairs = append(pairs, l.GetName()+"="+strconv.Quote(l.GetValue()))
				kept = kept || keep(l.GetName(), l.GetValue())
			}
			if kept {
				fmt.Fprintf(&series, "      - series: '%s{%s}'\n        values: '%gx10'\n", mf.GetName(), strings.Join(pairs, ","), m.GetGauge().GetValue())
			}
		}
	}
	return series.String()
}

// TestParallelBatchesHoldAChannelsSpendCap makes 30 batches at once
// through a channel with a $0.05 daily spend cap and no other budget:
// each holds its worst case ($0.04) against the cap from its create until
// its results settle it, so one is made and the rest are refused, where
// each used to see the cap's room and pass; the results then charge the
// cap what they cost and give its hold back.
func TestParallelBatchesHoldAChannelsSpendCap(t *testing.T) {
	store, name := fakeupstream.NewStore("capbatch"), "cap-batch"
	r, _ := scopeRelay(t, &name, nil, &scopeChannel{h: store, caps: []string{"0.05usd/day"}})
	ch := r.groups[name].channels[0].spend
	call := func(method, path, body string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(method, path, strings.NewReader(body))
		req.Header.Set("X-Api-Key", "sk-"+name+"-a")
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("Content-Type", "application/json")
		w, _ := serveHandler(t, r, req)
		return w
	}
	// two requests of up to 4 output tokens at $0.005 (the batch price)
	batch := `{"requests":[{"custom_id":"r0","params":` + holdBody(4) + `},{"custom_id":"r1","params":` + holdBody(4) + `}]}`
	var made []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := call(http.MethodPost, "/v1/messages/batches", batch)
			var b struct{ ID string }
			if w.Code == 200 && json.Unmarshal(w.Body.Bytes(), &b) == nil {
				mu.Lock()
				made = append(made, b.ID)
				mu.Unlock()
			} else if w.Code != 503 || !strings.Contains(w.Body.String(), "spend_cap") {
				t.Errorf("a refused batch: %d %s", w.Code, w.Body)
			}
		}()
	}
	wg.Wait()
	if len(made) != 1 || store.Batches() != 1 {
		t.Fatalf("%d batches made (upstream: %d) on a $0.05 cap at $0.04 each, want 1", len(made), store.Batches())
	}
	if held := ch.HeldUSD(); held != 0.04 {
		t.Errorf("the channel's cap holds %v for the batch, want 0.04", held)
	}
	// its results: 5 output tokens each, $0.025 each at the batch price
	if w := call(http.MethodGet, "/v1/messages/batches/"+made[0]+"/results", ""); w.Code != 200 {
		t.Fatalf("results: %d %s", w.Code, w.Body)
	}
	spent, _ := ch.Spent(r.now())
	t.Logf("figure: 30 parallel batch creates on a $0.05 cap: %d made, $%.4f spent once read", len(made), spent[money.PeriodDay])
	if held := ch.HeldUSD(); held != 0 || spent[money.PeriodDay] < 0.0499 || spent[money.PeriodDay] > 0.0501 {
		t.Errorf("results read: the cap holds %v and spent %v, want 0 and 0.05", held, spent[money.PeriodDay])
	}
}
