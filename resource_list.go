package relay

import (
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/resourceid"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
	"go.uber.org/zap"
)

// A list of batches or files merges the lists of the group's channels that
// serve the resource, newest first as Anthropic sorts them. The cursor the
// client gets (last_id, and next_page for files) is the relay's own: it
// holds, sealed as ids are, where each channel's list stands, in that
// channel's own terms (after an id, or a page token and how many of that
// page were passed; internal/resourceid seals it), so the next page asks
// each channel for what follows. Lists page forward only (after_id,
// page): before_id is refused, since a merged list has no single place to
// go back from.

// A group sees only its own items (internal/owners), so a channel's
// list is scanned: the relay reads the channel's upstream list page after
// page, keeps the group's items, and stops once it holds a page's worth
// (limit), the upstream has no more, or it has read listScanPages pages
// of that channel for this request. Each upstream page's owners are one
// look-up (one HMGET in a fleet). The cursor records where the scan of
// each channel stands in the upstream's own terms, past the other groups'
// items it skipped, so the next page starts after them.
//
// A page shows the group's items newest first. An item older than what a
// channel's scan reached is held back while that channel may still hold
// newer ones (its scan ended at the bound), unless the page would
// otherwise be empty: the SDKs stop paging at an empty page, so a page
// shows what was found, even if a later page then holds a newer item of
// another channel. A page comes back empty with has_more true only when
// no channel found any of the group's items within the bound; its cursor
// continues past everything scanned.

// Bounds of a list's scan.
const (
	// listScanPages bounds the upstream pages one list request reads from
	// one channel: the first of the client's limit, the others of
	// listScanPageSize, so at most limit+4,000 items a channel.
	listScanPages = 5
	// listScanPageSize is the size of the upstream pages read after the
	// first, Anthropic's largest.
	listScanPageSize = 1000
)

// listed is one channel's part of a merged page: the group's items its
// scan found, and where the channel's list stands before each of them and
// after the scan.
type listed struct {
	ch    *channel
	items []gjson.Result // the group's items, newest first
	times []time.Time
	at    []resourceid.Pos // at[i]: the position whose next item is items[i]
	end   resourceid.Pos   // the position after all that was scanned; resourceid.PosDone: there is no more
	floor time.Time        // unless end is resourceid.PosDone: the created_at of the oldest item scanned, which no unscanned item is newer than
	shown int              // how many of items the merged page shows
}

// listPage is one page of a channel's upstream list, as fetched.
type listPage struct {
	items    []gjson.Result // newest first, without those shown before
	times    []time.Time
	pageMode bool   // the upstream pages with page tokens
	next     string // its next page token, or the id to list after; "" when there is none
	hasMore  bool
}

// before is the position whose next item is items[i] of the page fetched
// at p: past every item before it, whoever's.
func (pg *listPage) before(p resourceid.Pos, i int) resourceid.Pos {
	if pg.pageMode {
		q := resourceid.Pos{Channel: p.Channel, Mode: resourceid.PosPage, Skip: i}
		if p.Mode == resourceid.PosPage {
			q.Value, q.Skip = p.Value, p.Skip+i
		}
		return q
	}
	if i == 0 {
		return p
	}
	return resourceid.Pos{Channel: p.Channel, Mode: resourceid.PosAfter, Value: pg.items[i-1].Get("id").Str}
}

// after is the position past the whole page fetched at p.
func (pg *listPage) after(p resourceid.Pos) resourceid.Pos {
	switch {
	case pg.pageMode && pg.next != "":
		return resourceid.Pos{Channel: p.Channel, Mode: resourceid.PosPage, Value: pg.next}
	case !pg.pageMode && pg.hasMore && len(pg.items) > 0:
		return resourceid.Pos{Channel: p.Channel, Mode: resourceid.PosAfter, Value: pg.items[len(pg.items)-1].Get("id").Str}
	}
	return resourceid.Pos{Channel: p.Channel, Mode: resourceid.PosDone}
}

// list serves GET /v1/messages/batches and GET /v1/files for the group.
func (c *resourceCtx) list() *failure {
	kind := c.rq.kind
	q := c.req.URL.Query()
	limit := 20
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			return refused(errInvalid("limit: must be a number from 1 to 1000"))
		}
		limit = n
	}
	if q.Has("before_id") {
		return refused(errInvalid("before_id: the relay merges the lists of several upstreams and pages them forward only; start from the first page and follow after_id (or page)"))
	}
	var chans []*channel
	for _, ch := range c.group.channels {
		if _, ok := servesResource(ch, kind); ok {
			chans = append(chans, ch)
		}
	}
	pos := make([]resourceid.Pos, len(chans))
	for i, ch := range chans {
		pos[i] = resourceid.Pos{Channel: ch.name, Mode: resourceid.PosStart}
	}
	cursor := q.Get("after_id")
	if cursor == "" {
		cursor = q.Get("page")
	}
	if cursor != "" {
		got, ok := resourceid.OpenCursor(c.secret, kind, c.group.name, cursor)
		if !ok {
			// a plain item id (of the group's own) pages a single
			// channel's list
			name, up, isItem := resourceid.ParseItem(c.secret, kind, c.group.name, cursor)
			if !isItem || len(chans) != 1 || chans[0].name != name {
				return refused(errResourceNotFound(kind, cursor))
			}
			if rerr := c.r.checkOwners(c.req.Context(), kind, c.group.name, name, []string{up}, []string{cursor}); rerr != nil {
				return refused(rerr)
			}
			got = []resourceid.Pos{{Channel: name, Mode: resourceid.PosAfter, Value: up}}
		}
		for i := range pos {
			pos[i].Mode = resourceid.PosDone // a channel the cursor does not know joined since: not in this listing
			for _, g := range got {
				if g.Channel == pos[i].Channel {
					pos[i] = g
				}
			}
		}
	}
	// the other parameters pass to every channel as the client sent them
	for _, k := range []string{"after_id", "before_id", "page", "limit"} {
		q.Del(k)
	}

	pages := make([]*listed, len(chans))
	for i, ch := range chans {
		if pos[i].Mode == resourceid.PosDone {
			continue
		}
		l, f := c.scanList(ch, pos[i], q, limit)
		if f != nil {
			return f
		}
		pages[i] = l
	}

	// merge, newest first; a tie goes to the channel listed first
	var data []json.RawMessage
	var firstID string
	for len(data) < limit {
		best := -1
		for i, l := range pages {
			if l == nil || l.shown >= len(l.items) {
				continue
			}
			if best < 0 || l.times[l.shown].After(pages[best].times[pages[best].shown]) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		l := pages[best]
		if len(data) > 0 && heldBack(l.times[l.shown], pages) {
			break
		}
		item := c.rewriteItem([]byte(l.items[l.shown].Raw), l.ch.name)
		if len(data) == 0 {
			firstID = gjson.GetBytes(item, "id").Str
		}
		data = append(data, item)
		l.shown++
	}

	hasMore := false
	for i, l := range pages {
		if l == nil {
			continue
		}
		if l.shown < len(l.items) {
			pos[i] = l.at[l.shown]
		} else {
			pos[i] = l.end
		}
		if pos[i].Mode != resourceid.PosDone {
			hasMore = true
		}
	}
	out := map[string]any{"data": data, "has_more": hasMore, "first_id": nil, "last_id": nil}
	if data == nil {
		out["data"] = []json.RawMessage{}
	}
	if firstID != "" {
		out["first_id"] = firstID
		out["last_id"] = gjson.GetBytes(data[len(data)-1], "id").Str
	}
	if kind == resourceid.File {
		out["next_page"] = nil
	}
	if hasMore {
		next := resourceid.SealCursor(c.secret, kind, c.group.name, pos)
		out["last_id"] = next
		if kind == resourceid.File {
			out["next_page"] = next
		}
	}
	body, _ := json.Marshal(out)
	h := c.w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	c.r.ratelimitHeaders(h, c.in)
	metricResources.WithLabelValues(c.group.name, labelNone, kind.String(), opList.String()).Inc()
	c.w.WriteHeader(http.StatusOK)
	_, _ = c.w.Write(body)
	return nil
}

// heldBack reports whether an item created at t must wait for a later
// page: a channel whose scan stopped short may still hold newer items.
func heldBack(t time.Time, pages []*listed) bool {
	for _, l := range pages {
		if l != nil && l.end.Mode != resourceid.PosDone && !l.floor.IsZero() && t.Before(l.floor) {
			return true
		}
	}
	return false
}

// scanList reads ch's list from p until it holds limit of the group's
// items, the upstream has no more, or listScanPages pages were read.
func (c *resourceCtx) scanList(ch *channel, p resourceid.Pos, query url.Values, limit int) (*listed, *failure) {
	if rerr := c.waitForOwner(ch); rerr != nil {
		return nil, refused(rerr)
	}
	l := &listed{ch: ch}
	for n := 0; ; n++ {
		size := limit
		if n > 0 {
			size = listScanPageSize
		}
		pg, f := c.fetchList(ch, p, query, size)
		if f != nil {
			return nil, f
		}
		ids := make([]string, len(pg.items))
		for i, it := range pg.items {
			ids[i] = it.Get("id").Str
		}
		owners, err := c.r.owners.Lookup(c.req.Context(), c.rq.kind, ch.name, ids, true)
		if err != nil {
			if c.r.fleet == nil {
				c.r.logger.Warn("could not read the owners of batches or files", zap.String("channel", ch.name), zap.Error(err))
			}
			return nil, refused(errOwnersUnavailable("the relay could not read who owns the " + c.rq.kind.String() + " of a list from its storage; retry later"))
		}
		for i, it := range pg.items {
			if owners[i] == c.group.name {
				l.items = append(l.items, it)
				l.times = append(l.times, pg.times[i])
				l.at = append(l.at, pg.before(p, i))
			}
		}
		if len(pg.items) > 0 {
			l.floor = pg.times[len(pg.times)-1]
		}
		p = pg.after(p)
		if p.Mode == resourceid.PosDone || len(l.items) >= limit || n+1 >= listScanPages {
			l.end = p
			return l, nil
		}
	}
}

// fetchList asks one channel for the page of its list at p, of size items.
func (c *resourceCtx) fetchList(ch *channel, p resourceid.Pos, query url.Values, size int) (*listPage, *failure) {
	rp, _ := servesResource(ch, c.rq.kind)
	q := url.Values{}
	for k, vs := range query {
		q[k] = vs
	}
	n := size
	switch p.Mode {
	case resourceid.PosAfter:
		q.Set("after_id", p.Value)
	case resourceid.PosPage:
		if p.Value != "" {
			q.Set("page", p.Value)
		}
		n = min(size+p.Skip, 1000)
	}
	q.Set("limit", strconv.Itoa(n))
	path := pathFiles
	if c.rq.kind == resourceid.Batch {
		path = pathBatches
	}
	call := &provider.ResourceCall{Channel: ch.name, Method: http.MethodGet, Path: path, RawQuery: q.Encode(), Header: c.req.Header, ContentLength: -1}
	a := c.send(ch, rp, call, ch.firstByte)
	if a.resp == nil {
		return nil, a.failure
	}
	defer a.close()
	a.dl.arm(stageResponse, ch.response)
	body, err := io.ReadAll(io.LimitReader(a.resp.Body, c.r.MaxResponseSize+1))
	if err != nil || int64(len(body)) > c.r.MaxResponseSize || !gjson.ValidBytes(body) {
		v := verdict{outcome: outcomeTransient, reason: "a broken list answer"}
		a.end(v)
		return nil, &failure{last: attemptResult{verdict: v, channel: ch}, attempts: 1}
	}
	pg := &listPage{}
	items := gjson.GetBytes(body, "data").Array()
	if p.Mode == resourceid.PosPage {
		items = items[min(p.Skip, len(items)):]
	}
	pg.items = items
	for _, it := range items {
		t, _ := time.Parse(time.RFC3339Nano, it.Get("created_at").Str)
		pg.times = append(pg.times, t)
	}
	if np := gjson.GetBytes(body, "next_page"); np.Exists() {
		pg.pageMode = true
		pg.next, pg.hasMore = np.Str, np.Str != ""
	} else {
		pg.hasMore = gjson.GetBytes(body, "has_more").Bool()
		if len(items) > 0 {
			pg.next = items[len(items)-1].Get("id").Str
		}
	}
	return pg, nil
}
