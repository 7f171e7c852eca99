package relay

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"
)

func TestMetricsAfterAScriptedMix(t *testing.T) {
	u := fakeupstream.Usage{InputTokens: 10, OutputTokens: 20, CacheReadInputTokens: 30, CacheCreationInputTokens: 40}
	bad := fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")))
	ok := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(mustRead(r), `"stream":true`) {
			fakeupstream.Stream(fakeupstream.StreamEvents("claude-sonnet-4-5", u, "hi")...)(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("claude-sonnet-4-5", "hi", fakeupstream.Usage{InputTokens: 1, OutputTokens: 2}))
	}))
	startRelay(t, channelBlock("mx-bad", bad.URL, "priority 1", "models claude-sonnet-4-5")+
		channelBlock("mx-ok", ok.URL, "priority 2", "models claude-sonnet-4-5")+
		"\t\tkey "+clientKey+" mx {\n\t\t\tname mx-key\n\t\t}\n\t\tgroup mx {\n\t\t\tchannels mx-bad mx-ok\n\t\t}\n")

	message(t, streamBody)                           // fails over from mx-bad to mx-ok
	message(t, simpleBody)                           // mx-bad is cooling: straight to mx-ok
	message(t, `{"model":"claude-3-opus"}`)          // no channel serves it
	send(t, "POST", "/v1/messages", "sk-nope", "{}") // refused

	mf, _ := scrape(t)
	sonnet := "model=claude-sonnet-4-5"
	wantCost := ((10+1)*3 + (20+2)*15 + 30*0.3 + 40*3.75) / 1e6
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"relay_requests_total", []string{"group=mx", "channel=mx-ok", sonnet, "code=200", "cause=ok"}, 2},
		{"relay_requests_total", []string{"group=mx", "channel=none", "model=other", "code=503", "cause=client"}, 1},   // a typo
		{"relay_requests_total", []string{"group=none", "channel=none", "model=none", "code=401", "cause=client"}, -2}, // shared across tests: checked below
		{"relay_attempts_total", []string{"channel=mx-bad", "outcome=transient"}, 1},
		{"relay_attempts_total", []string{"channel=mx-ok", "outcome=success"}, 2},
		{"relay_failovers_total", []string{"group=mx"}, 1},
		{"relay_tokens_total", []string{"group=mx", "channel=mx-ok", sonnet, "kind=input"}, 11},
		{"relay_tokens_total", []string{"group=mx", "channel=mx-ok", sonnet, "kind=output"}, 22},
		{"relay_tokens_total", []string{"group=mx", "channel=mx-ok", sonnet, "kind=cache_read"}, 30},
		{"relay_tokens_total", []string{"group=mx", "channel=mx-ok", sonnet, "kind=cache_write"}, 40},
		{"relay_cost_usd_total", []string{"group=mx", "channel=mx-ok", sonnet}, wantCost},
		{"relay_cost_usd_total", []string{"group=mx", "channel=mx-bad", sonnet}, -1}, // it answered nothing
		{"relay_request_duration_seconds", []string{"group=mx", sonnet}, 2},
		{"relay_upstream_first_byte_seconds", []string{"channel=mx-ok"}, 2},
		{"relay_upstream_first_byte_seconds", []string{"channel=mx-bad"}, 1},
		{"relay_channel_state", []string{"channel=mx-bad", "state=cooldown"}, 1},
		{"relay_channel_state", []string{"channel=mx-bad", "state=healthy"}, 0},
		{"relay_channel_state", []string{"channel=mx-ok", "state=healthy"}, 1},
		{"relay_inflight", []string{"channel=mx-ok"}, 0},
		{"relay_group_live_channels", []string{"group=mx"}, 1},
	} {
		got := value(mf, c.name, c.labels...)
		if c.want == -2 {
			if got < 1 {
				t.Errorf("%s%v = %v, want at least 1", c.name, c.labels, got)
			}
			continue
		}
		if math.Abs(got-c.want) > 1e-12 {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

func TestMetricsKeepMovingAfterAReload(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	cfg := func(weight int) string {
		return channelBlock("mreload-a", up.URL, fmt.Sprintf("weight %d", weight)) + keyAndGroup("mreload", "mreload-a")
	}
	startRelay(t, cfg(1))
	message(t, simpleBody)
	mf, _ := scrape(t)
	before := value(mf, "relay_requests_total", "group=mreload", "code=200")
	if before != 1 {
		t.Fatalf("before the reload: %v", before)
	}
	startRelay(t, cfg(2)) // POST /load: a new metrics registry
	message(t, simpleBody)
	mf, _ = scrape(t)
	if after := value(mf, "relay_requests_total", "group=mreload", "code=200"); after != 2 {
		t.Errorf("after the reload the counter is %v, want 2", after)
	}
	if v := value(mf, "relay_channel_state", "channel=mreload-a", "state=healthy"); v != 1 {
		t.Errorf("channel state after reload: %v", v)
	}
}

// TestNoSecretInLogsOrMetrics runs traffic with every kind of secret
// configured (a client key, an upstream key from the environment) and a
// Caddy log at DEBUG level plus an access log with the filter the docs
// prescribe, then scans all of it and /metrics.
func TestNoSecretInLogsOrMetrics(t *testing.T) {
	const upstreamKey = "sk-ant-scan-upstream-secret-7f3a"
	const scanClientKey = "sk-relay-scan-client-secret-91bc"
	t.Setenv("RELAY_SCAN_UPSTREAM_KEY", upstreamKey)
	dir := t.TempDir()
	caddyLog, accessLog := filepath.Join(dir, "caddy.log"), filepath.Join(dir, "access.log")
	ok := fakeupstream.New(t, fakeupstream.Stream(fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 1, OutputTokens: 1}, "x")...), fakeupstream.AcceptKeys(upstreamKey))
	bad := fakeupstream.New(t, fakeupstream.Error(401, "authentication_error", "invalid x-api-key"), fakeupstream.AcceptKeys(upstreamKey))

	tester := caddytest.NewTester(t)
	tester.InitServer(`{
	admin localhost:2999
	http_port 9080
	https_port 9443
	skip_install_trust
	grace_period 1ns
	log {
		output file `+caddyLog+`
		level DEBUG
	}
}
http://localhost:9080 {
	log {
		output file `+accessLog+`
		format filter {
			request>headers>X-Api-Key delete
		}
	}
	relay {
		key `+scanClientKey+` scan
		channel scan-bad {
			url `+bad.URL+`
			api_key {env.RELAY_SCAN_UPSTREAM_KEY}
			priority 1
		}
		channel scan-ok {
			url `+ok.URL+`
			api_key {env.RELAY_SCAN_UPSTREAM_KEY}
			priority 2
		}
		group scan {
			channels scan-bad scan-ok
		}
	}
}
`, "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	send(t, "POST", "/v1/messages", scanClientKey, streamBody)
	send(t, "POST", "/v1/messages", "", simpleBody, "Authorization", "Bearer "+scanClientKey)
	send(t, "POST", "/v1/messages", scanClientKey+"-typo", simpleBody)
	send(t, "GET", "/v1/models", scanClientKey, "")
	if ok.Hits() < 2 || bad.Hits() < 1 {
		t.Fatalf("traffic did not flow: ok %d bad %d", ok.Hits(), bad.Hits())
	}
	_, metrics := scrape(t)

	var all strings.Builder
	for _, f := range []string{caddyLog, accessLog} {
		b, err := os.ReadFile(f)
		if err != nil || len(b) == 0 {
			t.Fatalf("log %s is empty: %v", f, err)
		}
		all.Write(b)
	}
	logs := all.String()
	if !strings.Contains(logs, `"msg":"relayed request"`) || !strings.Contains(logs, `"channel":"scan-bad"`) {
		t.Fatalf("the relay's own log lines are missing from the scan")
	}
	for _, secret := range []string{upstreamKey, scanClientKey} {
		if strings.Contains(logs, secret) {
			t.Errorf("a log line carries the secret %q", secret)
		}
		if strings.Contains(metrics, secret) {
			t.Errorf("/metrics carries the secret %q", secret)
		}
	}
	// every relay label value is a bounded, configured name
	for _, m := range regexp.MustCompile(`relay_[a-z_]+\{[^}]*\}`).FindAllString(metrics, -1) {
		if strings.Contains(m, "sk-") {
			t.Errorf("label carries a key: %s", m)
		}
	}
	if strings.Contains(logs, "request>headers>X-Api-Key delete") {
		t.Errorf("the access log deletes X-Api-Key, yet the relay warned that it does not")
	}
}

// TestAnUnfilteredAccessLogShowsTheKey is why the docs prescribe the filter
// and the relay warns: Caddy logs each request's headers as they arrived,
// before any handler runs, and X-Api-Key is not one it redacts.
func TestAnUnfilteredAccessLogShowsTheKey(t *testing.T) {
	const key = "sk-relay-unfiltered-secret-7c2d"
	accessLog := filepath.Join(t.TempDir(), "access.log")
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelayWith(t, "\tlog {\n\t\toutput file "+accessLog+"\n\t}\n",
		"\t\tkey "+key+" unfiltered\n"+channelBlock("unfiltered-ch", up.URL)+"\t\tgroup unfiltered {\n\t\t\tchannels unfiltered-ch\n\t\t}\n")
	send(t, "POST", "/v1/messages", key, simpleBody)
	b, err := os.ReadFile(accessLog)
	if err != nil || len(b) == 0 {
		t.Fatalf("no access log: %v", err)
	}
	if !strings.Contains(string(b), key) {
		t.Errorf("Caddy no longer logs X-Api-Key in clear; the access log warning and the docs can go:\n%s", b)
	}
}

// TestDashboardAndRulesQueryExistingMetrics checks that every relay metric
// the Grafana dashboard and the Prometheus rules use is one the relay
// exports.
func TestDashboardAndRulesQueryExistingMetrics(t *testing.T) {
	exported := map[string]bool{}
	descs := make(chan *prometheus.Desc, 64)
	for _, c := range append(append(collectors[:len(collectors):len(collectors)], fleet.Collectors()...), ledgerCollectors...) {
		c.Describe(descs)
	}
	close(descs)
	for d := range descs {
		if m := regexp.MustCompile(`fqName: "([^"]+)"`).FindStringSubmatch(d.String()); m != nil {
			exported[m[1]] = true
		}
	}
	if !exported["relay_requests_total"] || !exported["relay_channel_state"] {
		t.Fatalf("could not read the exported names: %v", exported)
	}
	files, _ := filepath.Glob("examples/grafana/*.json")
	rules, _ := filepath.Glob("examples/prometheus/*.yml")
	if len(files) == 0 || len(rules) == 0 {
		t.Fatalf("dashboard %v, rules %v", files, rules)
	}
	used := map[string]bool{}
	for _, f := range append(files, rules...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		// recording rules (relay_channel:cache_read_ratio:rate5m) are not metrics of the relay
		for _, m := range regexp.MustCompile(`\brelay_[a-z_]+\b(:?)`).FindAllString(string(b), -1) {
			if strings.HasSuffix(m, ":") {
				continue
			}
			used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m, "_bucket"), "_sum"), "_count")] = true
		}
	}
	var missing []string
	for m := range used {
		if !exported[m] {
			missing = append(missing, m)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("queried but not exported: %v", missing)
	}
	for _, must := range []string{"relay_requests_total", "relay_failovers_total", "relay_channel_state", "relay_request_duration_seconds",
		"relay_upstream_first_byte_seconds", "relay_tokens_total", "relay_cost_usd_total", "relay_group_live_channels"} {
		if !used[must] {
			t.Errorf("the dashboard and rules never use %s", must)
		}
	}
}

func TestRulesFileIsWellFormed(t *testing.T) {
	b, err := os.ReadFile("examples/prometheus/relay-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Name  string `yaml:"name"`
			Rules []struct {
				Record string `yaml:"record"`
				Alert  string `yaml:"alert"`
				Expr   string `yaml:"expr"`
				For    string `yaml:"for"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(b, &rules); err != nil {
		t.Fatalf("rules are not YAML: %v", err)
	}
	alerts := map[string]string{}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" && r.Record == "" || r.Expr == "" {
				t.Errorf("incomplete rule %+v", r)
			}
			alerts[r.Alert] = r.For
		}
	}
	for _, a := range []string{"RelayChannelOpen", "RelayChannelClassCooling", "RelayGroupDown", "RelayFailoverRatioHigh", "RelayHigh5xxRatio", "RelayStorageDown", "RelayBudgetNearlySpent", "RelayBudgetExhausted", "RelayBudgetDegrading", "RelayLedgerDropping"} {
		if _, ok := alerts[a]; !ok {
			t.Errorf("alert %s is missing", a)
		}
	}
	if alerts["RelayChannelOpen"] != "5m" {
		t.Errorf("RelayChannelOpen should wait 5m, has %q", alerts["RelayChannelOpen"])
	}
	var dash struct {
		Panels []struct {
			Title string `json:"title"`
		} `json:"panels"`
	}
	b, _ = os.ReadFile("examples/grafana/relay-dashboard.json")
	if err := json.Unmarshal(b, &dash); err != nil || len(dash.Panels) < 10 {
		t.Fatalf("dashboard: %v, %d panels", err, len(dash.Panels))
	}
	titles := map[string]bool{}
	for _, p := range dash.Panels {
		titles[p.Title] = true
	}
	for _, want := range []string{"Budget spent by key and period", "Budget spent by group and period", "Spend cap used by channel and period", "Degraded messages by group and mode",
		"Cooling model classes by channel (seconds left)", "Thinking stripped by group"} {
		if !titles[want] {
			t.Errorf("the dashboard has no panel %q", want)
		}
	}
}

// TestDashboardLayout checks that the dashboard's panels have ids of their
// own and places on the 24-column grid that no other panel takes.
func TestDashboardLayout(t *testing.T) {
	var dash struct {
		Panels []struct {
			ID      int                      `json:"id"`
			Title   string                   `json:"title"`
			GridPos struct{ X, Y, W, H int } `json:"gridPos"`
		} `json:"panels"`
	}
	b, _ := os.ReadFile("examples/grafana/relay-dashboard.json")
	if err := json.Unmarshal(b, &dash); err != nil || len(dash.Panels) < 10 {
		t.Fatalf("dashboard: %v, %d panels", err, len(dash.Panels))
	}
	ids := map[int]string{}
	for i, p := range dash.Panels {
		if other, ok := ids[p.ID]; ok || p.ID == 0 {
			t.Errorf("panels %q and %q share the id %d", other, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.Y < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q is off the grid: %+v", p.Title, g)
		}
		for _, q := range dash.Panels[:i] {
			h := q.GridPos
			if g.X < h.X+h.W && h.X < g.X+g.W && g.Y < h.Y+h.H && h.Y < g.Y+g.H {
				t.Errorf("panels %q %+v and %q %+v overlap", q.Title, h, p.Title, g)
			}
		}
	}
}

// TestAlertRulesOnAScriptedMix runs a mix through the relay (a group whose
// clients send unknown models, a group whose upstream is down), feeds the
// counters it exported to promtool as series, and evaluates the shipped
// alert expressions on them: client typos must not page, an outage must.
func TestAlertRulesOnAScriptedMix(t *testing.T) {
	promtool := needTool(t, "promtool", "apt-get install -y prometheus")
	rules, err := filepath.Abs("examples/prometheus/relay-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "check", "rules", rules).CombinedOutput(); err != nil {
		t.Fatalf("promtool check rules: %v\n%s", err, out)
	}

	ok := fakeupstream.New(t, fakeupstream.Message("fine"))
	down := fakeupstream.New(t, fakeupstream.Error(500, "api_error", "down"))
	startRelay(t, channelBlock("alert-ok", ok.URL, "models claude-sonnet-5-5")+channelBlock("alert-down", down.URL)+
		"\t\tkey "+clientKey+" alert-typos\n\t\tkey sk-alert-down-0123456789 alert-outage\n"+
		"\t\tgroup alert-typos {\n\t\t\tchannels alert-ok\n\t\t}\n\t\tgroup alert-outage {\n\t\t\tchannels alert-down\n\t\t}\n")
	for i := 0; i < 10; i++ {
		message(t, `{"model":"claude-sonnet-5-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`)
		if r := message(t, `{"model":"claude-sonet-5-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`); r.status != 503 {
			t.Fatalf("a typo answered %d", r.status)
		}
		send(t, "POST", "/v1/messages", "sk-alert-down-0123456789", simpleBody)
	}

	// each series of the two groups grows by its scraped value every minute
	mf, _ := scrape(t)
	var series strings.Builder
	for _, m := range mf["relay_requests_total"].GetMetric() {
		labels := map[string]string{}
		var pairs []string
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
			pairs = append(pairs, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
		}
		if !strings.HasPrefix(labels["group"], "alert-") {
			continue
		}
		fmt.Fprintf(&series, "      - series: '%s{%s}'\n        values: '0+%gx20'\n",
			"relay_requests_total", strings.Join(pairs, ","), m.GetCounter().GetValue())
	}
	expr := alertExprs(t, rules)["RelayHigh5xxRatio"]
	if expr == "" {
		t.Fatal("no RelayHigh5xxRatio in the rules")
	}
	promtoolTest(t, promtool, rules, series.String(), fmt.Sprintf(`      - expr: %q
        eval_time: 10m
        exp_samples:
          - labels: '{group="alert-outage"}'
            value: 1
`, expr), "the alert expression on the scripted mix (the typos group must not appear, the outage must)")
}

// TestClassCoolingAlertOnSeries runs the class cooling alert of the rules
// file in promtool: a class that cools on for 20 minutes pages, one that
// cooled for 10 does not, nor does a channel whose classes take turns.
func TestClassCoolingAlertOnSeries(t *testing.T) {
	promtoolRulesTest(t, `rule_files: [%q]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'relay_channel_class_cooling{channel="a",class="opus"}'
        values: '0 300 240 180 120 60 300 240 180 120 60 300 240 180 120 60 300 240 180 120 60 300 240 180 120 60'
      - series: 'relay_channel_class_cooling{channel="a",class="sonnet"}'
        values: '0x25'
      - series: 'relay_channel_class_cooling{channel="b",class="opus"}'
        values: '0 300 240 180 120 60 300 240 180 120 60 0x15'
    alert_rule_test:
      - eval_time: 10m
        alertname: RelayChannelClassCooling
        exp_alerts: []
      - eval_time: 20m
        alertname: RelayChannelClassCooling
        exp_alerts:
          - exp_labels:
              severity: warning
              channel: a
              class: opus
            exp_annotations:
              summary: "Channel a: model class opus cooling for more than 15 minutes"
              description: "Its upstream keeps saying that the class's limit is spent or overloaded; the other channels serve that class meanwhile. GET /relay/channels shows the class's reason; raise the upstream's limit for the class or add a channel that serves it."
`)
}

// promtoolTest runs `promtool test rules` on the rules file with the input
// series and the expression tests given (YAML, indented as list items of
// input_series and promql_expr_test), failing with what on error.
func promtoolTest(t *testing.T, promtool, rules, series, exprTests, what string) {
	t.Helper()
	test := fmt.Sprintf(`rule_files: [%q]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
%s    promql_expr_test:
%s`, rules, series, exprTests)
	path := filepath.Join(t.TempDir(), "rules.test.yml")
	if err := os.WriteFile(path, []byte(test), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "test", "rules", path).CombinedOutput(); err != nil {
		t.Errorf("%s: %v\n%s\n%s", what, err, out, test)
	}
}

// alertExprs reads the expression of each alert of a rules file.
func alertExprs(t *testing.T, rules string) map[string]string {
	t.Helper()
	var file struct {
		Groups []struct {
			Rules []struct{ Alert, Expr string } `yaml:"rules"`
		} `yaml:"groups"`
	}
	b, err := os.ReadFile(rules)
	if err == nil {
		err = yaml.Unmarshal(b, &file)
	}
	if err != nil {
		t.Fatal(err)
	}
	exprs := map[string]string{}
	for _, g := range file.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				exprs[r.Alert] = strings.TrimSpace(r.Expr)
			}
		}
	}
	return exprs
}

// promtoolRulesTest runs promtool's rule tests in test, a promtool test
// file whose one %q is the rules file's path (examples/prometheus).
func promtoolRulesTest(t *testing.T, test string) {
	t.Helper()
	promtool := needTool(t, "promtool", "apt-get install -y prometheus")
	rules, err := filepath.Abs("examples/prometheus/relay-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "rules.test.yml")
	if err := os.WriteFile(path, []byte(fmt.Sprintf(test, rules)), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "test", "rules", path).CombinedOutput(); err != nil {
		t.Errorf("promtool test rules: %v\n%s", err, out)
	}
}
