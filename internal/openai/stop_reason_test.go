package openai

import "testing"

// TestStopReasonsBothWays: one table serves both directions; a reason
// several rows share goes back to the first of them, and an unknown one
// to the plainest.
func TestStopReasonsBothWays(t *testing.T) {
	for stop, finish := range map[string]string{
		"end_turn":                      "stop",
		"stop_sequence":                 "stop",
		"pause_turn":                    "stop",
		"max_tokens":                    "length",
		"model_context_window_exceeded": "length",
		"tool_use":                      "tool_calls",
		"refusal":                       "content_filter",
		"something_new":                 "stop",
		"":                              "stop",
	} {
		if got := finishReason(stop); got != finish {
			t.Errorf("finishReason(%q) = %q, want %q", stop, got, finish)
		}
	}
	for finish, stop := range map[string]string{
		"stop":           "end_turn",
		"length":         "max_tokens",
		"tool_calls":     "tool_use",
		"function_call":  "tool_use",
		"content_filter": "refusal",
		"something_new":  "end_turn",
		"":               "end_turn",
	} {
		if got := stopReason(finish); got != stop {
			t.Errorf("stopReason(%q) = %q, want %q", finish, got, stop)
		}
	}
}
