package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"time"
)

// clockTick is the unit of the CPU times in /proc/<pid>/stat: 1/USER_HZ
// seconds, where USER_HZ (sysconf(_SC_CLK_TCK)) is 100 on every Linux
// architecture the harness runs on, whatever the kernel's own HZ.
const clockTick = time.Second / 100

// cpuTime is the CPU time the process has used so far, user and system,
// all its threads: utime+stime of /proc/<pid>/stat.
func (p *caddyProcess) cpuTime() (time.Duration, error) {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(p.cmd.Process.Pid) + "/stat")
	if err != nil {
		return 0, err
	}
	ticks, err := parseStatCPU(stat)
	if err != nil {
		return 0, err
	}
	return time.Duration(ticks) * clockTick, nil
}

// parseStatCPU returns utime+stime, in clock ticks, of a /proc/<pid>/stat
// line. Its second field, the command name in parentheses, may hold spaces
// and parentheses of its own, so the fields are counted from the last ')':
// after it come state (field 3), and utime and stime are fields 14 and 15.
func parseStatCPU(stat []byte) (uint64, error) {
	end := bytes.LastIndexByte(stat, ')')
	if end < 0 {
		return 0, fmt.Errorf("no command name in /proc/<pid>/stat: %q", stat)
	}
	fields := bytes.Fields(stat[end+1:])
	const utime, stime = 14 - 3, 15 - 3 // indexes from state, field 3
	if len(fields) <= stime {
		return 0, fmt.Errorf("%d fields after the command name in /proc/<pid>/stat, want more than %d", len(fields), stime)
	}
	var total uint64
	for _, i := range []int{utime, stime} {
		v, err := strconv.ParseUint(string(fields[i]), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/<pid>/stat field %d: %w", i+3, err)
		}
		total += v
	}
	return total, nil
}
