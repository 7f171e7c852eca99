package relay

import (
	"context"
	"errors"
	"testing"
	"time"
)

type leadTestKey struct{}

func newTestLeadCtx(parent context.Context) *leadCtx {
	lc := &leadCtx{client: parent}
	lc.after = lc.afterBuf[:0]
	return lc
}

// A lead's context keeps its client's values but not its end, ends once,
// and ends what the context package derives from it, through its
// AfterFunc, without a goroutine per child.
func TestLeadContextEndsItsChildren(t *testing.T) {
	client, leave := context.WithCancel(context.WithValue(context.Background(), leadTestKey{}, "v"))
	lc := newTestLeadCtx(client)
	if lc.Value(leadTestKey{}) != "v" {
		t.Fatal("the client's values are lost")
	}
	if _, ok := lc.Deadline(); ok {
		t.Fatal("a lead has no deadline of its own")
	}
	child, cancelChild := context.WithTimeout(lc, time.Hour)
	defer cancelChild()
	called := make(chan struct{})
	context.AfterFunc(lc, func() { close(called) })
	stopped := false
	stop := context.AfterFunc(lc, func() { stopped = true })
	if !stop() || stop() {
		t.Fatal("stop must report true once, then false")
	}
	leave() // the client leaving ends nothing by itself
	if lc.Err() != nil || child.Err() != nil {
		t.Fatalf("lead %v, child %v: ended with the client", lc.Err(), child.Err())
	}
	select {
	case <-lc.Done():
		t.Fatal("Done is closed before the end")
	default:
	}
	lc.end()
	lc.end()
	<-lc.Done()
	<-child.Done()
	<-called
	if !errors.Is(lc.Err(), context.Canceled) || !errors.Is(child.Err(), context.Canceled) {
		t.Fatalf("lead %v, child %v: want canceled", lc.Err(), child.Err())
	}
	if stopped {
		t.Fatal("a stopped function was called")
	}
	late := make(chan struct{})
	if lc.AfterFunc(func() { close(late) })() {
		t.Fatal("stop of a function registered after the end must report false")
	}
	<-late
	if len(lc.after) != 0 {
		t.Fatalf("%d functions kept after the end", len(lc.after))
	}
}

// Done made after the end is closed already.
func TestLeadContextDoneAfterEnd(t *testing.T) {
	lc := newTestLeadCtx(context.Background())
	lc.end()
	select {
	case <-lc.Done():
	default:
		t.Fatal("Done made after the end is open")
	}
}

// An attempt watching a lead's context registers with the lead, and gives
// its registration back when it ends.
func TestLeadContextWatchedByAnAttempt(t *testing.T) {
	lc := newTestLeadCtx(context.Background())
	d := &deadline{}
	d.watch(lc)
	if len(lc.after) != 1 {
		t.Fatalf("%d registrations, want 1", len(lc.after))
	}
	if !d.unwatch() || len(lc.after) != 0 {
		t.Fatalf("unwatch left %d registrations", len(lc.after))
	}
}
