package relay

// The status page's Spend view in a real headless Chromium.

import (
	"encoding/csv"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/statuspage"
	cdpbrowser "github.com/chromedp/cdproto/browser"
	"github.com/chromedp/chromedp"
)

func TestStatusSpendViewInABrowser(t *testing.T) {
	ctx := browser(t)
	spendRelay(t)
	inBrowser(t, ctx, 10*time.Second, chromedp.Navigate(relayURL+"/status/"))
	waitInPage(t, ctx, "the Spend chart", 5*time.Second, `document.querySelectorAll("#spend-chart g.day").length > 0`)

	today := time.Now().UTC().Format(time.DateOnly)
	past := time.Now().UTC().AddDate(0, 0, -2).Format(time.DateOnly)
	if n := eval[int](t, ctx, `document.querySelectorAll("#spend-chart g.day").length`); n != statuspage.SpendDays {
		t.Errorf("the chart has %d days, want %d", n, statuspage.SpendDays)
	}
	bars := func(day string) []string {
		return eval[[]string](t, ctx, `[...document.querySelectorAll('#spend-chart g.day[data-day="`+day+`"] rect')].map(r => r.dataset.group)`)
	}
	if got := bars(today); strings.Join(got, " ") != "spend-a spend-b" {
		t.Errorf("today's bar is of groups %v, want spend-a and spend-b", got)
	}
	if got := bars(past); strings.Join(got, " ") != "spend-a" {
		t.Errorf("the bar of %s is of groups %v, want spend-a", past, got)
	}
	if n := eval[int](t, ctx, `document.querySelectorAll("#spend-chart rect").length`); n != 3 {
		t.Errorf("the chart has %d bars, want 3 (two groups today, one two days ago)", n)
	}
	if got := eval[[]string](t, ctx, `[...document.querySelectorAll("#spend-legend li")].map(li => li.dataset.group)`); strings.Join(got, " ") != "spend-a spend-b" {
		t.Errorf("the legend lists %v", got)
	}
	// the taller bar is the costlier: spend-b's three requests over spend-a's two
	if !eval[bool](t, ctx, `(rs => +rs[1].getAttribute("height") > +rs[0].getAttribute("height"))(document.querySelectorAll('#spend-chart g.day[data-day="`+today+`"] rect'))`) {
		t.Error("spend-b's bar is not taller than spend-a's")
	}
	if got := eval[[]string](t, ctx, `[...document.querySelectorAll("#spend-keys tbody tr")].map(tr => tr.dataset.name)`); strings.Join(got, " ") != "spend-kb spend-ka" {
		t.Errorf("top keys %v, want spend-kb then spend-ka", got)
	}
	if got := eval[[]string](t, ctx, `[...document.querySelectorAll("#spend-models tbody tr")].map(tr => tr.dataset.name)`); strings.Join(got, " ") != "claude-sonnet-4-5 claude-opus-4-5 claude-haiku-4-5" {
		t.Errorf("top models %v", got)
	}
	if !eval[bool](t, ctx, `document.getElementById("spend-notice").hidden`) {
		t.Error("the no-ledger notice shows beside a ledger")
	}

	t.Run("a sub-cent cost shows its significant digits", func(t *testing.T) {
		// the haiku request cost $0.000035, once shown as $0.0000
		// the ring is the process's: rows of other tests' keys may be in it
		const ours = `[...document.querySelectorAll("#requests tbody tr")].filter(tr => tr.cells[2].textContent.startsWith("spend-k"))`
		waitInPage(t, ctx, "the requests' rows", 3*time.Second, ours+`.length === 5`)
		costs := eval[[]string](t, ctx, ours+`.map(tr => tr.cells[9].textContent)`)
		if strings.Join(costs, " ") != "$0.000035 $0.0001 $0.0001 $0.0001 $0.0001" {
			t.Errorf("the requests' costs show as %v", costs)
		}
		if got := eval[string](t, ctx, `document.querySelector('#spend-models tr[data-name="claude-haiku-4-5"]').cells[2].textContent`); got != "$0.000035" {
			t.Errorf("haiku's cost shows as %q", got)
		}
	})

	t.Run("the CSV link downloads CSV with its header row", func(t *testing.T) {
		dir := t.TempDir()
		on := true
		if _, err := chromedp.CallBrowser(ctx, cdpbrowser.SetDownloadBehavior, cdpbrowser.SetDownloadBehaviorParams{
			Behavior: cdpbrowser.SetDownloadBehaviorBehaviorAllowAndName, DownloadPath: dir, EventsEnabled: &on,
		}); err != nil {
			t.Fatal(err)
		}
		done := make(chan string, 1)
		_ = chromedp.ListenBrowser(ctx, func(ev any) {
			var e *cdpbrowser.EventDownloadProgress
			switch v := ev.(type) {
			case *cdpbrowser.EventDownloadProgress:
				e = v
			case cdpbrowser.EventDownloadProgress:
				e = &v
			default:
				return
			}
			if e.State == cdpbrowser.DownloadProgressStateCompleted {
				select {
				case done <- e.GUID:
				default:
				}
			}
		})
		eval[bool](t, ctx, `(a => { a.click(); return true })(document.getElementById("spend-csv"))`)
		var guid string
		select {
		case guid = <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("no download completed")
		}
		b, err := os.ReadFile(filepath.Join(dir, guid))
		if err != nil {
			t.Fatal(err)
		}
		recs, err := csv.NewReader(strings.NewReader(string(b))).ReadAll()
		if err != nil {
			t.Fatalf("the download is not CSV: %v\n%s", err, b)
		}
		if len(recs) != 5 || strings.Join(recs[0], ",") != "day,group,key,model,requests,input_tokens,output_tokens,cache_read_tokens,cache_write_tokens,cost_usd" {
			t.Errorf("the download:\n%s", b)
		}
	})
}

func TestStatusSpendViewInABrowserWithoutALedger(t *testing.T) {
	ctx := browser(t)
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	startStatusRelay(t, "st-spend-none", up.URL)
	inBrowser(t, ctx, 10*time.Second, chromedp.Navigate(relayURL+"/status/"))
	waitInPage(t, ctx, "the no-ledger notice", 5*time.Second, `!document.getElementById("spend-notice").hidden`)
	if got := eval[string](t, ctx, `document.getElementById("spend-notice").textContent`); !strings.HasPrefix(got, "Spend: no ledger is configured") || strings.Contains(got, "\n") {
		t.Errorf("the notice: %q", got)
	}
	if !eval[bool](t, ctx, `document.getElementById("spend-body").hidden && document.getElementById("spend-csv").hidden && document.querySelectorAll("#spend-chart *").length === 0`) {
		t.Error("without a ledger the chart, tables or CSV link show")
	}
}
