package openai

// stopReasons pairs Messages' stop reasons with Chat Completions' finish
// reasons: one table, read both ways. Each way takes the first row that
// matches, so a reason several rows share (stop, length, tool_use) goes
// back to the first of them.
var stopReasons = [...]struct{ stop, finish string }{
	{"end_turn", "stop"},
	{"stop_sequence", "stop"},
	{"pause_turn", "stop"},
	{"max_tokens", "length"},
	{"model_context_window_exceeded", "length"},
	{"tool_use", "tool_calls"},
	{"tool_use", "function_call"}, // the deprecated name, read only
	{"refusal", "content_filter"},
}

// finishReason is the finish reason of a Messages stop reason; stop for
// one it does not know.
func finishReason(stop string) string {
	for _, r := range stopReasons {
		if r.stop == stop {
			return r.finish
		}
	}
	return "stop"
}

// stopReason is the stop reason of a Chat Completions finish reason;
// end_turn for one it does not know.
func stopReason(finish string) string {
	for _, r := range stopReasons {
		if r.finish == finish {
			return r.stop
		}
	}
	return "end_turn"
}
