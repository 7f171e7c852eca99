package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/money"
	"github.com/caddyserver/caddy/v2"
	"go.yaml.in/yaml/v3"
)

func TestBudgetDegradeAdapts(t *testing.T) {
	out, err := adaptCaddyfile(`:8080 {
	relay {
		key sk-degrade-adapt-0123456789 g {
			budget 10usd/day
			budget_degrade 80% cheaper
			budget_degrade 95 model claude-haiku-4-5
		}
		channel a {
			api_key {env.A}
		}
		group g {
			channels a
			budget 100usd/month
			budget_degrade 90.5% model claude-haiku-4-5
		}
	}
}
`)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	h := findHandler(cfg, "relay")
	b, _ := json.Marshal(h)
	var r Relay
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	if got, want := show(r.Keys[0].BudgetDegrade), `[{"percent":80,"mode":"cheaper"},{"percent":95,"mode":"model","model":"claude-haiku-4-5"}]`; got != want {
		t.Errorf("the key's budget_degrade adapts to %s, want %s", got, want)
	}
	if got, want := show(r.Groups[0].BudgetDegrade), `[{"percent":90.5,"mode":"model","model":"claude-haiku-4-5"}]`; got != want {
		t.Errorf("the group's budget_degrade adapts to %s, want %s", got, want)
	}
	if err := r.validateConfig(); err != nil {
		t.Errorf("the adapted config does not validate: %v", err)
	}
}

func TestBudgetDegradeErrorsSayWhatIsWrong(t *testing.T) {
	base := func(key, group string) string {
		return "relay {\n\tkey sk-client-secret-0123456789 prod {\n\t\tbudget 10usd/day\n" + key + "\t}\n" +
			"\tchannel a {\n\t\tapi_key {env.A}\n\t}\n\tgroup prod {\n\t\tchannels a\n" + group + "\t}\n}\n"
	}
	for _, c := range []struct {
		name, src, says string
	}{
		{"an unknown mode", base("\t\tbudget_degrade 80% cheapest # here\n", ""), `mode must be cheaper or model <id>, not "cheapest"`},
		{"no mode", base("\t\tbudget_degrade 80% # here\n", ""), "takes a percent and a mode"},
		{"a percent that is no number", base("\t\tbudget_degrade eighty cheaper # here\n", ""), `"eighty" is not a percent`},
		{"100%", base("\t\tbudget_degrade 100% cheaper # here\n", ""), "above 0 and below 100"},
		{"0%", base("", "\t\tbudget_degrade 0 cheaper # here\n"), "above 0 and below 100"},
		{"a model step without its model", base("\t\tbudget_degrade 95% model # here\n", ""), "takes one model"},
		{"cheaper with a model", base("\t\tbudget_degrade 95% cheaper claude-haiku-4-5 # here\n", ""), "cheaper takes nothing more"},
		{"cheaper twice", base("\t\tbudget_degrade 80% cheaper\n\t\tbudget_degrade 90% cheaper # here\n", ""), "cheaper is given twice"},
		{"two models at one share", base("", "\t\tbudget_degrade 90% model m-one\n\t\tbudget_degrade 90% model m-two # here\n"), "two models at 90% (m-one and m-two)"},
	} {
		wantErrorAtMarkedLine(t, c.name, c.src)
		if _, err := parseRelay(t, strings.ReplaceAll(c.src, " # here", "")); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.says)
		}
	}
	// JSON that the Caddyfile would not write: a model given to cheaper,
	// an unknown mode
	for _, c := range []struct {
		step BudgetDegrade
		says string
	}{
		{BudgetDegrade{Percent: 50, Mode: "cheaper", Model: "m"}, "mode cheaper takes no model"},
		{BudgetDegrade{Percent: 50, Mode: "Cheaper"}, `not "Cheaper"`},
		{BudgetDegrade{Percent: 50, Mode: "model", Model: "a model"}, `not "a model"`},
	} {
		if err := checkDegrade([]BudgetDegrade{c.step}); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%+v: %v, want an error saying %q", c.step, err, c.says)
		}
	}
}

// TestBudgetDegradeNeedsWhatItNames: a model step's model must be served
// by the group, and a key's steps need a budget to reach, its own or its
// group's.
func TestBudgetDegradeNeedsWhatItNames(t *testing.T) {
	provision := func(key *Key, group *Group) error {
		ch := &Channel{Name: "degrade-needs-ch", Models: []string{"m-served"}, UpstreamRaw: upstream("anthropic", "url", "http://127.0.0.1:1", "api_key", channelKey)}
		group.Name, group.Channels, key.Group = "degrade-needs", []string{ch.Name}, "degrade-needs"
		r := &Relay{Keys: []*Key{key}, Channels: []*Channel{ch}, Groups: []*Group{group}}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		err := r.Provision(ctx)
		_ = r.Cleanup()
		return err
	}
	model := func(m string) []BudgetDegrade { return []BudgetDegrade{{Percent: 90, Mode: "model", Model: m}} }
	for _, c := range []struct {
		name  string
		key   KeyOptions
		group Group
		says  string // "": it loads
	}{
		{"a key's model no channel serves", KeyOptions{Name: "dn-1", Budgets: []string{"1usd/day"}, BudgetDegrade: model("m-nowhere")},
			Group{}, `key "dn-1": budget_degrade 90% model m-nowhere: no channel of group "degrade-needs" serves m-nowhere`},
		{"a group's model no channel serves", KeyOptions{Name: "dn-2"}, Group{BudgetDegrade: model("m-nowhere")},
			`group "degrade-needs": budget_degrade 90% model m-nowhere: no channel`},
		{"a key's steps without a budget", KeyOptions{Name: "dn-3", BudgetDegrade: model("m-served")}, Group{},
			"budget_degrade needs a budget to degrade by"},
		{"a key's steps on its group's budget", KeyOptions{Name: "dn-4", BudgetDegrade: model("m-served")}, Group{Budgets: []string{"5usd/day"}}, ""},
		{"a group's steps on its keys' budgets", KeyOptions{Name: "dn-5", Budgets: []string{"1usd/day"}}, Group{BudgetDegrade: model("m-served")}, ""},
	} {
		err := provision(&Key{Secret: "sk-degrade-needs-0123456789abcdef", KeyOptions: c.key}, &c.group)
		switch {
		case c.says == "" && err != nil:
			t.Errorf("%s: %v, want it to load", c.name, err)
		case c.says != "" && (err == nil || !strings.Contains(err.Error(), c.says)):
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.says)
		}
	}
}

func TestRemainingIsAPlainExactDecimal(t *testing.T) {
	for n, want := range map[money.NanoUSD]string{
		0: "0", 1: "0.000000001", 5e8: "0.5", 12e9: "12", 4_800_000_000: "4.8", 2_980_000_000: "2.98",
		123_456_789_012: "123.456789012", money.ToNano(0.1) + money.ToNano(0.2): "0.3", -25e7: "-0.25",
	} {
		if got := formatUSD(n); got != want {
			t.Errorf("formatUSD(%d) = %q, want %q", n, got, want)
		}
	}
}

func TestTheTightestBudgetIsTheOneWithTheLeastLeft(t *testing.T) {
	day := money.Room{Known: true, Period: money.PeriodDay, Limit: 10e9, Spent: 9e9}             // $1 left, 90%
	month := money.Room{Known: true, Period: money.PeriodMonth, Limit: 1000e9, Spent: 500e9}     // $500 left, 50%
	group := money.Room{Known: true, Period: money.PeriodDay, Limit: 2e9, Spent: 5e8, Held: 5e8} // $1 left, 50%
	if !day.Tighter(month) || month.Tighter(day) {
		t.Error("$1 left is tighter than $500")
	}
	if !day.Tighter(group) || group.Tighter(day) {
		t.Error("with as much left, the more used budget is the tighter")
	}
	if !month.Tighter(money.Room{}) || (money.Room{}).Tighter(month) {
		t.Error("a budget is tighter than none")
	}
	if p := group.Percent(); p != 50 || group.Left() != 1e9 {
		t.Errorf("spent $0.50 and held $0.50 of $2: %v%% used, %d left", p, group.Left())
	}
	over := money.Room{Known: true, Limit: 1e9, Spent: 9e8, Held: 5e8}
	if over.Left() != 0 || over.Percent() != 140 {
		t.Errorf("held past the budget: %d left, %v%%; want 0 and 140", over.Left(), over.Percent())
	}
	spent := money.Room{Known: true, Limit: 1e9, Spent: 1e9}
	if !spent.Tighter(over) || over.Tighter(spent) {
		t.Error("with nothing left in either, the spent budget is the tighter, however much the other holds")
	}
}

func TestDegradeStepsAreOrderedByShare(t *testing.T) {
	rules := degradeRules([]BudgetDegrade{{Percent: 95, Mode: "model", Model: "m-small"}, {Percent: 80, Mode: "cheaper"}, {Percent: 90, Mode: "model", Model: "m-mid"}})
	if len(rules) != 3 || rules[0] != (degradeRule{percent: 80}) || rules[1].model != "m-mid" || rules[2].model != "m-small" {
		t.Errorf("rules %+v", rules)
	}
	if degradeRules(nil) != nil {
		t.Error("no steps: a nil list")
	}
}

func TestCheapestKeepsTheLowestPriceFactor(t *testing.T) {
	a, b, c := &channel{name: "a", priceFactor: 1}, &channel{name: "b", priceFactor: 0.5}, &channel{name: "c", priceFactor: 0.5}
	got := cheapest([]*channel{a, b, c})
	if len(got) != 2 || got[0] != b || got[1] != c {
		t.Errorf("cheapest = %v", got)
	}
	if got := cheapest([]*channel{a}); len(got) != 1 || got[0] != a {
		t.Errorf("one channel: %v", got)
	}
}

// BenchmarkBudgetHeader is x-relay-budget-remaining-usd on one answer:
// budgeted, a key with a daily and a monthly budget (its tightest found
// and written); plain, a key without a budget, which pays nothing.
func BenchmarkBudgetHeader(b *testing.B) {
	r := benchRelay(b)
	keys := make(map[string]*key, 2)
	for _, k := range r.keys {
		r.activate(k)
		keys[k.name] = k
	}
	budgeted, plain := keys["bench-k0"], keys["bench-k1"]
	budgeted.state.spend.Configure([money.NumPeriods]float64{money.PeriodDay: 10, money.PeriodMonth: 100}, 0, budgeted.name, discardLogger(), nil)
	run := func(k *key, want bool) func(*testing.B) {
		return func(b *testing.B) {
			in := &inbound{route: routeMessages, who: requester{key: k, state: k.state}}
			h := http.Header{}
			b.ReportAllocs()
			for b.Loop() {
				delete(h, headerBudgetRemaining)
				in.budgetHeader(h)
			}
			if (h.Get(headerBudgetRemaining) != "") != want {
				b.Fatalf("header %q, want one: %v", h.Get(headerBudgetRemaining), want)
			}
		}
	}
	b.Run("budgeted", run(budgeted, true))
	b.Run("plain", run(plain, false))
}

// BenchmarkDegrade is the budget_degrade step of one message of a key
// whose budget is 90% spent, with a cheaper and a model step: its tightest
// budget found, both steps applied (the model's cost compared with the
// one asked), the metric counted.
func BenchmarkDegrade(b *testing.B) {
	r := benchRelay(b)
	var k *key
	for _, kk := range r.keys {
		if kk.name == "bench-k0" {
			k = kk
		}
	}
	r.activate(k)
	k.state.spend.Configure([money.NumPeriods]float64{money.PeriodDay: 1e9}, 0, k.name, discardLogger(), nil)
	k.state.spend.Charge(r.now(), 9, discardLogger())
	spent, _ := k.state.spend.Spent(r.now()) // with what earlier benchmarks spent
	k.state.spend.Configure([money.NumPeriods]float64{money.PeriodDay: spent[money.PeriodDay] / 0.9}, 0, k.name, discardLogger(), nil)
	k.degrade = degradeRules([]BudgetDegrade{{Percent: 80, Mode: "cheaper"}, {Percent: 85, Mode: "model", Model: "claude-haiku-4-5"}})
	in := &inbound{route: routeMessages, who: requester{key: k, state: k.state}, ask: asked{model: "claude-sonnet-4-5", estimate: 100, maxOut: 1024}}
	b.ReportAllocs()
	for b.Loop() {
		in.grant = granted{target: in.ask.model}
		r.degrade(in)
	}
	if !in.grant.degrade.cheaper || in.grant.target != "claude-haiku-4-5" {
		b.Fatalf("not degraded: %+v", in.grant.degrade)
	}
}

// TestDegradeAlertOnSeries runs the degrade alert of the rules file in
// promtool: a group whose messages are served degraded for more than 15
// minutes on end is told of; one degraded once is not.
func TestDegradeAlertOnSeries(t *testing.T) {
	promtool := needTool(t, "promtool", "apt-get install -y prometheus")
	rules, err := filepath.Abs("examples/prometheus/relay-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	test := fmt.Sprintf(`rule_files: [%q]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'relay_degraded_total{group="steady",mode="model"}'
        values: '0+2x40'
      - series: 'relay_degraded_total{group="once",mode="cheaper"}'
        values: '0 1x40'
    alert_rule_test:
      - eval_time: 10m
        alertname: RelayBudgetDegrading
        exp_alerts: []
      - eval_time: 30m
        alertname: RelayBudgetDegrading
        exp_alerts:
          - exp_labels:
              severity: info
              group: steady
              mode: model
            exp_annotations:
              summary: "Group steady serves messages degraded (model)"
              description: %q
`, rules, alertDescription(t, rules, "RelayBudgetDegrading"))
	path := filepath.Join(t.TempDir(), "degrade.test.yml")
	if err := os.WriteFile(path, []byte(test), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "test", "rules", path).CombinedOutput(); err != nil {
		t.Errorf("promtool test rules: %v\n%s", err, out)
	}
}

// alertDescription reads the description annotation of an alert of a
// rules file.
func alertDescription(t *testing.T, rules, alert string) string {
	t.Helper()
	var file struct {
		Groups []struct {
			Rules []struct {
				Alert       string
				Annotations map[string]string
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	b, err := os.ReadFile(rules)
	if err == nil {
		err = yaml.Unmarshal(b, &file)
	}
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			if r.Alert == alert {
				return r.Annotations["description"]
			}
		}
	}
	t.Fatalf("no alert %s in %s", alert, rules)
	return ""
}
