package provider

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestErrorTypesAndStatusesAgree(t *testing.T) {
	for status, typ := range errorTypes {
		if got, ok := ErrorStatus(typ); !ok || got != status {
			t.Errorf("ErrorStatus(%q) = %d, want %d", typ, got, status)
		}
	}
	for status, want := range map[int]string{418: "invalid_request_error", 502: "api_error", 529: "overloaded_error"} {
		if got := ErrorType(status); got != want {
			t.Errorf("ErrorType(%d) = %q, want %q", status, got, want)
		}
	}
	if _, ok := ErrorStatus("relay_error"); ok {
		t.Error("a type that is not Anthropic's has a status")
	}
}

func TestUpstreamErrorResponse(t *testing.T) {
	up := &http.Response{StatusCode: 400, Header: http.Header{"Retry-After": {"7"}}, Body: io.NopCloser(strings.NewReader("<xml/>"))}
	out := UpstreamError{Status: 403, Message: "cloud: AccessDenied: <model>", RequestID: "req_1", RefusesModel: true}.Response(up)
	body, _ := io.ReadAll(out.Body)
	if want := `{"type":"error","error":{"type":"permission_error","message":"cloud: AccessDenied: \u003cmodel\u003e"},"request_id":"req_1"}`; string(body) != want {
		t.Errorf("body %s\nwant %s", body, want)
	}
	if out.StatusCode != 403 || out.Status != "403 Forbidden" || out.Header.Get("Retry-After") != "7" ||
		out.Header.Get("Content-Type") != "application/json" || out.ContentLength != int64(len(body)) {
		t.Errorf("response %d %q %v (%d)", out.StatusCode, out.Status, out.Header, out.ContentLength)
	}
	if !RefusesModel(out) || RefusesModel(up) {
		t.Error("the refusal of the model is not told apart")
	}
	if up.Header.Get("Content-Type") != "" {
		t.Error("the upstream's headers were changed in place")
	}
	if ev := string(ErrorEvent("api_error", "x", "")); ev != "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",\"message\":\"x\"}}\n\n" {
		t.Errorf("event %q", ev)
	}
}
