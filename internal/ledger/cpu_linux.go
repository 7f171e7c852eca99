package ledger

import (
	"time"

	"golang.org/x/sys/unix"
)

// threadCPU is the CPU time, user and system, that the calling thread has
// used; the ledger's writer runs on a thread of its own, whose time is
// then the writer's (relay_ledger_writer_cpu_seconds_total).
func threadCPU() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano())
}
