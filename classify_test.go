package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddy-relay/relay/providers/bedrock"
	openaiprovider "github.com/caddy-relay/relay/providers/openai"
	"github.com/caddy-relay/relay/providers/vertex"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

func respHeader(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i < len(kv); i += 2 {
		h.Set(kv[i], kv[i+1])
	}
	return h
}

func TestClassifyStatus(t *testing.T) {
	const (
		creditBody    = `{"type":"error","error":{"type":"invalid_request_error","message":"Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade or purchase credits."}}`
		spendBody     = `{"type":"error","error":{"type":"rate_limit_error","message":"You have reached your specified API usage limits.","details":{"error_code":"enforced_spend_limit_reached"}}}`
		plain400      = `{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: Field required"}}`
		plain429      = `{"type":"error","error":{"type":"rate_limit_error","message":"Number of request tokens has exceeded your per-minute rate limit"}}`
		echoedBody    = `{"type":"error","error":{"type":"invalid_request_error","message":"Unexpected value(s) ` + "`Your credit balance is too low`" + ` for the ` + "`anthropic-beta`" + ` header."}}`
		workspaceBody = `{"type":"error","error":{"type":"invalid_request_error","message":"You have reached your specified workspace API usage limits. You will regain access on 2026-12-01 at 00:00 UTC."}}`
	)
	tests := []struct {
		name       string
		status     int
		header     http.Header
		body       string
		want       outcome
		wantWait   time.Duration
		wantReason string
	}{
		{name: "200 commits", status: 200, want: outcomeSuccess, wantReason: "status 200"},
		{name: "201 is a success too", status: 201, want: outcomeSuccess},
		{name: "400 passes through", status: 400, body: plain400, want: outcomeClientError, wantReason: "status 400"},
		{name: "404 passes through", status: 404, want: outcomeClientError},
		{name: "413 passes through", status: 413, want: outcomeClientError},
		{name: "422 passes through", status: 422, want: outcomeClientError},
		{name: "418 and other unlisted 4xx pass through", status: 418, want: outcomeClientError},
		{name: "408 passes through", status: 408, want: outcomeClientError},
		{name: "401 means the credential is unusable", status: 401, want: outcomeAuth},
		{name: "402 means the account is unusable", status: 402, want: outcomeAuth},
		{name: "403 means the credential is unusable", status: 403, want: outcomeAuth},
		{name: "400 with credit balance too low is an account problem", status: 400, body: creditBody, want: outcomeAuth, wantReason: "credit balance too low"},
		{name: "400 with billing_error type is an account problem", status: 400, body: `{"type":"error","error":{"type":"billing_error","message":"x"}}`, want: outcomeAuth, wantReason: "billing error"},
		{name: "400 at the workspace usage limit is an account problem", status: 400, body: workspaceBody, want: outcomeAuth, wantReason: "workspace usage limit reached"},
		// Anthropic echoes request values in its messages: a phrase anywhere
		// but at the start must never cool a channel
		{name: "billing phrase echoed from an anthropic-beta header is the client's", status: 400, body: echoedBody, want: outcomeClientError},
		{name: "billing phrase in another case is the client's", status: 400, body: `{"error":{"message":"CREDIT BALANCE IS TOO LOW"}}`, want: outcomeClientError},
		{name: "billing phrase after a leading space is the client's", status: 400, body: `{"error":{"message":" Your credit balance is too low"}}`, want: outcomeClientError},
		{name: "credit balance text on a 404 is not an account problem", status: 404, body: creditBody, want: outcomeClientError},
		{name: "429 with enforced_spend_limit_reached is an account problem", status: 429, body: spendBody, header: respHeader("Retry-After", "30"), want: outcomeAuth, wantReason: "spend limit reached"},
		{name: "plain 429 is rate limited without a hint", status: 429, body: plain429, want: outcomeRateLimited, wantReason: "status 429"},
		{name: "429 carries its retry-after hint", status: 429, body: plain429, header: respHeader("Retry-After", "12"), want: outcomeRateLimited, wantWait: 12 * time.Second},
		{name: "429 carries its retry-after-ms hint", status: 429, header: respHeader("Retry-After-Ms", "750"), want: outcomeRateLimited, wantWait: 750 * time.Millisecond},
		{name: "429 with a non-JSON body is still rate limited", status: 429, body: "<html>slow down</html>", want: outcomeRateLimited},
		{name: "529 is provider overload", status: 529, header: respHeader("Retry-After", "3"), want: outcomeOverloaded, wantReason: "status 529"},
		{name: "500 is transient", status: 500, want: outcomeTransient, wantReason: "status 500"},
		{name: "502 is transient", status: 502, want: outcomeTransient},
		{name: "503 is transient", status: 503, want: outcomeTransient},
		{name: "504 is transient", status: 504, want: outcomeTransient},
		{name: "599 and other unlisted 5xx are transient", status: 599, want: outcomeTransient},
		{name: "501 passes through", status: 501, want: outcomeClientError},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := tt.header
			if h == nil {
				h = http.Header{}
			}
			v := classifyStatus(tt.status, h, []byte(tt.body), testNow)
			if v.outcome != tt.want {
				t.Errorf("outcome = %v, want %v", v.outcome, tt.want)
			}
			if v.wait != tt.wantWait {
				t.Errorf("wait = %v, want %v", v.wait, tt.wantWait)
			}
			if v.timeout {
				t.Errorf("timeout = true for an HTTP answer")
			}
			if tt.wantReason != "" && v.reason != tt.wantReason {
				t.Errorf("reason = %q, want %q", v.reason, tt.wantReason)
			}
		})
	}
}

func TestOutcomeRetryable(t *testing.T) {
	want := map[outcome]bool{
		outcomeSuccess:     false,
		outcomeClientError: false,
		outcomeAuth:        true,
		outcomeRateLimited: true,
		outcomeOverloaded:  true,
		outcomeTransient:   true,
		outcomeCanceled:    false,
	}
	for o, retry := range want {
		t.Run(o.String(), func(t *testing.T) {
			if o.Retryable() != retry {
				t.Errorf("retryable() = %v, want %v", o.Retryable(), retry)
			}
		})
	}
}

func TestRetryAfter(t *testing.T) {
	at := func(d time.Duration) string { return testNow.Add(d).Format(time.RFC3339) }
	tests := []struct {
		name   string
		header http.Header
		want   time.Duration
	}{
		{"nothing gives no hint", respHeader(), 0},
		{"retry-after-ms in milliseconds", respHeader("Retry-After-Ms", "1500"), 1500 * time.Millisecond},
		{"retry-after-ms fractional", respHeader("Retry-After-Ms", "250.5"), 250*time.Millisecond + 500*time.Microsecond},
		{"retry-after-ms wins over retry-after", respHeader("Retry-After-Ms", "100", "Retry-After", "60"), 100 * time.Millisecond},
		{"garbage retry-after-ms falls back to retry-after", respHeader("Retry-After-Ms", "soon", "Retry-After", "2"), 2 * time.Second},
		{"zero retry-after-ms falls back to retry-after", respHeader("Retry-After-Ms", "0", "Retry-After", "2"), 2 * time.Second},
		{"retry-after in seconds", respHeader("Retry-After", "7"), 7 * time.Second},
		{"retry-after fractional seconds", respHeader("Retry-After", "1.5"), 1500 * time.Millisecond},
		{"retry-after HTTP date in the future", respHeader("Retry-After", testNow.Add(90*time.Second).Format(http.TimeFormat)), 90 * time.Second},
		{"retry-after HTTP date in the past gives no hint", respHeader("Retry-After", testNow.Add(-time.Minute).Format(http.TimeFormat)), 0},
		{"retry-after HTTP date equal to now gives no hint", respHeader("Retry-After", testNow.Format(http.TimeFormat)), 0},
		{"retry-after garbage gives no hint", respHeader("Retry-After", "in a while"), 0},
		{"retry-after zero gives no hint", respHeader("Retry-After", "0"), 0},
		{"retry-after negative gives no hint", respHeader("Retry-After", "-5"), 0},
		{
			"ratelimit reset of the exhausted limit",
			respHeader("Anthropic-Ratelimit-Tokens-Remaining", "0", "Anthropic-Ratelimit-Tokens-Reset", at(20*time.Second),
				"Anthropic-Ratelimit-Requests-Remaining", "41", "Anthropic-Ratelimit-Requests-Reset", at(3*time.Second)),
			20 * time.Second,
		},
		{
			"ratelimit reset: latest among exhausted limits",
			respHeader("Anthropic-Ratelimit-Input-Tokens-Remaining", "0", "Anthropic-Ratelimit-Input-Tokens-Reset", at(8*time.Second),
				"Anthropic-Ratelimit-Output-Tokens-Remaining", "0", "Anthropic-Ratelimit-Output-Tokens-Reset", at(40*time.Second),
				"Anthropic-Ratelimit-Requests-Remaining", "5", "Anthropic-Ratelimit-Requests-Reset", at(2*time.Second)),
			40 * time.Second,
		},
		{
			"ratelimit reset: earliest when none is exhausted",
			respHeader("Anthropic-Ratelimit-Tokens-Remaining", "10", "Anthropic-Ratelimit-Tokens-Reset", at(20*time.Second),
				"Anthropic-Ratelimit-Requests-Remaining", "3", "Anthropic-Ratelimit-Requests-Reset", at(4*time.Second)),
			4 * time.Second,
		},
		{
			"ratelimit reset in the past is ignored",
			respHeader("Anthropic-Ratelimit-Requests-Remaining", "0", "Anthropic-Ratelimit-Requests-Reset", at(-10*time.Second),
				"Anthropic-Ratelimit-Tokens-Remaining", "9", "Anthropic-Ratelimit-Tokens-Reset", at(6*time.Second)),
			6 * time.Second,
		},
		{
			"ratelimit reset that is not RFC 3339 is ignored",
			respHeader("Anthropic-Ratelimit-Requests-Remaining", "0", "Anthropic-Ratelimit-Requests-Reset", "tomorrow"),
			0,
		},
		{
			"retry-after wins over ratelimit resets",
			respHeader("Retry-After", "9", "Anthropic-Ratelimit-Tokens-Remaining", "0", "Anthropic-Ratelimit-Tokens-Reset", at(50*time.Second)),
			9 * time.Second,
		},
		{
			"past retry-after date falls back to ratelimit reset",
			respHeader("Retry-After", testNow.Add(-time.Minute).Format(http.TimeFormat),
				"Anthropic-Ratelimit-Tokens-Remaining", "0", "Anthropic-Ratelimit-Tokens-Reset", at(50*time.Second)),
			50 * time.Second,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := retryAfter(tt.header, testNow); got != tt.want {
				t.Errorf("retryAfter = %v, want %v", got, tt.want)
			}
		})
	}
}

// A hint too large for a time.Duration must not wrap around to a negative
// wait (which would read as "no hint"): it is clamped, and the cooldown cap
// applies later. A hint that is not a finite number is no hint.
func TestRetryAfterHugeHintIsClamped(t *testing.T) {
	for _, tt := range []struct {
		header http.Header
		want   time.Duration
	}{
		{respHeader("Retry-After", "10000000000"), maxRetryHint},
		{respHeader("Retry-After-Ms", "1e16"), maxRetryHint},
		{respHeader("Retry-After", "Inf"), 0},
		{respHeader("Retry-After-Ms", "NaN"), 0},
		{respHeader("Retry-After", "Sun, 06 Nov 2994 08:49:37 GMT"), maxRetryHint},
	} {
		if got := retryAfter(tt.header, testNow); got != tt.want {
			t.Errorf("retryAfter(%v) = %v, want %v", tt.header, got, tt.want)
		}
	}
}

func TestClassifyStreamError(t *testing.T) {
	tests := []struct {
		errType string
		want    outcome
	}{
		{"overloaded_error", outcomeOverloaded},
		{"rate_limit_error", outcomeRateLimited},
		{"api_error", outcomeTransient},
		{"timeout_error", outcomeTransient},
		{"authentication_error", outcomeAuth},
		{"permission_error", outcomeAuth},
		{"billing_error", outcomeAuth},
		{"invalid_request_error", outcomeClientError},
		{"not_found_error", outcomeClientError},
		{"request_too_large", outcomeClientError},
		{"something_new", outcomeClientError},
	}
	for _, tt := range tests {
		t.Run(tt.errType+" is "+tt.want.String(), func(t *testing.T) {
			data := `{"type":"error","error":{"type":"` + tt.errType + `","message":"x"}}`
			v := classifyStreamError([]byte(data))
			if v.outcome != tt.want {
				t.Errorf("outcome = %v, want %v", v.outcome, tt.want)
			}
			if v.reason != "stream error "+tt.errType {
				t.Errorf("reason = %q", v.reason)
			}
		})
	}
	t.Run("data that is not JSON passes through", func(t *testing.T) {
		if v := classifyStreamError([]byte("overloaded_error")); v.outcome != outcomeClientError {
			t.Errorf("outcome = %v, want client_error", v.outcome)
		}
	})
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func TestClassifyError(t *testing.T) {
	canceledWith := func(cause error) context.Context {
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(cause)
		return ctx
	}
	clientGone, cancel := context.WithCancel(context.Background())
	cancel()
	live := context.Background()
	dial := reverseproxy.NewDialError(&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connect: connection refused")})

	tests := []struct {
		name        string
		ctx         context.Context // the attempt's
		clientCtx   context.Context
		err         error
		want        outcome
		wantTimeout bool
		wantReason  string // prefix
	}{
		{name: "dial error is transient", ctx: live, clientCtx: live, err: dial, want: outcomeTransient, wantReason: "dial: "},
		{name: "wrapped dial error is still a dial error", ctx: live, clientCtx: live, err: fmt.Errorf("round trip: %w", dial), want: outcomeTransient, wantReason: "dial: "},
		{name: "connection reset is transient", ctx: live, clientCtx: live, err: errors.New("read: connection reset by peer"), want: outcomeTransient, wantReason: "read: connection reset by peer"},
		{name: "unexpected EOF is transient", ctx: live, clientCtx: live, err: io.ErrUnexpectedEOF, want: outcomeTransient, wantReason: "unexpected EOF"},
		{name: "network timeout is a transient timeout", ctx: live, clientCtx: live, err: &net.OpError{Op: "read", Err: timeoutErr{}}, want: outcomeTransient, wantTimeout: true},
		{name: "deadline exceeded is a transient timeout", ctx: live, clientCtx: live, err: os.ErrDeadlineExceeded, want: outcomeTransient, wantTimeout: true},
		{name: "client gone is canceled", ctx: clientGone, clientCtx: clientGone, err: context.Canceled, want: outcomeCanceled, wantReason: "client canceled"},
		{name: "client gone wins over a dial error", ctx: clientGone, clientCtx: clientGone, err: dial, want: outcomeCanceled},
		{name: "client gone wins over the relay's own timeout", ctx: canceledWith(errFirstByteTimeout), clientCtx: clientGone, err: context.Canceled, want: outcomeCanceled},
		{name: "first byte timeout", ctx: canceledWith(errFirstByteTimeout), clientCtx: live, err: context.Canceled, want: outcomeTransient, wantTimeout: true, wantReason: "first byte timeout"},
		{name: "first content timeout", ctx: canceledWith(errFirstContentTimeout), clientCtx: live, err: context.Canceled, want: outcomeTransient, wantTimeout: true, wantReason: "first content timeout"},
		{name: "response timeout", ctx: canceledWith(errResponseTimeout), clientCtx: live, err: context.Canceled, want: outcomeTransient, wantTimeout: true, wantReason: "response timeout"},
		{name: "stream idle timeout", ctx: canceledWith(errStreamIdle), clientCtx: live, err: io.ErrUnexpectedEOF, want: outcomeTransient, wantTimeout: true, wantReason: "stream idle timeout"},
		{name: "another cancel cause is an ordinary failure", ctx: canceledWith(errors.New("something else")), clientCtx: live, err: errors.New("boom"), want: outcomeTransient, wantReason: "boom"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			v := classifyError(tt.ctx, tt.clientCtx, tt.err)
			if v.outcome != tt.want {
				t.Errorf("outcome = %v, want %v", v.outcome, tt.want)
			}
			if v.timeout != tt.wantTimeout {
				t.Errorf("timeout = %v, want %v", v.timeout, tt.wantTimeout)
			}
			if !strings.HasPrefix(v.reason, tt.wantReason) {
				t.Errorf("reason = %q, want prefix %q", v.reason, tt.wantReason)
			}
		})
	}
}

// FuzzRetryAfter checks the retry hints on any header values: never a
// panic, never a negative wait, never more than maxRetryHint.
// Long run: go test -run '^$' -fuzz FuzzRetryAfter -fuzztime 10m .
func FuzzRetryAfter(f *testing.F) {
	f.Add("750", "3", "0", "2026-11-30T12:00:30Z")
	f.Add("", "Mon, 30 Nov 2026 12:01:00 GMT", "", "")
	f.Add("1e309", "NaN", "0", "9999-12-31T23:59:59Z")
	f.Add("-5", "-1", "0", "2026-11-30T11:00:00Z")
	f.Add("0.5", "99999999999999999999", "1", "not a time")
	f.Fuzz(func(t *testing.T, ms, secs, remaining, reset string) {
		h := http.Header{}
		for k, v := range map[string]string{"Retry-After-Ms": ms, "Retry-After": secs,
			"Anthropic-Ratelimit-Tokens-Remaining": remaining, "Anthropic-Ratelimit-Tokens-Reset": reset} {
			if v != "" {
				h.Set(k, v)
			}
		}
		if d := retryAfter(h, testNow); d < 0 || d > maxRetryHint {
			t.Fatalf("retryAfter = %v for %v", d, h)
		}
	})
}

func TestTheTableDerivesEveryLookup(t *testing.T) {
	for _, c := range classes {
		if got := statusOutcome(c.status); got != c.outcome {
			t.Errorf("statusOutcome(%d) = %v, want %v", c.status, got, c.outcome)
		}
		if c.typ == "" {
			continue
		}
		if got := typeOutcome(c.typ); got != c.outcome {
			t.Errorf("typeOutcome(%q) = %v, want %v: a stream error and a status must mean the same", c.typ, got, c.outcome)
		}
		if got := provider.ErrorType(c.status); got != c.typ {
			t.Errorf("provider.ErrorType(%d) = %q, want %q: a provider's errors must mean what the table says", c.status, got, c.typ)
		}
	}
	for status, want := range map[int]string{418: "invalid_request_error", 507: "api_error", 502: "api_error"} {
		if got := provider.ErrorType(status); got != want {
			t.Errorf("provider.ErrorType(%d) = %q, want %q", status, got, want)
		}
	}
	if typeOutcome("") != outcomeClientError || typeOutcome("no_such_error") != outcomeClientError {
		t.Errorf("an unknown stream error type must be the request's own")
	}
}

// twoGroups renders a free key and a production key whose groups share the
// same channels.
func twoGroups(channels string) string {
	return "\t\tkey sk-free-tenant-0123456789 free\n\t\tkey " + clientKey + " production\n" +
		"\t\tgroup free {\n\t\t\tchannels " + channels + "\n\t\t}\n" +
		"\t\tgroup production {\n\t\t\tchannels " + channels + "\n\t\t}\n"
}

// echoBeta answers as Anthropic does when a request carries an
// anthropic-beta value it does not know: a 400 whose message quotes it.
func echoBeta(w http.ResponseWriter, r *http.Request) {
	if beta := r.Header.Get("Anthropic-Beta"); beta != "" {
		fakeupstream.Error(400, "invalid_request_error",
			"Unexpected value(s) `"+beta+"` for the `anthropic-beta` header. Please consult our documentation at docs.claude.com or try again without the header.")(w, r)
		return
	}
	fakeupstream.Message("served")(w, r)
}

func TestAHeaderCannotCoolASharedChannel(t *testing.T) {
	a, b := fakeupstream.New(t, http.HandlerFunc(echoBeta)), fakeupstream.New(t, http.HandlerFunc(echoBeta))
	startRelay(t, channelBlock("hostile-beta-a", a.URL)+channelBlock("hostile-beta-b", b.URL)+twoGroups("hostile-beta-a hostile-beta-b"))

	for _, beta := range []string{"credit balance is too low", "Your credit balance is too low", "CREDIT BALANCE IS TOO LOW"} {
		r := send(t, http.MethodPost, "/v1/messages", "sk-free-tenant-0123456789", simpleBody, "Anthropic-Beta", beta)
		if r.status != 400 || !strings.Contains(string(r.body), beta) {
			t.Fatalf("the upstream's 400 should reach the client as it is: %d %s", r.status, r.body)
		}
		if r.header.Get("X-Relay-Attempts") != "" {
			t.Errorf("a client error was retried: x-relay-attempts %s", r.header.Get("X-Relay-Attempts"))
		}
	}
	for name, st := range channels(t) {
		if strings.HasPrefix(name, "hostile-beta-") && (st.State != stateHealthy || st.CooldownUntil != nil) {
			t.Errorf("%s was cooled by a request header: %+v", name, st)
		}
	}
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("the production key lost its channels to another tenant's header: %d %s", r.status, r.body)
	}
}

func TestTheRealBillingErrorStillCools(t *testing.T) {
	broke := fakeupstream.New(t, fakeupstream.Error(400, "invalid_request_error",
		"Your credit balance is too low to access the Anthropic API. Please go to Plans & Billing to upgrade or purchase credits."))
	ok := fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, channelBlock("hostile-bill-a", broke.URL, "priority 1")+channelBlock("hostile-bill-b", ok.URL, "priority 2")+
		keyAndGroup("hostile-bill", "hostile-bill-a hostile-bill-b"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("failover: %d %s", r.status, r.body)
	}
	st := channels(t)["hostile-bill-a"]
	if st.LastError != "auth" || st.CooldownUntil == nil || time.Until(*st.CooldownUntil) < 29*time.Minute {
		t.Errorf("an account out of credit should cool for auth_cooldown: %+v", st)
	}
}

// TestProvidersErrorsAreClassified: each built-in provider turns its
// upstream's errors into Anthropic's (its own tests check how), and the
// classification table takes those as it takes Anthropic's own: a
// throttled Bedrock is rate limited, an unavailable Vertex overloaded, an
// OpenAI-format quota error the account's.
func TestProvidersErrorsAreClassified(t *testing.T) {
	for name, tt := range map[string]struct {
		p     provider.Provider
		cases []providertest.ErrorCase
	}{
		"bedrock": {&bedrock.Provider{}, providertest.BedrockErrors},
		"vertex":  {&vertex.Provider{}, providertest.VertexErrors},
		"openai":  {&openaiprovider.Provider{}, providertest.OpenAIErrors},
	} {
		for _, c := range tt.cases {
			t.Run(name+"/"+c.Name, func(t *testing.T) {
				out, err := tt.p.Response(c.Response(), &provider.Call{Path: provider.PathMessages})
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(out.Body)
				if v := classifyStatus(out.StatusCode, out.Header, body, time.Now()); v.outcome.String() != c.Outcome {
					t.Errorf("classified %s, want %s", v.outcome, c.Outcome)
				}
			})
		}
	}
}
