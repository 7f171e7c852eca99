package relay

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
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

func TestModelFilterAndMapping(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Message("a"))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("models-a", a.URL, "models claude-opus-4-1=claude-opus-4-1-20250805 claude-haiku-4-5")+
		channelBlock("models-b", b.URL, "models claude-sonnet-4-5")+keyAndGroup("models", "models-a models-b"))

	body := `{"model"  :  "claude-opus-4-1", "max_tokens":16, "metadata":{"user_id":"u1"},"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"tools":[{"name":"kept","input_schema":{"kept":true}}]}`
	r := message(t, body)
	if r.status != 200 || b.Hits() != 0 {
		t.Fatalf("status %d, b hits %d: opus is served by a only", r.status, b.Hits())
	}
	want := strings.Replace(body, `"claude-opus-4-1"`, `"claude-opus-4-1-20250805"`, 1)
	if got := string(a.Last(t).Body); got != want {
		t.Errorf("upstream body:\n got %s\nwant %s", got, want)
	}

	message(t, `{"model":"claude-haiku-4-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`)
	if got := string(a.Last(t).Body); got != `{"model":"claude-haiku-4-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}` {
		t.Errorf("an unmapped model must pass unchanged: %s", got)
	}
	message(t, simpleBody)
	if b.Hits() != 1 {
		t.Errorf("sonnet should go to b: hits %d", b.Hits())
	}

	r = message(t, `{"model":"claude-3-opus"}`)
	wantRelayError(t, r, 503, "relay_error", "model_not_found")
	if want := `no channel of group \"models\" serves model \"claude-3-opus\"; it serves claude-opus-4-1, claude-haiku-4-5, claude-sonnet-4-5"`; !strings.Contains(string(r.body), want) {
		t.Errorf("an unknown model's answer should list the group's models (%s): %s", want, r.body)
	}
	if r.header.Get("X-Should-Retry") != "false" {
		t.Errorf("model_not_found must say x-should-retry: false")
	}

	// GET /v1/models lists what the group's channels declare
	r = send(t, http.MethodGet, "/v1/models", clientKey, "")
	var list struct {
		Data []struct {
			ID   string `json:"id"`
			Type string `json:"type"`
		} `json:"data"`
		HasMore bool   `json:"has_more"`
		FirstID string `json:"first_id"`
		LastID  string `json:"last_id"`
	}
	if err := json.Unmarshal(r.body, &list); err != nil || r.status != 200 {
		t.Fatalf("models: %d %s", r.status, r.body)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if strings.Join(ids, ",") != "claude-opus-4-1,claude-haiku-4-5,claude-sonnet-4-5" || list.FirstID != "claude-opus-4-1" || list.LastID != "claude-sonnet-4-5" {
		t.Errorf("models = %v (first %q last %q)", ids, list.FirstID, list.LastID)
	}
	if r = send(t, http.MethodGet, "/v1/models?limit=1", clientKey, ""); !bytes.Contains(r.body, []byte(`"has_more":true`)) {
		t.Errorf("limit=1 should page: %s", r.body)
	}
	if r = send(t, http.MethodGet, "/v1/models/claude-haiku-4-5", clientKey, ""); r.status != 200 || !bytes.Contains(r.body, []byte(`"id":"claude-haiku-4-5"`)) {
		t.Errorf("GET /v1/models/{id}: %d %s", r.status, r.body)
	}
	wantRelayError(t, send(t, http.MethodGet, "/v1/models/gpt-4", clientKey, ""), 404, "not_found_error", "")
	wantRelayError(t, send(t, http.MethodGet, "/v1/models", "sk-wrong", ""), 401, "authentication_error", "")
	if a.Hits()+b.Hits() != 3 {
		t.Errorf("GET /v1/models must be answered locally: upstream hits %d", a.Hits()+b.Hits())
	}
}

func TestHTTPSChannelUsesTLS(t *testing.T) {
	var sawTLS atomic.Bool
	tlsUp := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sawTLS.Store(r.TLS != nil)
		fakeupstream.Message("over tls")(w, r)
	}))
	t.Cleanup(tlsUp.Close)
	// the fake's certificate is self-signed: trusted only when told so
	startRelay(t, channelBlock("tls-trusting", tlsUp.URL, "transport http {\n\t\t\t\ttls_insecure_skip_verify\n\t\t\t}")+
		channelBlock("tls-default", tlsUp.URL)+
		keyAndGroup("tls1", "tls-trusting")+
		"\t\tkey sk-tls-2 tls2\n\t\tgroup tls2 {\n\t\t\tchannels tls-default\n\t\t}\n")

	if r := message(t, simpleBody); r.status != 200 || !sawTLS.Load() {
		t.Errorf("https channel with a transport block: %d, TLS %v: %s", r.status, sawTLS.Load(), r.body)
	}
	// without a transport block the default one verifies the certificate,
	// which proves it speaks TLS to an https URL
	r := send(t, http.MethodPost, "/v1/messages", "sk-tls-2", simpleBody)
	wantRelayError(t, r, 502, "api_error", "")
	if !bytes.Contains(r.body, []byte("certificate")) {
		t.Errorf("want a certificate error, got %s", r.body)
	}
}

// TestChannelKeepsItsConnectionsUnderConcurrency: a channel shares one
// upstream among all clients, so after a wave of 64 requests at once the
// next wave finds 64 idle connections; Caddy's default of 32 would close
// half of them and dial them again. A transport block that sets
// keepalive_idle_conns_per_host keeps its own number.
func TestChannelKeepsItsConnectionsUnderConcurrency(t *testing.T) {
	const n = 64
	for _, tt := range []struct {
		name      string
		transport string
		wantConns int64
	}{
		{"default", "", n},
		{"keepalive_idle_conns_per_host 8", `{"protocol":"http","keep_alive":{"max_idle_conns_per_host":8}}`, 2*n - 8},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// each wave's requests all hold a connection at once: none is
			// answered before the wave's last has arrived
			var mu sync.Mutex
			arrived, release := 0, make(chan struct{})
			up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				mu.Lock()
				wave := release
				if arrived++; arrived == n {
					close(release)
					arrived, release = 0, make(chan struct{})
				}
				mu.Unlock()
				<-wave
				fakeupstream.Message("hi")(w, req)
			}))
			name := "idle-conns-" + strings.ReplaceAll(tt.name, " ", "-")
			ch := &Channel{Name: name, UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
			if tt.transport != "" {
				ch.TransportRaw = json.RawMessage(tt.transport)
			}
			r := &Relay{
				Keys:     []*Key{{Secret: "sk-" + name, Group: name, KeyOptions: KeyOptions{Name: name}}},
				Channels: []*Channel{ch},
				Groups:   []*Group{{Name: name, Channels: []string{name}}},
			}
			provisionHandler(t, r)
			for range 2 {
				codes := make(chan int, n)
				for range n {
					go func() {
						req := httptest.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(`{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`))
						req.Header.Set("X-Api-Key", "sk-"+name)
						req.Header.Set("Anthropic-Version", "2023-06-01")
						w := httptest.NewRecorder()
						req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, &caddyhttp.Server{})
						_ = r.ServeHTTP(w, req, nil)
						codes <- w.Code
					}()
				}
				for range n {
					if c := <-codes; c != http.StatusOK {
						t.Fatalf("status %d", c)
					}
				}
			}
			if got := up.Conns(); got != tt.wantConns {
				t.Errorf("upstream connections after two waves of %d: %d, want %d", n, got, tt.wantConns)
			}
		})
	}
}
