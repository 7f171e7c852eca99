package main

// Budgets that are ceilings, attacked as a tenant would: many requests at
// once while the upstream is slow to its first byte, on one relay and on
// two relays of a fleet, and a batch far over the budget.

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/redistest"
)

// holdPrices are the prices of the attacks: $100 per million input tokens
// and $10,000 per million output tokens. An input token is held at the
// dearest prompt price, a 1-hour cache write at twice the input price.
const (
	holdInput  = 100e-6
	holdOutput = 10_000e-6
	holdPrompt = 2 * holdInput
)

// holdOf is what a message body holds: its input estimate (a token every
// 4 bytes) at the dearest prompt price, and maxTokens of output.
func holdOf(body string, maxTokens int) float64 {
	return float64(len(body)/4+1)*holdPrompt + float64(maxTokens)*holdOutput
}

// fakeAnswerCost is what fakeupstream.Message's answer costs: 10 input and
// 5 output tokens.
const fakeAnswerCost = 10*holdInput + 5*holdOutput

// keyRow is a key's row of GET /relay/keys on the relay whose admin
// endpoint is admin.
func keyRow(t *testing.T, admin, name string) (spend, held float64) {
	t.Helper()
	resp, err := fleetClient.Get("http://" + admin + "/relay/keys")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []struct {
		Name     string             `json:"name"`
		SpendUSD map[string]float64 `json:"spend_usd"`
		HeldUSD  *float64           `json:"held_usd"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Name == name {
			if r.HeldUSD == nil {
				t.Errorf("GET /relay/keys: %q has no held_usd", name)
				return r.SpendUSD["day"], math.NaN()
			}
			return r.SpendUSD["day"], *r.HeldUSD
		}
	}
	t.Fatalf("GET /relay/keys has no key %q", name)
	return 0, 0
}

// fire sends n messages at once, with send, and returns their statuses
// and bodies once they are all answered.
func fire(n int, send func(i int) (int, string, error)) ([]int, []string, []error) {
	statuses, bodies, errs := make([]int, n), make([]string, n), make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { statuses[i], bodies[i], errs[i] = send(i) })
	}
	wg.Wait()
	return statuses, bodies, errs
}

// judgeAttack checks the answers of an attack: each served or refused
// with 429 budget_exceeded; it returns how many were served.
func judgeAttack(t *testing.T, statuses []int, bodies []string, errs []error) int {
	t.Helper()
	served := 0
	for i, s := range statuses {
		switch {
		case errs[i] != nil:
			t.Errorf("request %d: %v", i, errs[i])
		case s == 200:
			served++
		case s == 429 && strings.Contains(bodies[i], `"code":"budget_exceeded"`):
		default:
			t.Errorf("request %d: %d %s; want 200, or 429 budget_exceeded", i, s, bodies[i])
		}
	}
	return served
}

// TestFiftyParallelRequestsStayWithinTheBudget sends 50 messages at once on
// a key of budget 1usd/day to an upstream slow to its first byte: only as
// many as their holds fit in $1 reach it, the others wait in the queue
// (none is refused while nothing is spent); as they settle at their cost
// the waiters go, until what was spent and a hold no longer fit, and the
// rest are refused. The spend ends within $1 (the input estimate here is
// above the real input, so there is no estimate error to add).
func TestFiftyParallelRequestsStayWithinTheBudget(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	probe := &concurrencyProbe{release: make(chan struct{})}
	up := fakeupstream.New(t, probe)
	site, admin := freePort(t), freePort(t)
	config := filepath.Join(t.TempDir(), "Caddyfile")
	src := fmt.Sprintf(`{
	admin %s
	storage file_system %s
}
http://%s {
	relay {
		pricing {
			m-hold input 100 output 10000
		}
		key sk-hold-client-0123456789abcdef hold {
			name holder
			budget 1usd/day
		}
		channel up {
			url %s
			api_key sk-ant-api03-fake-upstream-key
		}
		group hold {
			channels up
		}
	}
}
`, admin, t.TempDir(), site, up.URL)
	if err := os.WriteFile(config, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	runCaddy(t, caddyBin, config)
	node := &fleetNode{site: site, admin: admin}

	const body = `{"model":"m-hold","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`
	hold := holdOf(body, 10)
	inFlight := int(1 / hold) // the holds that fit in $1 at once
	var answered sync.WaitGroup
	answered.Add(1)
	var statuses []int
	var bodies []string
	var errs []error
	go func() {
		defer answered.Done()
		statuses, bodies, errs = fire(50, func(int) (int, string, error) {
			return node.attemptBody("sk-hold-client-0123456789abcdef", body)
		})
	}()
	within(t, "the holds that fit at the upstream, the others queued", 10*time.Second, func() bool {
		return probe.held.Load() > int64(inFlight) || // past the budget already: judged below
			probe.held.Load() == int64(inFlight) && node.metric(t, "relay_queue_depth{") == float64(50-inFlight)
	})
	if _, held := keyRow(t, admin, "holder"); math.Abs(held-float64(inFlight)*hold) > 1e-6 {
		t.Errorf("held_usd %v with %d requests in flight, want %v", held, inFlight, float64(inFlight)*hold)
	}
	close(probe.release) // the upstream answers, now and from now on
	answered.Wait()

	served := judgeAttack(t, statuses, bodies, errs)
	spend, held := keyRow(t, admin, "holder")
	t.Logf("%d of 50 served, %d at the upstream at once, $%.4f spent of $1 (each held $%.4f, cost $%.4f)", served, probe.most.Load(), spend, hold, fakeAnswerCost)
	if spend > 1 || math.Abs(spend-float64(served)*fakeAnswerCost) > 1e-6 || held != 0 {
		t.Errorf("spent $%v and held $%v after %d answers of $%v; want the answers' cost, within $1, and nothing held", spend, held, served, fakeAnswerCost)
	}
	// every request that could have fit was served
	if want := int((1-hold)/fakeAnswerCost) + 1; served != want {
		t.Errorf("%d served, want %d: the last fits while $%v is spent", served, want, float64(want-1)*fakeAnswerCost)
	}
	if probe.most.Load() != int64(inFlight) || up.Hits() != served {
		t.Errorf("at most %d at the upstream at once (want %d), %d reached it (want %d)", probe.most.Load(), inFlight, up.Hits(), served)
	}
}

// attemptBody sends one message body with key.
func (n *fleetNode) attemptBody(key, body string) (int, string, error) {
	return n.postAs(key, "/v1/messages", body)
}

// postAs posts a JSON body to path with key, from any goroutine.
func (n *fleetNode) postAs(key, path, body string) (int, string, error) {
	req, _ := http.NewRequest(http.MethodPost, "http://"+n.site+path, strings.NewReader(body))
	req.Header.Set("X-Api-Key", key)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	req.Header.Set("Content-Type", "application/json")
	resp, err := fleetClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// TestFleetBudgetHoldsAcrossNodes is the same attack spread over two
// relays of a fleet on a real Redis: the holds of both relays are in
// Redis, so the fleet as a whole stays within the $1.
func TestFleetBudgetHoldsAcrossNodes(t *testing.T) {
	fleetBudgetAttack(t, fleetConfig{keyOpts: "\t\t\tbudget 1usd/day\n"}, "app", []string{fleetKey}, func(t *testing.T, n *fleetNode) (float64, float64) {
		return keyRow(t, n.admin, "app")
	})
}

// TestFleetGroupBudgetHoldsAcrossNodes is the attack on a group's budget:
// two keys without budgets of their own, on two relays of a fleet, send 50
// requests together; the group's $1 holds them all.
func TestFleetGroupBudgetHoldsAcrossNodes(t *testing.T) {
	const other = "sk-fleet-other-0123456789abcdef"
	cfg := fleetConfig{group: "\t\t\tbudget 1usd/day\n", extra: "\t\tkey " + other + " fleet {\n\t\t\tname app2\n\t\t}\n"}
	fleetBudgetAttack(t, cfg, "group:fleet", []string{fleetKey, other}, func(t *testing.T, n *fleetNode) (float64, float64) {
		return n.metric(t, `relay_spend_usd{channel="",group="fleet",key="",period="day",scope="group"}`), 0
	})
}

// fleetBudgetAttack sends 50 messages at once, over two relays of a fleet
// of cfg and with keys in turn, against the $1 daily budget of the spend
// account id; row reads a node's view of what the account spent and
// holds.
func fleetBudgetAttack(t *testing.T, cfg fleetConfig, id string, keys []string, row func(*testing.T, *fleetNode) (spent, held float64)) {
	srv := redistest.Start(t)
	probe := &concurrencyProbe{release: make(chan struct{})}
	up := fakeupstream.New(t, probe)
	// a Redis that answers: past its timeout a relay holds on its own
	// (on_error local), which a loaded machine running -race may reach
	// at the default 50ms
	cfg.redisAddr, cfg.prefix, cfg.channels, cfg.storage = srv.Addr, "holds:", []string{"up=" + up.URL}, "\t\t\ttimeout 2s\n"
	cfg.extra += "\t\tpricing {\n\t\t\tclaude-sonnet-4-5 input 100 output 10000\n\t\t}\n"
	nodes := startFleet(t, 2, cfg)

	// what fleetNode.attempt sends
	hold := holdOf(`{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`, 8)
	inFlight := int(1 / hold)
	var answered sync.WaitGroup
	answered.Add(1)
	var statuses []int
	var bodies []string
	var errs []error
	go func() {
		defer answered.Done()
		statuses, bodies, errs = fire(50, func(i int) (int, string, error) { return nodes[i%2].attempt(keys[i/2%len(keys)]) })
	}()
	within(t, "the holds that fit at the upstream, the others queued on both nodes", 10*time.Second, func() bool {
		return probe.held.Load() > int64(inFlight) || // past the budget already: judged below
			probe.held.Load() == int64(inFlight) && nodes[0].metric(t, "relay_queue_depth{")+nodes[1].metric(t, "relay_queue_depth{") == float64(50-inFlight)
	})
	released := time.Now()
	close(probe.release)
	answered.Wait()
	t.Logf("answered %v after the upstream answered", time.Since(released))

	served := judgeAttack(t, statuses, bodies, errs)
	tag := "holds:{s:" + id + "}:"
	day := tag + "day:" + time.Now().UTC().Format("20060102")
	var spent int64
	within(t, "the fleet's spend synced, and no hold left in Redis", 5*time.Second, func() bool {
		held, _ := srv.Command("GET", tag+"held")
		v, _ := srv.Command("GET", day)
		spent, _ = strconv.ParseInt(v, 10, 64)
		return (held == "0" || held == "$-1") && spent == int64(served)*int64(math.Round(fakeAnswerCost*1e9))
	})
	t.Logf("%d of 50 served over two relays, %d at the upstream at once, $%.4f spent of $1", served, probe.most.Load(), float64(spent)/1e9)
	if spent > 1e9 {
		t.Errorf("the fleet spent $%v of its $1 budget", float64(spent)/1e9)
	}
	if want := int((1-hold)/fakeAnswerCost) + 1; served != want {
		t.Errorf("%d served, want %d", served, want)
	}
	if probe.most.Load() != int64(inFlight) || up.Hits() != served {
		t.Errorf("at most %d at the upstream at once (want %d), %d reached it (want %d); the relays' storage errors: %v and %v", probe.most.Load(), inFlight, up.Hits(), served,
			nodes[0].metric(t, "relay_storage_errors_total{"), nodes[1].metric(t, "relay_storage_errors_total{"))
	}
	for _, n := range nodes {
		within(t, "node "+n.site+" syncs the fleet's spend", 5*time.Second, func() bool {
			s, held := row(t, n)
			return math.Abs(s-float64(spent)/1e9) < 1e-9 && held == 0
		})
	}
}

// TestABatchOverTheBudgetIsNeverSent sends a batch of 500 requests whose
// worst case is far over the key's $1 budget: refused, and the upstream
// never sees it. A batch that fits holds its worst case, through a crash
// of its relay, until its results are read: then it costs what they cost.
func TestABatchOverTheBudgetIsNeverSent(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the caddy binary")
	}
	store := fakeupstream.NewStore("hold")
	up := fakeupstream.New(t, store)
	storage := t.TempDir()
	site, admin := freePort(t), freePort(t)
	config := filepath.Join(t.TempDir(), "Caddyfile")
	src := fmt.Sprintf(`{
	admin %s
	storage file_system %s
}
http://%s {
	relay {
		pricing {
			m-hold input 100 output 10000
		}
		key sk-hold-batch-0123456789abcdef batch {
			name batcher
			budget 1usd/day
		}
		channel up {
			url %s
			api_key sk-ant-api03-fake-upstream-key
		}
		group batch {
			channels up
		}
	}
}
`, admin, storage, site, up.URL)
	if err := os.WriteFile(config, []byte(src), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := runCaddy(t, caddyBin, config)
	const key = "sk-hold-batch-0123456789abcdef"
	batch := func(n, maxTokens int) (string, float64) {
		reqs, worst := make([]string, n), 0.0
		for i := range reqs {
			params := fmt.Sprintf(`{"model":"m-hold","max_tokens":%d,"messages":[{"role":"user","content":"question %d"}]}`, maxTokens, i)
			reqs[i] = fmt.Sprintf(`{"custom_id":"r%d","params":%s}`, i, params)
			worst += holdOf(params, maxTokens) * 0.5 // the batch price
		}
		return `{"requests":[` + strings.Join(reqs, ",") + `]}`, worst
	}

	big, worst := batch(500, 1024)
	status, b := callSite(t, site, key, http.MethodPost, "/v1/messages/batches", "application/json", strings.NewReader(big))
	if status != 429 || !strings.Contains(string(b), `"code":"budget_exceeded"`) {
		t.Fatalf("a batch that may cost $%.2f on a $1 budget: %d %s", worst, status, b)
	}
	if store.Batches() != 0 || up.Hits() != 0 {
		t.Fatalf("the upstream saw %d requests and made %d batches of a refused batch", up.Hits(), store.Batches())
	}

	small, worst := batch(2, 10)
	status, b = callSite(t, site, key, http.MethodPost, "/v1/messages/batches", "application/json", strings.NewReader(small))
	var made struct{ ID string }
	if err := json.Unmarshal(b, &made); status != 200 || err != nil {
		t.Fatalf("a batch that fits: %d %s", status, b)
	}
	if _, held := keyRow(t, admin, "batcher"); math.Abs(held-worst) > 1e-6 {
		t.Fatalf("held_usd %v after the batch, want its worst case %v", held, worst)
	}
	// the hold is in Caddy's storage within moments; the relay crashes
	within(t, "the batch's hold written", 5*time.Second, func() bool {
		stored, _ := os.ReadFile(filepath.Join(storage, "relay", "spend.json"))
		return strings.Contains(string(stored), `"batch:`)
	})
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	runCaddy(t, caddyBin, config)
	if _, held := keyRow(t, admin, "batcher"); math.Abs(held-worst) > 1e-6 {
		t.Fatalf("held_usd %v after a crash, want the batch's %v", held, worst)
	}
	// its results: 10 input and 5 output tokens each, at the batch price
	if status, b := callSite(t, site, key, http.MethodGet, "/v1/messages/batches/"+made.ID+"/results", "", nil); status != 200 || !strings.Contains(string(b), `"custom_id":"r1"`) {
		t.Fatalf("results: %d %s", status, b)
	}
	spend, held := keyRow(t, admin, "batcher")
	if want := 2 * fakeAnswerCost * 0.5; held != 0 || math.Abs(spend-want) > 1e-9 {
		t.Fatalf("after the results: spent %v, held %v; want %v spent, nothing held", spend, held, want)
	}
}

// TestFleetBatchesHoldAChannelsCapAcrossNodes makes 30 batches at once
// over two relays of a fleet, through a channel whose spend cap ($0.05 a
// day) takes one of them ($0.04): the cap's holds are in Redis, so one
// batch is made in the whole fleet and the others are refused naming the
// cap, where each create used to see room for itself alone.
func TestFleetBatchesHoldAChannelsCapAcrossNodes(t *testing.T) {
	srv := redistest.Start(t)
	store := fakeupstream.NewStore("capfleet")
	up := fakeupstream.New(t, store)
	cfg := fleetConfig{redisAddr: srv.Addr, prefix: "capbatch:", channels: []string{"up=" + up.URL},
		channel: "\t\t\tspend_cap 0.05usd/day\n", storage: "\t\t\ttimeout 2s\n",
		extra: "\t\tpricing {\n\t\t\tm-hold input 0 output 10000\n\t\t}\n"}
	nodes := startFleet(t, 2, cfg)
	// two requests of up to 4 output tokens at $0.005 (the batch price)
	params := `{"model":"m-hold","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`
	batch := `{"requests":[{"custom_id":"r0","params":` + params + `},{"custom_id":"r1","params":` + params + `}]}`
	statuses, bodies, errs := fire(30, func(i int) (int, string, error) {
		return nodes[i%2].postAs(fleetKey, "/v1/messages/batches", batch)
	})
	made := 0
	for i, s := range statuses {
		switch {
		case errs[i] != nil:
			t.Errorf("create %d: %v", i, errs[i])
		case s == 200:
			made++
		case s != 503 || !strings.Contains(bodies[i], "spend_cap"):
			t.Errorf("create %d: %d %s; want 200, or 503 naming the spend_cap", i, s, bodies[i])
		}
	}
	t.Logf("figure: 30 batch creates over two relays on a $0.05 cap: %d made (upstream: %d)", made, store.Batches())
	if made != 1 || store.Batches() != 1 {
		t.Errorf("%d batches made (the upstream made %d) on a $0.05 cap at $0.04 each, want 1", made, store.Batches())
	}
}

// TestBudgetsThatMeetUnpricedModelsAreWarnedOfAtLoad validates a config
// whose budgeted key's group has a channel that serves any model: the
// built binary, loading it, warns with the group, the budget and the
// channel; the same config with a models line on the channel does not.
func TestBudgetsThatMeetUnpricedModelsAreWarnedOfAtLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the caddy binary")
	}
	config := func(models string) string {
		path := filepath.Join(t.TempDir(), "Caddyfile")
		src := `http://localhost:9 {
	relay {
		key sk-unpriced-warning-0123456789 team {
			name teamkey
			budget 1usd/day
		}
		channel open {
			url http://127.0.0.1:9
			api_key {env.UNPRICED_WARNING_KEY}
` + models + `		}
		group team {
			channels open
		}
	}
}
`
		if err := os.WriteFile(path, []byte(src), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	validate := func(path string) string {
		cmd := exec.Command(caddyBin, "validate", "--config", path)
		cmd.Env = append(os.Environ(), "UNPRICED_WARNING_KEY=sk-ant-api03-fake-upstream-key")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("caddy validate: %v\n%s", err, out)
		}
		return string(out)
	}
	out := validate(config(""))
	var warned string
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "budgets meet models without a price") {
			warned = line
		}
	}
	if warned == "" || !strings.Contains(warned, `"group":"team"`) || !strings.Contains(warned, `key \"teamkey\"`) || !strings.Contains(warned, `"channels_serving_every_model":["open"]`) {
		t.Errorf("the load's warning: %q\nin:\n%s", warned, out)
	}
	if out := validate(config("\t\t\tmodels claude-sonnet-4-5\n")); strings.Contains(out, "without a price") {
		t.Errorf("a channel of priced models was warned of:\n%s", out)
	}
}
