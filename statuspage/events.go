package statuspage

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"time"
)

// How often an open page's event stream looks for changes, reads the
// fleet's nodes, and says it is alive.
const (
	statusTick      = 500 * time.Millisecond
	statusFleetTick = 5 * time.Second
	statusKeepalive = 15 * time.Second
)

// fleetCache is the fleet's nodes as last read.
type fleetCache struct {
	mu    sync.Mutex
	at    time.Time
	nodes []FleetNode
	err   error
}

// events streams the page's picture: a `state` event when it changes
// (looked at every statusTick), `requests` events with the rows the ring
// gained. It ends with the client, or with the config that serves it.
func (s *StatusPage) events(w http.ResponseWriter, r *http.Request) error {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return nil
	}
	rc := http.NewResponseController(w)
	if _, err := w.Write([]byte("retry: 1000\n\n")); err != nil {
		return nil
	}
	var (
		last    []byte
		seq     uint64
		rows    []Request // this stream's copy of the ring, the oldest first
		buf     bytes.Buffer
		quiet   = time.Now()
		ticker  = time.NewTicker(statusTick)
		stopped = s.ctx.Done()
	)
	defer ticker.Stop()
	for {
		buf.Reset()
		var fresh []Request
		fresh, seq = recent.since(seq)
		rows = append(rows, fresh...)
		if len(rows) > RecentSize {
			rows = append(rows[:0], rows[len(rows)-RecentSize:]...)
		}
		now := time.Now()
		state, err := json.Marshal(snapshot(s.src, now, rows, s.fleet))
		if err != nil {
			return err
		}
		if !bytes.Equal(state, last) {
			last = state
			fmt.Fprintf(&buf, "event: state\ndata: {\"now\":%q,\"state\":%s}\n\n", now.UTC().Format(time.RFC3339Nano), state)
		}
		if len(fresh) > 0 {
			out := make([]requestRow, len(fresh))
			for i := range fresh {
				out[i] = fresh[i].row()
			}
			b, err := json.Marshal(out)
			if err != nil {
				return err
			}
			fmt.Fprintf(&buf, "event: requests\ndata: %s\n\n", b)
		}
		if buf.Len() == 0 && now.Sub(quiet) >= statusKeepalive {
			buf.WriteString(": alive\n\n")
		}
		if buf.Len() > 0 {
			quiet = now
			if _, err := w.Write(buf.Bytes()); err != nil {
				return nil
			}
			if err := rc.Flush(); err != nil {
				return nil
			}
		}
		select {
		case <-r.Context().Done():
			return nil
		case <-stopped:
			return nil
		case <-ticker.C:
		}
	}
}

// fleet lists the fleet's nodes, read at most every statusFleetTick; nil
// when no relay handler has storage.
func (s *StatusPage) fleet() ([]FleetNode, error) {
	c := s.nodes
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Since(c.at) >= statusFleetTick {
		c.nodes, c.err = s.src.Fleet()
		c.at = time.Now()
	}
	return c.nodes, c.err
}
