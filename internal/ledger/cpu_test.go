package ledger

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
)

// spinStore spends spin of CPU on the calling thread at every write.
type spinStore struct {
	*flakyStore
	spin time.Duration
}

func (s spinStore) Write(ctx context.Context, rows []Row) error {
	for start := threadCPU(); threadCPU()-start < s.spin; {
	}
	return s.flakyStore.Write(ctx, rows)
}

// relay_ledger_writer_cpu_seconds_total counts the CPU of the writer's
// thread, what its writes spend, and not the CPU the rest of the process
// spends meanwhile.
func TestLedgerWriterCPUIsItsThreads(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the writer's CPU is read on Linux only")
	}
	const spin = 60 * time.Millisecond
	l := newWriter(spinStore{new(flakyStore), spin}, "test", zap.NewNop(), 100)
	before := testutil.ToFloat64(metricWriterCPU)
	go l.run()
	var stop atomic.Bool
	busy := make(chan time.Duration)
	go func() { // another thread of the process, as busy as the writer
		runtime.LockOSThread()
		start := threadCPU()
		for !stop.Load() {
		}
		busy <- threadCPU() - start
	}()
	for range 10 {
		l.Add(Row{ID: newRequestID()})
	}
	if err := l.Destruct(); err != nil { // writes the rows out
		t.Fatal(err)
	}
	stop.Store(true)
	other := <-busy
	got := time.Duration((testutil.ToFloat64(metricWriterCPU) - before) * float64(time.Second))
	if got < spin {
		t.Fatalf("the writer's CPU counted %s for a write of %s", got, spin)
	}
	// the other thread ran about as long as the write: counted, it would
	// nearly double the figure
	if other >= spin/2 && got > spin+other/2 {
		t.Fatalf("the writer's CPU counted %s for a write of %s, while another thread spent %s", got, spin, other)
	}
}
