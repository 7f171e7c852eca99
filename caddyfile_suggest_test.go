package relay

import (
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/suggest"
)

// TestNoSuggestionFarFromEveryOption: a word close to no option of the
// relay block gets no "did you mean".
func TestNoSuggestionFarFromEveryOption(t *testing.T) {
	if s := suggest.DidYouMean("colour", relayOptions, tuningNames()); s != "" {
		t.Errorf("a word close to no option got a suggestion: %s", s)
	}
}

// TestSuggestedOptionsAreOptions keeps the lists that suggestions come from
// in step with the parser: each name in them is an option it knows.
func TestSuggestedOptionsAreOptions(t *testing.T) {
	for _, c := range []struct {
		where string
		names []string
		input func(string) string
	}{
		{"relay", relayOptions, func(o string) string { return "relay {\n\t" + o + "\n}\n" }},
		{"channel", channelOptions, func(o string) string {
			return caddyfileWith("", "channel a {\n\tprovider mock\n\t"+o+"\n}\n", "")
		}},
		{"group", groupOptions, func(o string) string { return caddyfileWith("", "", "group g {\n\tchannels a\n\t"+o+"\n}\n") }},
	} {
		for _, name := range c.names {
			if _, err := parseRelay(t, c.input(name)); err != nil && strings.Contains(err.Error(), "unrecognized") {
				t.Errorf("%s option %q is suggested but not recognized: %v", c.where, name, err)
			}
		}
	}
}

// TestCaddyfileTyposSuggestAnOption: an unrecognized option one or two
// edits from a known one says which.
func TestCaddyfileTyposSuggestAnOption(t *testing.T) {
	for _, tt := range []struct {
		name  string
		input string
		want  []string
	}{
		{
			name:  "a relay option's typo",
			input: "relay {\n\tmax_body_szie 1MB\n}\n",
			want:  []string{`unrecognized relay option "max_body_szie" (did you mean "max_body_size"?)`, "Testfile:2"},
		},
		{
			name:  "a channel option's typo",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tpriorty 2\n}\n", ""),
			want:  []string{`unrecognized channel option "priorty" (did you mean "priority"?)`},
		},
		{
			name:  "a provider option's typo",
			input: caddyfileWith("", "channel a {\n\tapi_kye {env.A}\n}\n", ""),
			want:  []string{`unrecognized channel option "api_kye" (did you mean "api_key"?)`},
		},
		{
			name:  "a group option's typo",
			input: caddyfileWith("", "", "group g {\n\tchannels a\n\tretires 2\n}\n"),
			want:  []string{`unrecognized group option "retires" (did you mean "retries"?)`},
		},
		{
			name:  "a key option's typo",
			input: caddyfileWith("key sk-test g {\n\tconcurency 2\n}\n", "", ""),
			want:  []string{`unrecognized key option "concurency" (did you mean "concurrency"?)`},
		},
	} {
		_, err := parseRelay(t, tt.input)
		if err == nil {
			t.Errorf("%s: parsed without error", tt.name)
			continue
		}
		for _, w := range tt.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q does not mention %q", tt.name, err, w)
			}
		}
	}
}
