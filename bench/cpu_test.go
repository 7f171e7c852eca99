package main

import (
	"os"
	"strings"
	"testing"
)

// TestParseStatCPU reads utime+stime from /proc/<pid>/stat lines, one
// whose command name holds spaces and parentheses included: the fields
// are counted from the last ')'.
func TestParseStatCPU(t *testing.T) {
	// fields 3 to 13, then utime, stime, cutime, cstime and the rest
	const rest = " S 1 2 3 0 -1 4194560 1000 0 7 0 %s 0 0 20 0 12 0 5000 1234567 890"
	for _, tc := range []struct {
		name, line string
		want       uint64
	}{
		{"plain", "4242 (caddy-relay)" + strings.Replace(rest, "%s", "250 31", 1), 281},
		{"spaces and parentheses", "4242 (a) b (c) d)" + strings.Replace(rest, "%s", "7 5", 1), 12},
		{"a closing parenthesis last", "4242 ())" + strings.Replace(rest, "%s", "0 1", 1), 1},
		{"children's time is not the process's", "1 (init)" + strings.Replace(rest, "%s 0 0", "3 4 900 900", 1), 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseStatCPU([]byte(tc.line + "\n"))
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("got %d ticks, want %d", got, tc.want)
			}
		})
	}
	for _, bad := range []string{
		"",
		"4242 caddy S 1 2 3",                  // no parenthesis
		"4242 (caddy) S 1 2 3 0 -1 4194560 1", // too short
		"4242 (caddy)" + strings.Replace(rest, "%s", "x 1", 1),
	} {
		if got, err := parseStatCPU([]byte(bad)); err == nil {
			t.Errorf("%q: got %d ticks and no error", bad, got)
		}
	}
}

// TestParseStatCPUOfThisProcess reads the test's own /proc/self/stat.
func TestParseStatCPUOfThisProcess(t *testing.T) {
	stat, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	if _, err := parseStatCPU(stat); err != nil {
		t.Fatal(err)
	}
}
