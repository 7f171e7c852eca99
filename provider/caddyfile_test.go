package provider

import (
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestUnmarshalOptions(t *testing.T) {
	var (
		s       string
		l       []string
		n       int
		d       caddy.Duration
		r       float64
		checked bool
	)
	o := Options{Strings: map[string]*string{"url": &s}, Lists: map[string]*[]string{"betas": &l},
		Ints: map[string]*int{"tokens": &n}, Durations: map[string]*caddy.Duration{"latency": &d}, Ratios: map[string]*float64{"fail_rate": &r}}
	d0 := caddyfile.NewTestDispenser("p {\n url http://x\n betas a b\n betas c\n tokens 3\n latency 50ms\n fail_rate 20%\n}")
	if err := UnmarshalOptions(d0, o, func() error { checked = true; return nil }); err != nil {
		t.Fatal(err)
	}
	if s != "http://x" || strings.Join(l, " ") != "a b c" || n != 3 || time.Duration(d) != 50*time.Millisecond || r != 0.2 || !checked {
		t.Errorf("read %q %q %d %v %v (checked %v)", s, l, n, d, r, checked)
	}
	for src, want := range map[string]string{
		"p {\n nope 1\n}":             `unrecognized channel option "nope" (provider p has no such option either)`,
		"p {\n tokens x\n}":           `tokens: "x" is not an integer`,
		"p {\n fail_rate 120%\n}":     "is not between 0 and 1",
		"p {\n url\n}":                "wrong argument count",
		"p extra {\n url http://x\n}": "wrong argument count",
	} {
		err := UnmarshalOptions(caddyfile.NewTestDispenser(src), o, nil)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want %q", src, err, want)
		}
	}
}
