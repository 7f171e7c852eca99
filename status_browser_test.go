package relay

// The status page in a real headless Chromium, driven by chromedp.

import (
	"context"
	"database/sql"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
)

// needBrowser returns the path of a Chromium; when there is none the test
// is skipped, saying how to install it, and fails under CI=true.
func needBrowser(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if path, err := exec.LookPath(name); err == nil {
			return path
		}
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("no Chromium is installed (CI must have it): apt-get install -y chromium")
	}
	t.Skip("no Chromium is installed; to run this test: apt-get install -y chromium")
	return ""
}

// browser starts a headless Chromium for the test and returns its tab's
// context. Dialogs (the page's confirmations) are accepted.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(needBrowser(t)),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 900),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("starting Chromium: %v", err)
	}
	dialogs := chromedp.Events(ctx, page.JavascriptDialogOpening)
	go func() {
		for _, err := range dialogs {
			if err != nil {
				return
			}
			_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: true})
		}
	}()
	return ctx
}

// inBrowser runs browser actions with a bound.
func inBrowser(t *testing.T, ctx context.Context, bound time.Duration, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, bound)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		t.Fatal(err)
	}
}

// eval evaluates a script in the page and returns its value.
func eval[T any](t *testing.T, ctx context.Context, script string) T {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](script))
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// waitInPage waits until a script's value is true in the page.
func waitInPage(t *testing.T, ctx context.Context, what string, bound time.Duration, script string) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !eval[bool](t, ctx, script) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// hostile is markup where the page shows a name.
const hostile = `<img src=x onerror=window.__owned=1><b>bold</b>`

func TestStatusPageInABrowser(t *testing.T) {
	ctx := browser(t)
	up := fakeupstream.New(t, fakeupstream.Message("hello"))
	// model names are model ids (a name with markup is refused), so what
	// carries markup is a key's name, which the page shows in two tables
	block := channelBlock("st-browser", up.URL, "cooldown 30s") +
		"\t\tkey " + clientKey + " stg {\n\t\t\tname \"" + hostile + "\"\n\t\t}\n\t\tgroup stg {\n\t\t\tchannels st-browser\n\t\t\tretries 0\n\t\t\tloop_guard 3\n\t\t}\n"
	startRelayWith(t, statusSite, block)

	var mu sync.Mutex
	var urls []string
	_ = chromedp.Listen(ctx, func(ev any) {
		if e, ok := ev.(*network.EventRequestWillBeSent); ok {
			mu.Lock()
			urls = append(urls, e.Request.URL)
			mu.Unlock()
		}
	})
	inBrowser(t, ctx, 10*time.Second, chromedp.Navigate(relayURL+"/status/"))
	waitInPage(t, ctx, "the page's event stream", 5*time.Second,
		`document.getElementById("live").textContent === "live" && !!document.querySelector('tr[data-channel="st-browser"]')`)

	t.Run("loads nothing from another origin", func(t *testing.T) {
		mu.Lock()
		defer mu.Unlock()
		want := map[string]bool{"/status/": false, "/status/status.js": false, "/status/status.css": false, "/status/events": false}
		for _, u := range urls {
			if !strings.HasPrefix(u, relayURL+"/") && !strings.HasPrefix(u, "data:") {
				t.Errorf("the page asked another origin: %s", u)
			}
			if _, ok := want[strings.TrimPrefix(u, relayURL)]; ok {
				want[strings.TrimPrefix(u, relayURL)] = true
			}
		}
		for path, seen := range want {
			if !seen {
				t.Errorf("the page did not ask for %s (asked %v)", path, urls)
			}
		}
	})

	var hostileID string
	t.Run("a name with HTML is text", func(t *testing.T) {
		r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
		if r.status != 200 {
			t.Fatalf("message: %d %s", r.status, r.body)
		}
		hostileID = r.header.Get("X-Relay-Request-Id")
		if r := message(t, `{"model":"<img src=x onerror=alert(1)>","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`); r.status != 400 {
			t.Fatalf("a model name with markup: %d", r.status)
		}
		waitInPage(t, ctx, "the request's row", 3*time.Second,
			`[...document.querySelectorAll("#requests td.key")].some(td => td.textContent === `+jsString(hostile)+`)`)
		waitInPage(t, ctx, "the key's row", 3*time.Second,
			`[...document.querySelectorAll("#keys td")].some(td => td.textContent === `+jsString(hostile)+`)`)
		if n := eval[int](t, ctx, `document.querySelectorAll("main img, main b").length`); n != 0 {
			t.Errorf("the name became %d elements", n)
		}
		if owned := eval[bool](t, ctx, `window.__owned === 1`); owned {
			t.Error("the model name ran a script")
		}
	})

	t.Run("a request id typed into the search finds its row", func(t *testing.T) {
		if hostileID == "" {
			t.Skip("no request id")
		}
		for range 3 { // other rows, so the search has something to leave out
			message(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
		}
		waitInPage(t, ctx, "four rows", 3*time.Second, `document.querySelectorAll("#requests tbody tr").length >= 4`)
		// one round trip to the browser a key: on a loaded machine, seconds
		inBrowser(t, ctx, 20*time.Second, chromedp.SendKeys(chromedp.ID("search"), hostileID[:len(hostileID)-2]))
		ids := eval[[]string](t, ctx, `[...document.querySelectorAll("#requests tbody tr")].map(tr => tr.dataset.id)`)
		if len(ids) != 1 || ids[0] != hostileID {
			t.Fatalf("rows found for %s: %v", hostileID, ids)
		}
		eval[bool](t, ctx, `(s => { s.value = ""; s.dispatchEvent(new Event("input")); return true })(document.getElementById("search"))`)
	})

	t.Run("a 529 turns the badge to cooldown without a reload", func(t *testing.T) {
		eval[bool](t, ctx, `window.__sameDocument = true`)
		up.SetHandler(fakeupstream.Error(529, "overloaded_error", "Overloaded"))
		defer up.SetHandler(fakeupstream.Message("hello"))
		r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
		if r.status < 500 {
			t.Fatalf("message through a 529: %d", r.status)
		}
		if st := channels(t)["st-browser"].State; st != stateCooldown {
			t.Fatalf("the channel is %s", st)
		}
		waitInPage(t, ctx, "the cooldown badge", 3*time.Second,
			`document.querySelector('tr[data-channel="st-browser"] .badge').dataset.state === "cooldown"`)
		if !eval[bool](t, ctx, `window.__sameDocument === true`) {
			t.Error("the page was reloaded")
		}
		if left := eval[string](t, ctx, `document.querySelector('tr[data-channel="st-browser"] td.countdown').textContent`); !strings.HasSuffix(left, "s") {
			t.Errorf("no countdown: %q", left)
		}
		// the 529 answered a sonnet request: sonnet's class cools, with its time left
		waitInPage(t, ctx, "the cooling classes cell", 3*time.Second,
			`/^sonnet (2\d|30)s$/.test(document.querySelector('tr[data-channel="st-browser"] td.classes').textContent)`)
		if title := eval[string](t, ctx, `document.querySelector('tr[data-channel="st-browser"] span.class-cooling[data-class="sonnet"]').title`); title != "status 529" {
			t.Errorf("the class's reason: %q", title)
		}
		adminPost(t, "st-browser", "reset")
		waitInPage(t, ctx, "the cooling classes cell emptied by the reset", 3*time.Second,
			`document.querySelector('tr[data-channel="st-browser"] td.classes').textContent === ""`)
		// healthy again, and what it shows of the 529 says it came before
		waitInPage(t, ctx, "the last error and the error rate marked as from before the reset", 3*time.Second,
			`(tr => tr.querySelector(".badge").dataset.state === "healthy" &&
				tr.querySelector("td.last-error").textContent.startsWith("before the reset: ") &&
				tr.querySelector("td.errors").classList.contains("before-reset"))(document.querySelector('tr[data-channel="st-browser"]'))`)
	})

	t.Run("columns line up and nothing overflows at 1400 px", func(t *testing.T) {
		inBrowser(t, ctx, 10*time.Second, chromedp.EmulateViewport(1400, 900))
		defer inBrowser(t, ctx, 10*time.Second, chromedp.EmulateViewport(1280, 900))
		// a long model name and a long chain, the widest a row gets
		message(t, `{"model":"claude-sonnet-4-5-20250929-with-a-long-dated-suffix","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}`)
		waitInPage(t, ctx, "rows in the groups, keys and requests tables", 3*time.Second,
			`["groups", "keys", "requests"].every(id => document.querySelector("#" + id + " tbody tr"))`)
		// every header sits as its column's values do: numbers on the right
		misaligned := eval[[]string](t, ctx, `[...document.querySelectorAll("main table")].flatMap(table => {
			const row = table.tBodies[0].rows[0];
			if (!row) return [];
			return [...table.tHead.rows[0].cells].slice(0, row.cells.length).filter((th, i) =>
				getComputedStyle(th).textAlign !== getComputedStyle(row.cells[i]).textAlign).map(th => table.id + ": " + th.textContent);
		})`)
		if len(misaligned) != 0 {
			t.Errorf("headers not aligned as their values: %v", misaligned)
		}
		for _, id := range []string{"groups", "keys"} {
			if n := eval[int](t, ctx, `document.querySelectorAll("#`+id+` thead th.num").length`); n == 0 {
				t.Errorf("the %s table has no right-aligned header", id)
			}
		}
		overflowing := eval[[]string](t, ctx, `[...document.querySelectorAll("main .scroll")].filter(s => s.scrollWidth > s.clientWidth + 1).map(s => s.querySelector("table").id + ": " + s.scrollWidth + " > " + s.clientWidth)`)
		if len(overflowing) != 0 {
			t.Errorf("tables wider than the page at 1400 px: %v %v", overflowing, eval[[]string](t, ctx, `[...document.querySelectorAll("#requests thead th")].map(th => th.textContent + "=" + Math.round(th.getBoundingClientRect().width))`))
		}
		if !eval[bool](t, ctx, `(() => { const s = document.querySelector("#requests").parentElement.getBoundingClientRect();
			const th = [...document.querySelectorAll("#requests thead th")].pop().getBoundingClientRect();
			return th.right <= s.right + 1 && th.width > 0; })()`) {
			t.Error("the requests table's error column is cut at 1400 px")
		}
	})

	t.Run("clicking disable disables the channel", func(t *testing.T) {
		// found and clicked in one step: the table is drawn again at every
		// update, and a button found in one step may be gone by the next
		waitInPage(t, ctx, "the disable button, clicked", 3*time.Second,
			`(() => { const b = document.querySelector('tr[data-channel="st-browser"] button[data-action="disable"]'); if (b) b.click(); return !!b; })()`)
		waitFor(t, "GET /relay/channels says disabled", 3*time.Second, func() bool {
			return channels(t)["st-browser"].State == stateDisabled
		})
		waitInPage(t, ctx, "the disabled badge", 3*time.Second,
			`document.querySelector('tr[data-channel="st-browser"] .badge').dataset.state === "disabled"`)
		adminPost(t, "st-browser", "enable")
	})

	t.Run("a looping session shows in the sessions panel", func(t *testing.T) {
		const sid = "7a8b9c0d-1e2f-4a3b-8c4d-5e6f7a8b9c0d"
		turn := `{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"Bash","input":{"command":"npm test"}}]},` +
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"FAIL","is_error":true}]}`
		body := `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"fix it"}`
		statuses := []int{}
		for range 3 {
			body += "," + turn
			statuses = append(statuses, message(t, body+`]}`, "X-Claude-Code-Session-Id", sid).status)
		}
		if statuses[0] != 200 || statuses[1] != 200 || statuses[2] != 429 {
			t.Fatalf("three turns of the same call and result under loop_guard 3: %v", statuses)
		}
		row := `[...document.querySelectorAll("#sessions tbody tr")].find(tr => tr.cells[0].textContent === ` + jsString(sessionDigest(sid)) + `)`
		waitInPage(t, ctx, "the session's row", 3*time.Second, `(r => !!r && r.cells[1].textContent === `+jsString(hostile)+` && r.cells[5].textContent === "2" && r.cells[6].textContent === "1")(`+row+`)`)
		if n := eval[int](t, ctx, `document.querySelectorAll("main img, main b").length`); n != 0 {
			t.Errorf("the key's name became %d elements", n)
		}
		if shown := eval[bool](t, ctx, `document.getElementById("sessions").textContent.includes(`+jsString(sid)+`)`); shown {
			t.Error("the sessions panel shows the session id")
		}
	})

	t.Run("the page reconnects after a reload", func(t *testing.T) {
		eval[bool](t, ctx, `window.__sameDocument = true`)
		streams := func() int {
			mu.Lock()
			defer mu.Unlock()
			n := 0
			for _, u := range urls {
				if u == relayURL+"/status/events" {
					n++
				}
			}
			return n
		}
		before := streams()
		startRelayWith(t, statusSite, strings.Replace(block, "retries 0", "retries 1", 1))
		waitFor(t, "a new event stream", 5*time.Second, func() bool { return streams() > before })
		r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"after the reload"}]}`)
		id := r.header.Get("X-Relay-Request-Id")
		waitInPage(t, ctx, "the row of a request after the reload", 5*time.Second,
			`[...document.querySelectorAll("#requests tbody tr")].some(tr => tr.dataset.id === `+jsString(id)+`) && document.getElementById("live").textContent === "live"`)
		if !eval[bool](t, ctx, `window.__sameDocument === true`) {
			t.Error("the page was reloaded")
		}
	})
}

// jsString quotes s as a JavaScript string.
func jsString(s string) string {
	r := strings.NewReplacer(`\`, `\\`, "`", "\\`", "$", `\$`)
	return "`" + r.Replace(s) + "`"
}

// TestStatusScreenshot writes the page's screenshot to the file named by
// RELAY_STATUS_SCREENSHOT (docs/status.png), on mock channels with some
// traffic, at RELAY_STATUS_SCREENSHOT_WIDTH px (default 1400;
// docs/status-400.png is taken at 400); without it, it is skipped.
func TestStatusScreenshot(t *testing.T) {
	out := os.Getenv("RELAY_STATUS_SCREENSHOT")
	if out == "" {
		t.Skip("set RELAY_STATUS_SCREENSHOT=docs/status.png to take the page's screenshot")
	}
	width := int64(1400)
	if w, err := strconv.ParseInt(os.Getenv("RELAY_STATUS_SCREENSHOT_WIDTH"), 10, 64); err == nil && w > 0 {
		width = w
	}
	ctx := browser(t)
	flaky := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	ledgerPath := filepath.Join(t.TempDir(), "ledger.db")
	startRelayWith(t, statusSite, `
		ledger sqlite `+ledgerPath+`
		channel shot-primary {
			provider mock
			latency 40ms
		}
		channel shot-flaky {
			url `+flaky.URL+`
			api_key `+channelKey+`
			cooldown 5m
		}
		channel shot-fallback {
			provider mock
			priority 2
		}
		key `+clientKey+` shots {
			name team-a
			budget 0.05usd/day
		}
		key sk-status-screenshot-second-key-0123 shots {
			name batch-jobs
			priority batch
			budget 20usd/month
		}
		group shots {
			channels shot-primary shot-flaky shot-fallback
			retries 2
		}
`)
	for i := range 12 {
		model := "claude-sonnet-5-5"
		if i%3 == 0 {
			model = "claude-haiku-5-5"
		}
		message(t, `{"model":"`+model+`","max_tokens":64,"messages":[{"role":"user","content":"hi"}]}`)
	}
	db, err := sql.Open("sqlite3", "file:"+ledgerPath+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	waitFor(t, "the requests in the ledger", 10*time.Second, func() bool { return ledgerRows(t, db) == 12 })
	adminPost(t, "shot-fallback", "disable")
	defer adminPost(t, "shot-fallback", "enable")
	send(t, http.MethodPost, "/v1/messages", "sk-not-a-key-of-this-relay-000", `{"model":"claude-sonnet-5-5","max_tokens":8,"messages":[]}`)
	inBrowser(t, ctx, 20*time.Second,
		chromedp.EmulateViewport(width, 900),
		chromedp.Navigate(relayURL+"/status/"),
		chromedp.WaitVisible(chromedp.CSS(`tr[data-channel="shot-flaky"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#spend-chart rect`)),
		chromedp.Sleep(time.Second), // the requests' event
	)
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	png, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(out, png, 0o644); err != nil {
		t.Fatal(err)
	}
}
