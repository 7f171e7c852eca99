package money

import (
	"testing"
	"time"
)

// TestSessionWindowsLieOnAGridInUTC: a session budget's windows are the
// same on every relay, whatever the session's first request: a duration
// that divides a day from midnight UTC, 168h from Monday.
func TestSessionWindowsLieOnAGridInUTC(t *testing.T) {
	for _, c := range []struct {
		window     time.Duration
		at         time.Time
		start, end string
	}{
		{4 * time.Hour, time.Date(2030, time.March, 15, 10, 15, 0, 0, time.UTC), "2030-03-15T08:00:00Z", "2030-03-15T12:00:00Z"},
		{24 * time.Hour, time.Date(2030, time.March, 15, 23, 59, 0, 0, time.UTC), "2030-03-15T00:00:00Z", "2030-03-16T00:00:00Z"},
		{168 * time.Hour, time.Date(2030, time.March, 15, 10, 0, 0, 0, time.UTC), "2030-03-11T00:00:00Z", "2030-03-18T00:00:00Z"}, // a Friday: from Monday
		{30 * time.Minute, time.Date(2030, time.March, 15, 10, 45, 0, 0, time.FixedZone("CET", 3600)), "2030-03-15T09:30:00Z", "2030-03-15T10:00:00Z"},
	} {
		a := NewAccount("window-test")
		BudgetSpec{Scope: OfSession, Caps: [NumPeriods]float64{PeriodDay: 1}, Window: c.window}.Apply(a, nil)
		a.Charge(c.at, 0.25, nil)
		limit, spent, end := a.WindowNow(c.at)
		start := a.periods[PeriodDay].start
		if start.UTC().Format(time.RFC3339) != c.start || end.UTC().Format(time.RFC3339) != c.end || limit != ToNano(1) || spent != ToNano(0.25) {
			t.Errorf("%v at %v: window %v to %v, $%v of $%v; want %s to %s", c.window, c.at, start.UTC(), end.UTC(), spent.USD(), limit.USD(), c.start, c.end)
		}
		if _, spent, _ := a.WindowNow(end); spent != 0 {
			t.Errorf("%v: the next window starts with $%v spent", c.window, spent.USD())
		}
	}
}
