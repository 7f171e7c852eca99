package statuspage

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestSpendViewByDayGroupKeyAndModel(t *testing.T) {
	now := time.Now().UTC()
	today, past := now.Format(time.DateOnly), now.AddDate(0, 0, -2).Format(time.DateOnly)
	src := &fakeSource{spend: []SpendRow{
		{Values: []string{today, "g-b", "k2", "sonnet"}, Requests: 3, CostNano: 3000},
		{Values: []string{today, "g-a", "k1", "haiku"}, Requests: 1, CostNano: 500},
		{Values: []string{past, "g-a", "k1", "opus"}, Requests: 1, CostNano: 1000},
	}}
	v := BuildSpend(context.Background(), src, now)
	if !v.Ledger || v.Notice != "" || len(v.Days) != SpendDays || v.Days[SpendDays-1] != today || v.Days[SpendDays-3] != past {
		t.Fatalf("days: %+v", v)
	}
	if len(v.Groups) != 2 || v.Groups[0].Name != "g-a" || v.Groups[0].CostUSD[SpendDays-3] != 1e-6 || v.Groups[1].CostUSD[SpendDays-1] != 3e-6 {
		t.Errorf("groups: %+v", v.Groups)
	}
	if len(v.TopKeys) != 2 || v.TopKeys[0].Name != "k2" || v.TopKeys[1].Requests != 2 || len(v.TopModels) != 3 || v.TopModels[2].Name != "haiku" {
		t.Errorf("tops: %+v %+v", v.TopKeys, v.TopModels)
	}
}

func TestSpendViewSaysWhyItHasNoLedger(t *testing.T) {
	testSource.noLdgr = errors.New("no ledger is configured (the relay's ledger option)")
	defer func() { testSource.noLdgr = nil }()
	p := page(t)
	w := serve(t, p, http.MethodGet, "/spend")
	var v SpendView
	if w.Code != 200 || json.Unmarshal(w.Body.Bytes(), &v) != nil || v.Ledger || !strings.HasPrefix(v.Notice, "no ledger") {
		t.Errorf("spend: %d %s", w.Code, w.Body)
	}
	if w := serve(t, p, http.MethodGet, "/spend.csv"); w.Code != http.StatusNotFound || !strings.Contains(w.Body.String(), "no ledger") {
		t.Errorf("spend.csv: %d %s", w.Code, w.Body)
	}
}
