package money

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/redistest"
	"github.com/caddyserver/certmagic"
)

func TestBudgetParsing(t *testing.T) {
	for in, want := range map[string]budget{
		"200usd/month": {200, PeriodMonth},
		"0.5USD/day":   {0.5, PeriodDay},
		"10usd/week":   {10, PeriodWeek},
		"200usd/total": {200, PeriodTotal},
	} {
		if got, err := parseBudget(in); err != nil || got != want {
			t.Errorf("%q: %+v %v, want %+v", in, got, err, want)
		}
	}
	for _, bad := range []string{"200/month", "200usd", "usd/month", "-1usd/day", "0usd/day", "5usd/year", "5eur/month", "NaNusd/day"} {
		if _, err := parseBudget(bad); err == nil {
			t.Errorf("%q should not parse", bad)
		}
	}
	if _, err := ParseBudgets([]string{"1usd/day", "2usd/day"}); err == nil || !strings.Contains(err.Error(), "two daily budgets") {
		t.Errorf("two budgets for one period: %v", err)
	}
	if _, err := ParseBudgets([]string{"1usd/total", "2usd/total"}); err == nil || !strings.Contains(err.Error(), "two lifetime budgets") {
		t.Errorf("two total budgets: %v", err)
	}
	if _, err := ParseBudgets([]string{"1usd/day", "5usd/week", "20usd/month", "100usd/total"}); err != nil {
		t.Errorf("a budget for every period: %v", err)
	}
}

func TestTheTotalPeriodNeverEnds(t *testing.T) {
	for _, at := range []time.Time{time.Date(2026, time.November, 29, 22, 30, 0, 0, time.UTC), time.Date(2199, time.January, 1, 0, 0, 0, 0, time.UTC)} {
		s := PeriodTotal.Start(at)
		if !s.Equal(time.Unix(0, 0)) || s.IsZero() {
			t.Errorf("at %v the total starts %v, want the Unix epoch", at, s)
		}
		if end := PeriodTotal.End(s); end.Year() != 9999 {
			t.Errorf("the total ends %v, want in year 9999", end)
		}
	}
	if PeriodTotal.Renews() || !PeriodMonth.Renews() {
		t.Error("a total must not renew, a month must")
	}
}

func TestBudgetPeriodsAreCalendarPeriodsInUTC(t *testing.T) {
	// a Sunday evening in UTC, Monday already in Tokyo
	at := time.Date(2026, time.November, 29, 22, 30, 0, 0, time.UTC).In(time.FixedZone("JST", 9*3600))
	for _, c := range []struct {
		p          Period
		start, end string
	}{
		{PeriodDay, "2026-11-29T00:00:00Z", "2026-11-30T00:00:00Z"},
		{PeriodWeek, "2026-11-23T00:00:00Z", "2026-11-30T00:00:00Z"},
		{PeriodMonth, "2026-11-01T00:00:00Z", "2026-12-01T00:00:00Z"},
	} {
		s := c.p.Start(at)
		if got := s.Format(time.RFC3339); got != c.start {
			t.Errorf("%s starts %s, want %s", c.p, got, c.start)
		}
		if got := c.p.End(s).Format(time.RFC3339); got != c.end {
			t.Errorf("%s ends %s, want %s", c.p, got, c.end)
		}
	}
	// a month of 31 days, and December into January
	dec := PeriodMonth.Start(time.Date(2026, time.December, 31, 23, 59, 59, 0, time.UTC))
	if got := PeriodMonth.End(dec).Format(time.RFC3339); got != "2027-01-01T00:00:00Z" {
		t.Errorf("December ends %s", got)
	}
}

func TestSpendIsSharedByAFleet(t *testing.T) {
	srv := redistest.Start(t)
	now := time.Now()
	// two relays' accounts of one key
	a, b := NewAccount("shared-spend"), NewAccount("shared-spend")
	caps := [NumPeriods]float64{PeriodDay: 1}
	a.Configure(caps, 0, "shared-spend", discardLogger(), nil)
	b.Configure(caps, 0, "shared-spend", discardLogger(), nil)
	fa, fb := testFleet(t, srv.Addr, "spend:", 0), testFleet(t, srv.Addr, "spend:", 0)
	a.fleet.Store(fa)
	b.fleet.Store(fb)
	spendAccounts.LoadOrStore("test-a", a)
	spendAccounts.LoadOrStore("test-b", b)
	t.Cleanup(func() { spendAccounts.Delete("test-a"); spendAccounts.Delete("test-b") })

	a.Charge(now, 0.6, discardLogger())
	b.Charge(now, 0.3, discardLogger())
	fa.flushSpend()
	fb.flushSpend()
	fa.flushSpend()
	for name, acc := range map[string]*Account{"a": a, "b": b} {
		if usd, _ := acc.Spent(now); usd[PeriodDay] < 0.899 || usd[PeriodDay] > 0.901 {
			t.Errorf("relay %s sees %v spent today, want the fleet's 0.90", name, usd[PeriodDay])
		}
	}
	// each relay's next charge goes over the fleet's budget
	b.Charge(now, 0.2, discardLogger())
	fb.flushSpend()
	fa.flushSpend()
	if e, over := a.Check(now, 0); !over || e.Spent < 1.099 {
		t.Errorf("relay a after the fleet spent 1.10 of 1: %+v, %v", e, over)
	}
	got, err := srv.Command("GET", "spend:{s:shared-spend}:day:"+PeriodDay.Start(now).Format("20060102"))
	if n, _ := strconv.ParseInt(got, 10, 64); err != nil || n != 1_100_000_000 {
		t.Errorf("the day's total in Redis: %q %v, want 1100000000 billionths of a dollar", got, err)
	}
}

// TestAFleetKeepsTotals shares a key's lifetime budget between two relays
// on a real Redis: the fleet's total is one counter, since the epoch, that
// Redis keeps (its expiry is in year 9999), and it refuses both relays.
func TestAFleetKeepsTotals(t *testing.T) {
	srv := redistest.Start(t)
	now := time.Now()
	a, b := NewAccount("shared-total"), NewAccount("shared-total")
	caps := [NumPeriods]float64{PeriodTotal: 1}
	a.Configure(caps, 0, "shared-total", discardLogger(), nil)
	b.Configure(caps, 0, "shared-total", discardLogger(), nil)
	fa, fb := testFleet(t, srv.Addr, "total:", 0), testFleet(t, srv.Addr, "total:", 0)
	a.fleet.Store(fa)
	b.fleet.Store(fb)
	spendAccounts.LoadOrStore("test-total-a", a)
	spendAccounts.LoadOrStore("test-total-b", b)
	t.Cleanup(func() { spendAccounts.Delete("test-total-a"); spendAccounts.Delete("test-total-b") })

	a.Charge(now, 0.6, discardLogger())
	b.Charge(now, 0.5, discardLogger())
	fa.flushSpend()
	fb.flushSpend()
	fa.flushSpend()
	for name, acc := range map[string]*Account{"a": a, "b": b} {
		if e, over := acc.Check(now, 0); !over || e.Period != PeriodTotal || e.Spent < 1.099 {
			t.Errorf("relay %s after the fleet spent 1.10 of its total 1: %+v, %v", name, e, over)
		}
	}
	k := "total:{s:shared-total}:total:19700101"
	got, err := srv.Command("GET", k)
	if n, _ := strconv.ParseInt(got, 10, 64); err != nil || n != 1_100_000_000 {
		t.Errorf("the total in Redis: %q %v, want 1100000000 billionths of a dollar", got, err)
	}
	ttl, err := srv.Command("PTTL", k)
	if ms, _ := strconv.ParseInt(strings.TrimPrefix(ttl, ":"), 10, 64); err != nil || ms < (100*365*24*time.Hour).Milliseconds() {
		t.Errorf("the total's PTTL in Redis is %q (%v), want it kept for ever", ttl, err)
	}
}

// TestTheStoreKeepsATotalForever writes the records of two keys gone for
// years: the one with a total is kept, and comes back with it; the one
// whose periods all ended is dropped.
func TestTheStoreKeepsATotalForever(t *testing.T) {
	storage := &certmagic.FileStorage{Path: t.TempDir()}
	longAgo := time.Date(2020, time.January, 6, 0, 0, 0, 0, time.UTC)
	s := &spendStore{storage: storage, logger: discardLogger(), saved: map[string]spendRecord{
		"store-total-kept": {
			"day":   {Start: longAgo, NanoUSD: 1e9},
			"month": {Start: longAgo, NanoUSD: 3e9},
			"total": {Start: totalStart, NanoUSD: 7e9},
		},
		"store-total-none": {"day": {Start: longAgo, NanoUSD: 1e9}},
	}}
	s.save()
	again := &spendStore{storage: storage, logger: discardLogger(), saved: map[string]spendRecord{}}
	again.load()
	if _, ok := again.saved["store-total-none"]; ok {
		t.Error("a record whose periods all ended years ago was kept")
	}
	usd, _ := again.stored("store-total-kept").Spent(time.Now())
	if usd[PeriodTotal] != 7 || usd[PeriodDay] != 0 || usd[PeriodMonth] != 0 {
		t.Errorf("the stored key's spend: %v; want $7 in total, and nothing in the current periods", usd)
	}

	// a record of today's spend, written before there were totals, of a
	// key given a total budget: the account begins its total at once,
	// though its day goes on
	now := time.Now()
	again.saved["store-total-before"] = spendRecord{"day": {Start: PeriodDay.Start(now), NanoUSD: 2e9}}
	a := again.stored("store-total-before")
	a.Configure([NumPeriods]float64{PeriodTotal: 100}, 0, "store-total-before", discardLogger(), nil)
	a.Charge(now, 1, discardLogger())
	if rec := a.record(); rec["total"].Start != totalStart || rec["total"].NanoUSD != 1e9 || rec["day"].NanoUSD != 3e9 {
		t.Errorf("an account stored before there were totals, after a charge of $1: %+v", rec)
	}
	// an account without a total budget counts no total: its record is
	// dropped once its periods end
	b := again.stored("store-total-unbudgeted")
	b.Charge(now, 1, discardLogger())
	if rec := b.record(); rec["total"].NanoUSD != 0 || rec["day"].NanoUSD != 1e9 {
		t.Errorf("an account without a total budget, after a charge of $1: %+v", rec)
	}
}
