package relay

import (
	"slices"
	"strings"
	"testing"
)

func TestModelClasses(t *testing.T) {
	ch := &channel{classRows: newPricebook(map[string]Price{"my-finetune": {Input: 1, Output: 2}}).classRows()}
	for id, want := range map[string]string{
		"claude-opus-4-1":                                 "opus",
		"claude-opus-4-1-20250805":                        "opus",
		"us.anthropic.claude-opus-4-1-20250805-v1:0":      "opus",
		"claude-sonnet-4-5@20250929":                      "sonnet",
		"anthropic.claude-3-5-sonnet-20241022-v2:0":       "sonnet",
		"claude-haiku-4-5":                                "haiku",
		"claude-fable-5-1":                                "claude-fable-5-1",
		"claude-fable-5-1-20260301":                       "claude-fable-5-1",
		"claude-fable-5":                                  "claude-fable-5",
		"my-finetune":                                     "my-finetune",
		"claude-opusx-1":                                  "other", // not the word opus
		"magnum-opus":                                     "opus",
		"some-model-nobody-lists":                         "other",
		"arn:aws:bedrock:us-east-1:1:inference-profile/x": "other",
	} {
		if got := ch.classify(id, false); got != want {
			t.Errorf("class of %q = %q, want %q", id, got, want)
		}
	}
	if got := ch.classify("my-own-model", true); got != "my-own-model" {
		t.Errorf("a listed model none of the rules names is a class of its own, got %q", got)
	}

	// model_class lines come first, and match the upstream id
	ch.classRules = []ModelClass{{Match: "*fast*", Class: "fast"}, {Match: "claude-*-4-5", Class: "gen45"}}
	for id, want := range map[string]string{"claude-sonnet-4-5": "gen45", "claude-haiku-fast": "fast", "claude-opus-4-1": "opus"} {
		if got := ch.classify(id, false); got != want {
			t.Errorf("with rules, class of %q = %q, want %q", id, got, want)
		}
	}

	// the class of a request is the class of the upstream id it is mapped to
	ch = &channel{}
	ch.models, _ = parseModels([]string{"big=us.anthropic.claude-opus-4-1-v1:0", "small=claude-haiku-4-5", "mine=vendor-model-7"})
	ch.provisionClasses(nil, newPricebook(nil).classRows())
	for model, want := range map[string]string{"big": "opus", "small": "haiku", "mine": "vendor-model-7"} {
		if got := ch.classOf(model); got != want {
			t.Errorf("class of %q on a mapping channel = %q, want %q", model, got, want)
		}
	}
	if !slices.Equal(ch.classNames, []string{"haiku", "opus", "vendor-model-7"}) {
		t.Errorf("the class labels of a listing channel: %v", ch.classNames)
	}
}

func TestGlobMatch(t *testing.T) {
	for _, c := range []struct {
		pattern, s string
		want       bool
	}{
		{"*", "", true}, {"*", "anything/at:all", true}, {"a*", "a", true}, {"a*", "ba", false},
		{"*opus*", "us.anthropic.claude-opus-4-1-v1:0", true}, {"*opus*", "claude-sonnet", false},
		{"claude-*-4-5", "claude-sonnet-4-5", true}, {"claude-*-4-5", "claude-sonnet-4-5-x", false},
		{"a*b*c", "aXbYbZc", true}, {"a*b*c", "aXbYbZ", false}, {"abc", "abc", true}, {"abc", "abcd", false},
		{"**x", "yyx", true}, {"x**", "x", true},
	} {
		if got := globMatch(c.pattern, c.s); got != c.want {
			t.Errorf("globMatch(%q, %q) = %v, want %v", c.pattern, c.s, got, c.want)
		}
	}
}

func TestModelClassLines(t *testing.T) {
	for _, c := range []struct {
		m   ModelClass
		bad string
	}{
		{ModelClass{Match: "*opus*", Class: "opus"}, ""},
		{ModelClass{Match: "*", Class: "all"}, ""},
		{ModelClass{Match: "", Class: "x"}, "glob"},
		{ModelClass{Match: "a b", Class: "x"}, "only letters"},
		{ModelClass{Match: "*opus*", Class: "a/b"}, "want letters"},
		{ModelClass{Match: "*opus*", Class: "other"}, "no line names"},
	} {
		err := c.m.validate()
		if c.bad == "" && err != nil || c.bad != "" && (err == nil || !strings.Contains(err.Error(), c.bad)) {
			t.Errorf("%+v: %v, want %q", c.m, err, c.bad)
		}
	}
}

func TestModelClassInTheCaddyfile(t *testing.T) {
	r, err := parseRelay(t, "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel a {\n\t\tapi_key {env.A}\n"+
		"\t\tmodel_class *opus* big\n\t\tmodel_class claude-*-fast fast\n\t}\n\tgroup prod {\n\t\tchannels a\n\t}\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := r.Channels[0].ModelClasses, []ModelClass{{"*opus*", "big"}, {"claude-*-fast", "fast"}}; !slices.Equal(got, want) {
		t.Fatalf("model_classes %+v, want %+v", got, want)
	}
	base := func(line string) string {
		return "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel a {\n\t\tapi_key {env.A}\n" + line +
			"\t}\n\tgroup prod {\n\t\tchannels a\n\t}\n}\n"
	}
	for name, src := range map[string]string{
		"a class named other":  base("\t\tmodel_class *opus* other # here\n"),
		"a class with a slash": base("\t\tmodel_class *opus* a/b # here\n"),
		"a glob with a quote":  base("\t\tmodel_class *op\"us* big # here\n"),
		"no class":             base("\t\tmodel_class *opus* # here\n"),
		"a third argument":     base("\t\tmodel_class *opus* big more # here\n"),
		"after a good one":     base("\t\tmodel_class *opus* big\n\t\tmodel_class *haiku* other # here\n"),
	} {
		wantErrorAtMarkedLine(t, name, src)
	}
}
