package statuspage

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"
)

// fakeSource is a relay as the page's tests have it: what its Snapshot,
// Fleet and ledger give are set by the test.
type fakeSource struct {
	mu     sync.Mutex
	snap   Snapshot
	nodes  []FleetNode
	spend  []SpendRow // each with the values of the day, group, key and model
	noLdgr error
	acted  []string
}

func init() { SetSource(testSource) }

// testSource is the Source the package's tests register.
var testSource = new(fakeSource)

func (f *fakeSource) Snapshot(time.Time) Snapshot {
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.snap
	s.Channels = append([]ChannelView(nil), f.snap.Channels...)
	s.Keys = append([]Key(nil), f.snap.Keys...)
	return s
}

func (f *fakeSource) Fleet() ([]FleetNode, error) { return f.nodes, nil }

func (f *fakeSource) Act(channel, action string) (Channel, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.snap.Channels {
		if c.Name == channel {
			f.acted = append(f.acted, channel+" "+action)
			return c.Channel, nil
		}
	}
	return Channel{}, errors.New("unknown channel")
}

func (f *fakeSource) Ledger() error { return f.noLdgr }

// Spend sums the rows by the columns asked, of day, group, key and model.
func (f *fakeSource) Spend(_ context.Context, _, _ time.Time, by []string, emit func(SpendRow) error) error {
	col := map[string]int{"day": 0, "group": 1, "key": 2, "model": 3}
	var out []SpendRow
	at := map[string]int{}
	for _, r := range f.spend {
		vals := make([]string, len(by))
		for i, c := range by {
			vals[i] = r.Values[col[c]]
		}
		k := fmtKey(vals)
		i, ok := at[k]
		if !ok {
			i = len(out)
			at[k] = i
			out = append(out, SpendRow{Values: vals})
		}
		out[i].Requests += r.Requests
		out[i].CostNano += r.CostNano
	}
	for _, r := range out {
		if err := emit(r); err != nil {
			return err
		}
	}
	return nil
}

func fmtKey(vals []string) string {
	k := ""
	for _, v := range vals {
		k += v + "\x00"
	}
	return k
}

func (f *fakeSource) SpendCSV(w http.ResponseWriter, _ *http.Request, _, _ time.Time) error {
	w.Header().Set("Content-Type", "text/csv; charset=utf-8")
	_, err := w.Write([]byte("day,group,key,model\n"))
	return err
}
