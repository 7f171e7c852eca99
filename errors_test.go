package relay

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/sse"
	"github.com/caddy-relay/relay/provider"
)

func TestRelayErrorBodyIsAnthropicShape(t *testing.T) {
	tests := []struct {
		name string
		err  *relayError
		want map[string]any
	}{
		{
			name: "authentication error has no code",
			err:  errAuth("invalid relay key"),
			want: map[string]any{
				"type":       "error",
				"error":      map[string]any{"type": "authentication_error", "message": "invalid relay key"},
				"request_id": "relay_abc",
			},
		},
		{
			name: "relay's own condition carries a code",
			err:  errModelNotFound("claude-x", &group{name: "prod", models: []string{"claude-sonnet-5-5", "claude-haiku-5-5"}}),
			want: map[string]any{
				"type":       "error",
				"error":      map[string]any{"type": "relay_error", "message": `no channel of group "prod" serves model "claude-x"; it serves claude-sonnet-5-5, claude-haiku-5-5`, "code": "model_not_found"},
				"request_id": "relay_abc",
			},
		},
		{
			name: "message with quotes and newlines stays valid JSON",
			err:  errInvalid("bad \"model\"\n<value>"),
			want: map[string]any{
				"type":       "error",
				"error":      map[string]any{"type": "invalid_request_error", "message": "bad \"model\"\n<value>"},
				"request_id": "relay_abc",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := tt.err.body("relay_abc")
			var got map[string]any
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatalf("body is not JSON: %v\n%s", err, b)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("body = %s\nwant %v", b, tt.want)
			}
		})
	}
}

func TestRelayErrorWrite(t *testing.T) {
	tests := []struct {
		name       string
		err        *relayError
		wantStatus int
		wantHeader map[string]string // "" means absent
	}{
		{
			name:       "no healthy channel rounds retry-after up",
			err:        errNoHealthyChannel("m", 1500*time.Millisecond),
			wantStatus: 503,
			wantHeader: map[string]string{"Retry-After": "2", "Retry-After-Ms": "1500", "X-Should-Retry": "", "Allow": ""},
		},
		{
			name:       "retry-after is at least one second",
			err:        errNoHealthyChannel("m", 200*time.Millisecond),
			wantStatus: 503,
			wantHeader: map[string]string{"Retry-After": "1", "Retry-After-Ms": "200"},
		},
		{
			name:       "whole seconds stay whole",
			err:        errNoHealthyChannel("m", 3*time.Second),
			wantStatus: 503,
			wantHeader: map[string]string{"Retry-After": "3", "Retry-After-Ms": "3000"},
		},
		{
			name:       "model not found tells the SDK not to retry",
			err:        errModelNotFound("m", &group{name: "g"}),
			wantStatus: 503,
			wantHeader: map[string]string{"X-Should-Retry": "false", "Retry-After": "", "Retry-After-Ms": ""},
		},
		{
			name:       "capability not available tells the SDK not to retry",
			err:        errCapability([]string{"service_tier"}, false, "g"),
			wantStatus: 503,
			wantHeader: map[string]string{"X-Should-Retry": "false"},
		},
		{
			name:       "method not allowed sets Allow",
			err:        errMethod("GET", "POST"),
			wantStatus: 405,
			wantHeader: map[string]string{"Allow": "POST", "X-Should-Retry": "", "Retry-After": ""},
		},
		{
			name:       "plain error sets none of the optional headers",
			err:        errAuth("missing"),
			wantStatus: 401,
			wantHeader: map[string]string{"Allow": "", "X-Should-Retry": "", "Retry-After": "", "Retry-After-Ms": ""},
		},
		{
			name:       "too large",
			err:        errTooLarge("max_body_size", 1024),
			wantStatus: 413,
			wantHeader: map[string]string{"Allow": ""},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			tt.err.write(rec, "relay_req1")
			if rec.Code != tt.wantStatus {
				t.Errorf("status = %d, want %d", rec.Code, tt.wantStatus)
			}
			if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type = %q", ct)
			}
			for k, want := range tt.wantHeader {
				if got := rec.Header().Get(k); got != want {
					t.Errorf("%s = %q, want %q", k, got, want)
				}
			}
			body := rec.Body.Bytes()
			if cl := rec.Header().Get("Content-Length"); cl != strconv.Itoa(len(body)) {
				t.Errorf("Content-Length = %s, body is %d bytes", cl, len(body))
			}
			if string(body) != string(tt.err.body("relay_req1")) {
				t.Errorf("body = %s, want %s", body, tt.err.body("relay_req1"))
			}
			var j errorJSON
			if err := json.Unmarshal(body, &j); err != nil || j.Type != "error" || j.Error.Type != tt.err.typ || j.RequestID != "relay_req1" {
				t.Errorf("body %s does not decode to the error (%v)", body, err)
			}
		})
	}
}

func TestAnUnknownModelListsAFewOfTheGroupsModels(t *testing.T) {
	var models []string
	for i := range 13 {
		models = append(models, fmt.Sprintf("m%d", i))
	}
	msg := errModelNotFound("x", &group{name: "g", models: models}).msg
	if want := `no channel of group "g" serves model "x"; it serves m0, m1, m2, m3, m4, m5, m6, m7, m8, m9 and 3 more (GET /v1/models lists them all)`; msg != want {
		t.Errorf("got  %s\nwant %s", msg, want)
	}
}

func TestTooLargeNamesItsOptionInMiB(t *testing.T) {
	for _, tt := range []struct {
		option string
		limit  int64
		want   string
	}{
		{"max_body_size", 32 << 20, "the relay's max_body_size of 32 MiB (33554432 bytes)"},
		{"max_upload_size", 500_000_000, "the relay's max_upload_size of 476.84 MiB (500000000 bytes)"},
		{"max_body_size", 1536, "the relay's max_body_size of 1.5 KiB (1536 bytes)"},
	} {
		if msg := errTooLarge(tt.option, tt.limit).msg; !strings.Contains(msg, tt.want) {
			t.Errorf("%s %d: %s", tt.option, tt.limit, msg)
		}
	}
}

func TestSSEError(t *testing.T) {
	out := sseError("overloaded_error", "upstream \"died\"\nmid-stream", "relay_xyz")
	const prefix = "event: error\ndata: "
	if !strings.HasPrefix(string(out), prefix) || !strings.HasSuffix(string(out), "\n\n") {
		t.Fatalf("frame = %q, want %q...\\n\\n", out, prefix)
	}
	data := out[len(prefix) : len(out)-2]
	if strings.Contains(string(data), "\n") {
		t.Fatalf("data spans several lines: %q", data)
	}
	var got map[string]any
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatalf("data is not JSON: %v: %s", err, data)
	}
	want := map[string]any{
		"type":       "error",
		"error":      map[string]any{"type": "overloaded_error", "message": "upstream \"died\"\nmid-stream"},
		"request_id": "relay_xyz",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("data = %s, want %v", data, want)
	}

	// An SSE client sees exactly one complete `error` event.
	rd := sse.NewReader(strings.NewReader(string(out)), 1<<20)
	ev, err := rd.Next()
	if err != nil || string(ev.Name) != "error" || string(ev.Data) != string(data) || string(ev.Raw) != string(out) {
		t.Errorf("read back as event %q / %q (err %v)", ev.Name, ev.Data, err)
	}
	if _, err := rd.Next(); err != io.EOF {
		t.Errorf("after the frame: %v, want io.EOF", err)
	}
}

// TestAProvidersErrorsAreTheRelays: a provider's Anthropic errors
// (package provider) and the relay's own are the same bytes.
func TestAProvidersErrorsAreTheRelays(t *testing.T) {
	for _, requestID := range []string{"", "req_1"} {
		e := &relayError{typ: "rate_limit_error", msg: `slow <down> "now"`}
		if got, want := provider.ErrorBody(e.typ, e.msg, requestID), e.body(requestID); string(got) != string(want) {
			t.Errorf("provider.ErrorBody = %s, the relay's %s", got, want)
		}
		if got, want := provider.ErrorEvent(e.typ, e.msg, requestID), sseError(e.typ, e.msg, requestID); string(got) != string(want) {
			t.Errorf("provider.ErrorEvent = %q, the relay's %q", got, want)
		}
	}
}
