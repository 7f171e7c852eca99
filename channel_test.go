package relay

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
)

func TestChannelJSONOfEarlierVersionsStillLoads(t *testing.T) {
	tests := []struct {
		name, in, want string
	}{
		{"provider fields beside the channel's own", `{"name":"a","provider":"bedrock","region":"us-east-1","betas":["x"],"priority":2}`,
			`{"provider":"bedrock","region":"us-east-1","betas":["x"]}`},
		{"no provider was anthropic", `{"name":"a","url":"https://x.example","api_key":"{env.K}"}`,
			`{"provider":"anthropic","url":"https://x.example","api_key":"{env.K}"}`},
		{"a mock's options", `{"name":"a","provider":"mock","latency":"50ms","reply_tokens":0,"fail_rate":0.2}`,
			`{"provider":"mock","latency":50000000,"reply_tokens":0,"fail_rate":0.2}`},
		{"the current shape is kept as it is", `{"name":"a","upstream":{"provider":"vertex","project":"p"}}`,
			`{"provider":"vertex","project":"p"}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ch Channel
			if err := json.Unmarshal([]byte(tt.in), &ch); err != nil {
				t.Fatal(err)
			}
			if string(ch.UpstreamRaw) != tt.want || ch.Name != "a" {
				t.Errorf("upstream = %s, want %s", ch.UpstreamRaw, tt.want)
			}
		})
	}
	for in, want := range map[string]string{
		`{"name":"a","upstream":{"provider":"mock"},"region":"x"}`: `go inside "upstream"`,
		`{"name":"a","colour":"blue"}`:                             `unknown field "colour"`,
	} {
		var ch Channel
		if err := caddy.StrictUnmarshalJSON([]byte(in), &ch); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: error %v, want one saying %s", in, err, want)
		}
	}
}

func TestAnAutosaveOfEarlierVersionsServes(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("from the old config"))
	tester := caddytest.NewTester(t)
	tester.InitServer(`{
	"admin": {"listen": "localhost:2999"},
	"apps": {"http": {"http_port": 9080, "servers": {"s": {"listen": [":9080"], "routes": [{"handle": [{
		"handler": "relay",
		"keys": [{"secret": "`+clientKey+`", "group": "old"}],
		"channels": [
			{"name": "old-flat", "url": "`+up.URL+`", "api_key": "`+channelKey+`", "priority": 1},
			{"name": "old-mock", "provider": "mock", "reply_tokens": 3, "priority": 2}
		],
		"groups": [{"name": "old", "channels": ["old-flat", "old-mock"], "expose_channel": true}]
	}]}]}}}}
}`, "json")
	r := message(t, simpleBody)
	if r.status != 200 || r.header.Get("X-Relay-Channel") != "old-flat" || up.Last(t).Header.Get("X-Api-Key") != channelKey {
		t.Errorf("%d %s via %s", r.status, r.body, r.header.Get("X-Relay-Channel"))
	}
	if st := channels(t)["old-mock"]; st.Provider != "mock" {
		t.Errorf("old-mock: %+v", st)
	}
}

func TestChannelProviderLines(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("served"))
	// `provider <name> { ... }` and the provider's options on the channel's
	// own lines are the same
	startRelay(t, "\t\tchannel lines-block {\n\t\t\tprovider anthropic {\n\t\t\t\turl "+up.URL+"\n\t\t\t\tapi_key "+channelKey+"\n\t\t\t}\n\t\t\tpriority 1\n\t\t}\n"+
		"\t\tchannel lines-mock {\n\t\t\tfail_rate 10%\n\t\t\tpriority 2\n\t\t\tprovider mock\n\t\t\ttokens 7\n\t\t\ttokens 100/m\n\t\t}\n"+
		keyAndGroup("lines", "lines-block lines-mock", "expose_channel"))
	if r := message(t, simpleBody); r.status != 200 || r.header.Get("X-Relay-Channel") != "lines-block" || up.Hits() != 1 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	cfg, _ := http.Get(adminURL + "/config/apps/http/servers/srv0/routes/0/handle/0/routes/0/handle/0/channels/1")
	var mock Channel
	if cfg == nil || json.NewDecoder(cfg.Body).Decode(&mock) != nil {
		t.Fatal("no config for lines-mock")
	}
	if string(mock.UpstreamRaw) != `{"fail_rate":0.1,"provider":"mock","reply_tokens":7}` || mock.Tokens != "100/m" || mock.Priority != 2 {
		t.Errorf("lines-mock: %s, tokens %q", mock.UpstreamRaw, mock.Tokens)
	}
}
