package relay

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/crypto/bcrypt"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/idle"
)

// identityRelay is a relay that takes identities from
// {http.auth.user.id}, with the user entries given, one key (sk-<name>-key,
// named <name>-key) and the groups <name>-pro, <name>-free and
// <name>-keyed, each on a mock channel of its own; driven by a fake clock.
func identityRelay(t *testing.T, name string, users ...*User) (*Relay, *fakeClock) {
	t.Helper()
	r := &Relay{
		Identity: "{http.auth.user.id}",
		Users:    users,
		Keys:     []*Key{{Secret: "sk-" + name + "-key", Group: name + "-keyed", KeyOptions: KeyOptions{Name: name + "-key"}}},
	}
	for _, g := range []string{"pro", "free", "keyed"} {
		ch := &Channel{Name: name + "-" + g + "-ch", UpstreamRaw: upstream("mock")}
		r.Channels = append(r.Channels, ch)
		r.Groups = append(r.Groups, &Group{Name: name + "-" + g, Channels: []string{ch.Name}})
	}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Unix(1_900_000_000, 0)}
	r.now = clock.now
	return r, clock
}

// serveAs runs one request through r as Caddy would after an
// authentication handler that established identity ("": none ran), with
// the relay key given ("": none). It returns the response, the request's
// replacer (the relay's placeholders) and the request's headers as the
// relay left them.
func serveAs(t *testing.T, r *Relay, identity, key, body string) (*httptest.ResponseRecorder, *caddy.Replacer, http.Header) {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("X-Api-Key", key)
	}
	if identity != "" { // as basic_auth leaves it
		req.Header.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(identity+":its-password")))
	}
	w := httptest.NewRecorder()
	repl := caddy.NewReplacer()
	req = caddyhttp.PrepareRequest(req, repl, w, &caddyhttp.Server{})
	if identity != "" {
		repl.Set("http.auth.user.id", identity)
	}
	if err := r.ServeHTTP(w, req, nil); err != nil {
		t.Fatal(err)
	}
	return w, repl, req.Header
}

func TestAnIdentityDecidesWhoARequestIs(t *testing.T) {
	r, _ := identityRelay(t, "idd",
		&User{ID: "alice-idd", Group: "idd-pro"},
		&User{ID: "*", Group: "idd-free"})
	tests := []struct {
		name, identity, key string
		group, label        string // served as; "" for a 401
		stateID             string
	}{
		{name: "an identity with an entry of its own", identity: "alice-idd", group: "idd-pro", label: "user:alice-idd", stateID: "user:alice-idd"},
		{name: "an identity without one falls to user *", identity: "bob-idd", group: "idd-free", label: "user:*", stateID: "user:bob-idd"},
		{name: "an identity decides, whatever key comes with it", identity: "bob-idd", key: "sk-idd-key", group: "idd-free", label: "user:*", stateID: "user:bob-idd"},
		{name: "an identity decides, even with a wrong key", identity: "alice-idd", key: "sk-wrong-guess", group: "idd-pro", label: "user:alice-idd", stateID: "user:alice-idd"},
		{name: "no identity: the relay key", key: "sk-idd-key", group: "idd-keyed", label: "idd-key", stateID: "idd-key"},
		{name: "no identity and a wrong key", key: "sk-wrong-guess"},
		{name: "neither", key: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w, repl, header := serveAs(t, r, tt.identity, tt.key, simpleBody)
			if header.Get("Authorization") != "" || header.Get("X-Api-Key") != "" {
				t.Errorf("the client's credentials outlived the auth step: %v", header)
			}
			if tt.group == "" {
				if w.Code != 401 || !strings.Contains(w.Body.String(), `"authentication_error"`) {
					t.Fatalf("%d %s, want the relay's 401", w.Code, w.Body)
				}
				if strings.Contains(w.Body.String(), "sk-wrong") {
					t.Errorf("the 401 repeats the key: %s", w.Body)
				}
				return
			}
			if w.Code != 200 {
				t.Fatalf("%d %s", w.Code, w.Body)
			}
			if g, _ := repl.GetString("http.relay.group"); g != tt.group {
				t.Errorf("served by group %q, want %q", g, tt.group)
			}
			if k, _ := repl.GetString("http.relay.key"); k != tt.label {
				t.Errorf("labelled %q, want %q", k, tt.label)
			}
		})
	}
	// the state id of each principal
	for _, tt := range tests {
		if tt.group == "" || tt.identity == "" {
			continue
		}
		k := r.users[tt.identity]
		if k == nil {
			k = r.anyUser
		}
		if _, id := k.principal(tt.identity, r.now()); id != tt.stateID {
			t.Errorf("%s: state id %q, want %q", tt.name, id, tt.stateID)
		}
	}
}

func TestAnIdentityWithoutAnEntryIsRefused(t *testing.T) {
	r, _ := identityRelay(t, "idn", &User{ID: "alice-idn", Group: "idn-pro"})
	// no user * entry: another identity is refused, even with a good key
	w, _, _ := serveAs(t, r, "mallory@example.com", "sk-idn-key", simpleBody)
	if w.Code != 401 || !strings.Contains(w.Body.String(), `"authentication_error"`) || !strings.Contains(w.Body.String(), "no user entry") {
		t.Fatalf("%d %s, want a 401 saying the identity has no entry", w.Code, w.Body)
	}
	if strings.Contains(w.Body.String(), "mallory") || strings.Contains(w.Body.String(), "sk-idn") {
		t.Errorf("the 401 names the identity or the key: %s", w.Body)
	}
	if w, _, _ := serveAs(t, r, "", "", simpleBody); w.Code != 401 || !strings.Contains(w.Body.String(), "sign in, or send a relay key") {
		t.Errorf("no identity, no key: %d %s", w.Code, w.Body)
	}
}

func TestEachIdentityOfUserStarHasItsOwnLimits(t *testing.T) {
	r, clock := identityRelay(t, "ids",
		&User{ID: "alice-ids", Group: "ids-pro", KeyOptions: KeyOptions{Rate: "1/m"}},
		&User{ID: "*", Group: "ids-free", KeyOptions: KeyOptions{Rate: "2/m"}})
	limited := func() float64 { return testutil.ToFloat64(metricRateLimited.WithLabelValues("user:*", "rate")) }
	before := limited()
	for _, who := range []string{"bob-ids", "carol-ids"} {
		for i := range 2 {
			if w, _, _ := serveAs(t, r, who, "", simpleBody); w.Code != 200 {
				t.Fatalf("%s, request %d: %d %s", who, i+1, w.Code, w.Body)
			}
		}
		w, _, _ := serveAs(t, r, who, "", simpleBody)
		wantLimited(t, w, "key_rate_limited")
		if !strings.Contains(w.Body.String(), "user *") || strings.Contains(w.Body.String(), who) {
			t.Errorf("%s: the message should name the entry, not the identity: %s", who, w.Body)
		}
	}
	// alice's entry has a limit of its own
	if w, _, _ := serveAs(t, r, "alice-ids", "", simpleBody); w.Code != 200 {
		t.Fatalf("alice: %d", w.Code)
	}
	if w, _, _ := serveAs(t, r, "alice-ids", "", simpleBody); w.Code != 429 {
		t.Fatalf("alice's second request in the minute: %d", w.Code)
	}
	if d := limited() - before; d != 2 {
		t.Errorf("relay_rate_limited_total{key=user:*,scope=rate} went up by %v, want 2: the label is the entry's", d)
	}
	clock.advance(30 * time.Second)
	if w, _, _ := serveAs(t, r, "bob-ids", "", simpleBody); w.Code != 200 {
		t.Errorf("bob after 30s: %d", w.Code)
	}
	if n := r.anyUser.state.idents.Load().Len(); n != 2 {
		t.Errorf("user * keeps %d identities, want 2", n)
	}
}

// wantLimited checks a 429 rate_limit_error with code and a retry-after.
func wantLimited(t *testing.T, w *httptest.ResponseRecorder, code string) {
	t.Helper()
	if w.Code != 429 || !strings.Contains(w.Body.String(), `"rate_limit_error"`) || !strings.Contains(w.Body.String(), `"code":"`+code+`"`) {
		t.Fatalf("%d %s, want 429 rate_limit_error %s", w.Code, w.Body, code)
	}
	if w.Header().Get("Retry-After") == "" {
		t.Errorf("no retry-after")
	}
}

func TestIdleIdentitiesAreDropped(t *testing.T) {
	r, clock := identityRelay(t, "idl", &User{ID: "*", Group: "idl-free", KeyOptions: KeyOptions{Rate: "60/m"}})
	for i := range 5 {
		if w, _, _ := serveAs(t, r, fmt.Sprintf("idle-%d@idl", i), "", simpleBody); w.Code != 200 {
			t.Fatal(w.Code)
		}
	}
	idents := r.anyUser.state.idents.Load()
	if idents.Len() != 5 {
		t.Fatalf("%d identities kept, want 5", idents.Len())
	}
	clock.advance(idleAfter + time.Second)
	if w, _, _ := serveAs(t, r, "active@idl", "", simpleBody); w.Code != 200 {
		t.Fatal(w.Code)
	}
	// the request looked at the idle ones, a few at a time
	if n := idents.Len(); n > 1+5-idle.SweepSteps {
		t.Errorf("%d identities kept after %v idle, want the idle ones going", n, idleAfter)
	}
}

func TestUserStatesSurviveAReload(t *testing.T) {
	users := func() []*User {
		return []*User{
			{ID: "alice-rel", Group: "rel-pro", KeyOptions: KeyOptions{Rate: "2/m"}},
			{ID: "*", Group: "rel-free", KeyOptions: KeyOptions{Rate: "2/m"}},
		}
	}
	old, clock := identityRelay(t, "rel", users()...)
	for _, who := range []string{"alice-rel", "bob-rel"} {
		for range 2 {
			if w, _, _ := serveAs(t, old, who, "", simpleBody); w.Code != 200 {
				t.Fatal(w.Code)
			}
		}
	}
	// the new config takes the states before the old one lets them go
	r, _ := identityRelay(t, "rel", users()...)
	r.now = clock.now
	_ = old.Cleanup()
	for _, who := range []string{"alice-rel", "bob-rel"} {
		w, _, _ := serveAs(t, r, who, "", simpleBody)
		wantLimited(t, w, "key_rate_limited")
	}
	if w, _, _ := serveAs(t, r, "carol-rel", "", simpleBody); w.Code != 200 {
		t.Errorf("carol, new: %d", w.Code)
	}
}

func TestUserConfigErrors(t *testing.T) {
	group := func() []*Group { return []*Group{{Name: "g", Channels: []string{"c"}}} }
	for _, tt := range []struct {
		name string
		r    Relay
		want string
	}{
		{"users without identity", Relay{Users: []*User{{ID: "a", Group: "g"}}}, "need identity"},
		{"identity without users", Relay{Identity: "{http.auth.user.id}", Keys: []*Key{{Secret: "sk-x", Group: "g"}}}, "no user entry"},
		{"identity that is no placeholder", Relay{Identity: "alice", Users: []*User{{ID: "a", Group: "g"}}}, "must be one placeholder"},
		{"identity with text around its placeholder", Relay{Identity: "user-{http.auth.user.id}", Users: []*User{{ID: "a", Group: "g"}}}, "must be one placeholder"},
		{"identity of a global placeholder", Relay{Identity: "{env.USER}", Users: []*User{{ID: "a", Group: "g"}}}, "must be one placeholder"},
		{"identity of two placeholders", Relay{Identity: "{http.auth.user.id}{http.auth.user.email}", Users: []*User{{ID: "a", Group: "g"}}}, "must be one placeholder"},
		{"a user twice", Relay{Identity: "{http.auth.user.id}", Users: []*User{{ID: "a", Group: "g"}, {ID: "a", Group: "g"}}}, "user a is given twice"},
		{"a user without an id", Relay{Identity: "{http.auth.user.id}", Users: []*User{{Group: "g"}}}, "has no id"},
		{"a user of an unknown group", Relay{Identity: "{http.auth.user.id}", Users: []*User{{ID: "a", Group: "nope"}}}, `unknown group "nope"`},
		{"a user's bad limit", Relay{Identity: "{http.auth.user.id}", Users: []*User{{ID: "*", Group: "g", KeyOptions: KeyOptions{UserRate: "5"}}}}, "user *: user_rate"},
		{"a key's bad user_tokens", Relay{Keys: []*Key{{Secret: "sk-x", Group: "g", KeyOptions: KeyOptions{UserTokens: "x/m"}}}}, "user_tokens"},
		{"a key named as a user", Relay{Keys: []*Key{{Secret: "sk-x", Group: "g", KeyOptions: KeyOptions{Name: "user:a"}}}}, `may not start with "user:"`},
		{"a user named as a key", Relay{Identity: "{http.auth.user.id}", Keys: []*Key{{Secret: "sk-x", Group: "g", KeyOptions: KeyOptions{Name: "k"}}},
			Users: []*User{{ID: "a", Group: "g", KeyOptions: KeyOptions{Name: "k"}}}}, `the same name "k"`},
		{"a user named as another's default", Relay{Identity: "{http.auth.user.id}",
			Users: []*User{{ID: "a", Group: "g", KeyOptions: KeyOptions{Name: "user:b"}}, {ID: "b", Group: "g"}}}, `the same name "user:b"`},
		{"nothing to authenticate with", Relay{}, "no key is configured"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.r
			r.Channels = []*Channel{{Name: "c", UpstreamRaw: upstream("mock")}}
			r.Groups = group()
			err := r.validateConfig()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want it to say %q", err, tt.want)
			}
		})
	}
	ok := Relay{Identity: "{http.auth.user.id}", Users: []*User{{ID: "*", Group: "g"}},
		Channels: []*Channel{{Name: "c", UpstreamRaw: upstream("mock")}}, Groups: group()}
	if err := ok.validateConfig(); err != nil {
		t.Errorf("a relay of users only, without keys: %v", err)
	}
}

func TestCaddyfileUsers(t *testing.T) {
	r, err := parseRelay(t, `relay {
	identity {http.auth.user.id}
	key sk-client-secret-0123456789 g {
		name support
		user_rate 20/m
		user_tokens 200000/m
	}
	user alice@example.com g {
		priority realtime
		rate 60/m
		tokens 100000/m
		concurrency 4
		user_rate 10/m
	}
	user * g
	channel a {
		provider mock
	}
	group g {
		channels a
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(struct {
		Identity string
		Keys     []*Key
		Users    []*User
	}{r.Identity, r.Keys, r.Users})
	want := `{"Identity":"{http.auth.user.id}",` +
		`"Keys":[{"secret":"` + sha256Secret("sk-client-secret-0123456789") + `","group":"g","name":"support","user_rate":"20/m","user_tokens":"200000/m"}],` +
		`"Users":[{"id":"alice@example.com","group":"g","priority":"realtime","rate":"60/m","tokens":"100000/m","concurrency":4,"user_rate":"10/m"},` +
		`{"id":"*","group":"g"}]}`
	if string(got) != want {
		t.Errorf("adapted\n%s\nwant\n%s", got, want)
	}

	// errors point at their line
	base := "relay {\n\tkey sk-client-secret-0123456789 prod\n%s\tchannel a {\n\t\tprovider mock\n\t}\n\tgroup prod {\n\t\tchannels a\n\t}\n}\n"
	for name, lines := range map[string]string{
		"a user naming an unknown group":     "\tidentity {http.auth.user.id}\n\tuser alice nowhere # here\n",
		"a user's bad user_rate":             "\tidentity {http.auth.user.id}\n\tuser * prod {\n\t\tuser_rate 5 # here\n\t}\n",
		"a user given twice":                 "\tidentity {http.auth.user.id}\n\tuser alice prod\n\tuser alice prod # here\n",
		"a user without identity":            "\tuser alice prod # here\n",
		"an identity that is no placeholder": "\tidentity alice # here\n\tuser alice prod\n",
		"a key named as a user":              "\tkey sk-other-secret-0123456789 prod {\n\t\tname user:x # here\n\t}\n",
		"an unknown user option":             "\tidentity {http.auth.user.id}\n\tuser alice prod {\n\t\tbudgets 5 # here\n\t}\n",
		"a user without a group":             "\tidentity {http.auth.user.id}\n\tuser alice # here\n",
		"identity twice":                     "\tidentity {http.auth.user.id}\n\tuser alice prod\n\tidentity {http.auth.user.email} # here\n",
	} {
		wantErrorAtMarkedLine(t, name, fmt.Sprintf(base, lines))
	}
}

func TestTwoHandlersMustDeclareAUserAlike(t *testing.T) {
	a := &Relay{Users: []*User{{ID: "alice", Group: "g", KeyOptions: KeyOptions{Rate: "5/m"}}}}
	b := &Relay{Users: []*User{{ID: "alice", Group: "g", KeyOptions: KeyOptions{Rate: "50/m"}}}}
	da, _ := a.declared("handler a")
	db, _ := b.declared("handler b")
	err := conflict("user alice", da["user alice"], db["user alice"])
	if err == nil || !strings.Contains(err.Error(), "they differ in rate") {
		t.Fatalf("conflict = %v", err)
	}
	if err := conflict("user alice", da["user alice"], da["user alice"]); err != nil {
		t.Errorf("alike: %v", err)
	}
}

// TestBasicAuthIdentities runs Caddy's own basic_auth before the relay:
// clients that sign in are served as their user entries, the others need
// a relay key, and no client credential of either kind reaches an
// upstream.
func TestBasicAuthIdentities(t *testing.T) {
	var seen []http.Header
	record := func(name string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			seen = append(seen, r.Header.Clone())
			fakeupstream.Message("from "+name).ServeHTTP(w, r)
		})
	}
	pro := fakeupstream.New(t, record("pro"))
	free := fakeupstream.New(t, record("free"))
	keyed := fakeupstream.New(t, record("keyed"))
	hash, err := bcrypt.GenerateFromPassword([]byte("right-password"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	var accounts string
	for _, u := range []string{"alice-ba", "bob-ba", "carol-ba"} {
		accounts += "\t\t" + u + " " + string(hash) + "\n"
	}
	// basic_auth only for requests that try it: the others go on to the
	// relay, which wants a relay key from them
	site := "\t@signin header Authorization \"Basic *\"\n\tbasic_auth @signin {\n" + accounts + "\t}\n"
	startRelayWith(t, site,
		"\t\tidentity {http.auth.user.id}\n"+
			"\t\tuser alice-ba ba-pro\n"+
			"\t\tuser * ba-free {\n\t\t\trate 2/m\n\t\t}\n"+
			channelBlock("ba-pro-ch", pro.URL)+channelBlock("ba-free-ch", free.URL)+channelBlock("ba-keyed-ch", keyed.URL)+
			"\t\tgroup ba-pro {\n\t\t\tchannels ba-pro-ch\n\t\t}\n\t\tgroup ba-free {\n\t\t\tchannels ba-free-ch\n\t\t}\n"+
			keyAndGroup("ba-keyed", "ba-keyed-ch"))
	basic := func(user, password string) string {
		return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
	}
	signedIn := func(user string, header ...string) reply {
		t.Helper()
		return send(t, http.MethodPost, "/v1/messages", "", simpleBody, append([]string{"Authorization", basic(user, "right-password")}, header...)...)
	}
	servedBy := func(r reply, want string) {
		t.Helper()
		if r.status != 200 || !strings.Contains(string(r.body), "from "+want) {
			t.Fatalf("%d %s, want an answer from %s", r.status, r.body, want)
		}
	}

	// alice has an entry: her group serves her, and the relay key she
	// also sends is neither needed nor forwarded
	servedBy(signedIn("alice-ba", "X-Api-Key", clientKey), "pro")
	// bob has none: user * serves him
	servedBy(signedIn("bob-ba"), "free")
	// a wrong password: basic_auth's own 401, the relay never sees it
	if r := send(t, http.MethodPost, "/v1/messages", "", simpleBody, "Authorization", basic("bob-ba", "wrong")); r.status != 401 ||
		r.header.Get("Www-Authenticate") == "" || r.header.Get("X-Relay-Request-Id") != "" {
		t.Errorf("a wrong password: %d %v %s, want basic_auth's 401", r.status, r.header, r.body)
	}
	// neither credentials nor a key: the relay's 401
	wantRelayError(t, send(t, http.MethodPost, "/v1/messages", "", simpleBody), 401, "authentication_error", "")
	// a relay key, as a bearer token, without signing in
	servedBy(send(t, http.MethodPost, "/v1/messages", "", simpleBody, "Authorization", "Bearer "+clientKey), "keyed")

	// bob and carol each have user *'s 2 requests a minute
	servedBy(signedIn("bob-ba"), "free")
	r := signedIn("bob-ba")
	wantRelayError(t, r, 429, "rate_limit_error", "key_rate_limited")
	servedBy(signedIn("carol-ba"), "free")
	servedBy(signedIn("carol-ba"), "free")

	if len(seen) != 6 {
		t.Fatalf("the upstreams saw %d requests, want 6", len(seen))
	}
	for i, h := range seen {
		if h.Get("X-Api-Key") != channelKey || h.Get("Authorization") != "" || h.Get("Proxy-Authorization") != "" {
			t.Errorf("upstream request %d carried x-api-key %q, authorization %q: only the channel's key may reach it", i+1, h.Get("X-Api-Key"), h.Get("Authorization"))
		}
	}
}

func TestAnIdentityAClientCanSetIsWarnedAbout(t *testing.T) {
	for placeholder, want := range map[string]bool{
		"{http.auth.user.id}":           false,
		"{http.auth.user.email}":        false,
		"{http.request.header.X-User}":  true,
		"{http.request.uri.query.user}": true,
		"{http.request.cookie.user}":    true,
		"{http.vars.client_ip}":         false,
	} {
		if got := clientSetsIdentity(placeholder); got != want {
			t.Errorf("%s: client-set %v, want %v", placeholder, got, want)
		}
	}
}
