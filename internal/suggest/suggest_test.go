package suggest

import "testing"

func TestDistance(t *testing.T) {
	for _, tt := range []struct {
		a, b string
		want int
	}{
		{"priority", "priority", 0}, {"priorty", "priority", 1}, {"prioriyt", "priority", 1},
		{"retires", "retries", 1}, {"colour", "cooldown", 4}, {"", "abc", 3},
	} {
		if got := Distance(tt.a, tt.b); got != tt.want {
			t.Errorf("Distance(%q, %q) = %d, want %d", tt.a, tt.b, got, tt.want)
		}
	}
}

func TestDidYouMean(t *testing.T) {
	names := []string{"cooldown", "max_cooldown"}
	for word, want := range map[string]string{
		"coldown":    ` (did you mean "cooldown"?)`,     // one edit
		"cooldwon":   ` (did you mean "cooldown"?)`,     // a swap
		"max_coldwn": ` (did you mean "max_cooldown"?)`, // two edits, a long word
		"cold":       "",                                // two edits, a short word
		"cooldown":   "",                                // the name itself
		"colour":     "",
	} {
		if got := DidYouMean(word, names, nil); got != want {
			t.Errorf("DidYouMean(%q) = %q, want %q", word, got, want)
		}
	}
}
