//go:build !linux

package ledger

import "time"

// threadCPU is 0 where the relay does not read a thread's CPU time:
// relay_ledger_writer_cpu_seconds_total stays 0 there.
func threadCPU() time.Duration { return 0 }
