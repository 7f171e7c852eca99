package relay

import (
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/tidwall/gjson"
)

// A list of batches or files merges the lists of the group's channels that
// serve the resource, newest first as Anthropic sorts them. The cursor the
// client gets (last_id, and next_page for files) is the relay's own: it
// holds, sealed as ids are, where each channel's list stands, in that
// channel's own terms (after an id, or a page token and how many of that
// page were shown), so the next page asks each channel for what follows.
// Lists page forward only (after_id, page): before_id is refused, since a
// merged list has no single place to go back from.

// listPos is where one channel's list stands in a merged list.
type listPos struct {
	channel string
	mode    byte   // posStart, posAfter, posPage or posDone
	value   string // the upstream's id (posAfter) or page token (posPage, "" for its first page)
	skip    int    // posPage: how many of that page were shown already
}

const (
	posStart = 's' // nothing shown yet
	posAfter = 'a' // shown up to the item value
	posPage  = 'p' // shown up to skip items into the page value
	posDone  = 'd' // all shown
)

// sealCursor encodes the positions as a cursor of kind for group.
func sealCursor(secret []byte, kind resourceKind, group string, pos []listPos) string {
	p := []byte{tagCursor}
	for _, q := range pos {
		p = binary.AppendUvarint(p, uint64(len(q.channel)))
		p = append(p, q.channel...)
		p = append(p, q.mode)
		p = binary.AppendUvarint(p, uint64(len(q.value)))
		p = append(p, q.value...)
		p = binary.AppendUvarint(p, uint64(q.skip))
	}
	return sealID(secret, kind, group, p)
}

// openCursor decodes a cursor of kind for group; false when it is not one.
func openCursor(secret []byte, kind resourceKind, group, s string) ([]listPos, bool) {
	p := openID(secret, kind, group, s)
	if len(p) == 0 || p[0] != tagCursor {
		return nil, false
	}
	p = p[1:]
	str := func() (string, bool) {
		n, w := binary.Uvarint(p)
		if w <= 0 || n > uint64(len(p)-w) {
			return "", false
		}
		v := string(p[w : w+int(n)])
		p = p[w+int(n):]
		return v, true
	}
	var out []listPos
	for len(p) > 0 {
		var q listPos
		var ok bool
		if q.channel, ok = str(); !ok || len(p) == 0 {
			return nil, false
		}
		q.mode, p = p[0], p[1:]
		if q.value, ok = str(); !ok {
			return nil, false
		}
		n, w := binary.Uvarint(p)
		if w <= 0 || n > 1<<20 {
			return nil, false
		}
		q.skip, p = int(n), p[w:]
		out = append(out, q)
	}
	return out, true
}

// listed is one channel's page, as fetched.
type listed struct {
	ch       *channel
	items    []gjson.Result // newest first, without those shown before
	times    []time.Time
	shown    int    // how many of items the merged page shows
	pageMode bool   // the upstream pages with page tokens
	next     string // its next page token, or the id to list after; "" when there is none
	hasMore  bool
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
	pos := make([]listPos, len(chans))
	for i, ch := range chans {
		pos[i] = listPos{channel: ch.name, mode: posStart}
	}
	cursor := q.Get("after_id")
	if cursor == "" {
		cursor = q.Get("page")
	}
	if cursor != "" {
		got, ok := openCursor(c.secret, kind, c.group.name, cursor)
		if !ok {
			// a plain item id pages a single channel's list
			name, up, isItem := parseItemID(c.secret, kind, c.group.name, cursor)
			if !isItem || len(chans) != 1 || chans[0].name != name {
				return refused(errResourceNotFound(kind, cursor))
			}
			got = []listPos{{channel: name, mode: posAfter, value: up}}
		}
		for i := range pos {
			pos[i].mode = posDone // a channel the cursor does not know joined since: not in this listing
			for _, g := range got {
				if g.channel == pos[i].channel {
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
		if pos[i].mode == posDone {
			continue
		}
		l, f := c.fetchList(ch, pos[i], q, limit)
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
		p := &pos[i]
		switch {
		case l.shown < len(l.items) && l.pageMode:
			if p.mode != posPage {
				p.value, p.skip = "", 0
			}
			p.mode, p.skip = posPage, p.skip+l.shown
		case l.shown < len(l.items):
			if l.shown > 0 {
				p.mode, p.value = posAfter, l.items[l.shown-1].Get("id").Str
			}
		case l.hasMore && l.next != "":
			p.mode, p.value, p.skip = posAfter, l.next, 0
			if l.pageMode {
				p.mode = posPage
			}
		default:
			p.mode = posDone
		}
		if p.mode != posDone {
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
	if kind == kindFile {
		out["next_page"] = nil
	}
	if hasMore {
		next := sealCursor(c.secret, kind, c.group.name, pos)
		out["last_id"] = next
		if kind == kindFile {
			out["next_page"] = next
		}
	}
	body, _ := json.Marshal(out)
	h := c.w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	c.r.ratelimitHeaders(h, c.in)
	c.in.status = http.StatusOK
	metricResources.WithLabelValues(c.group.name, labelNone, kind.String(), opList.String()).Inc()
	c.w.WriteHeader(http.StatusOK)
	_, _ = c.w.Write(body)
	return nil
}

// fetchList asks one channel for the page of its list after p.
func (c *resourceCtx) fetchList(ch *channel, p listPos, query url.Values, limit int) (*listed, *failure) {
	if rerr := c.waitForOwner(ch); rerr != nil {
		return nil, refused(rerr)
	}
	rp, _ := servesResource(ch, c.rq.kind)
	q := url.Values{}
	for k, vs := range query {
		q[k] = vs
	}
	n := limit
	switch p.mode {
	case posAfter:
		q.Set("after_id", p.value)
	case posPage:
		if p.value != "" {
			q.Set("page", p.value)
		}
		n = min(limit+p.skip, 1000)
	}
	q.Set("limit", strconv.Itoa(n))
	path := pathFiles
	if c.rq.kind == kindBatch {
		path = pathBatches
	}
	call := &ResourceCall{Channel: ch.name, Method: http.MethodGet, Path: path, RawQuery: q.Encode(), Header: c.req.Header, ContentLength: -1}
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
	l := &listed{ch: ch}
	items := gjson.GetBytes(body, "data").Array()
	if p.mode == posPage {
		items = items[min(p.skip, len(items)):]
	}
	l.items = items
	for _, it := range items {
		t, _ := time.Parse(time.RFC3339Nano, it.Get("created_at").Str)
		l.times = append(l.times, t)
	}
	if np := gjson.GetBytes(body, "next_page"); np.Exists() {
		l.pageMode = true
		l.next, l.hasMore = np.Str, np.Str != ""
	} else {
		l.hasMore = gjson.GetBytes(body, "has_more").Bool()
		if len(items) > 0 {
			l.next = items[len(items)-1].Get("id").Str
		}
	}
	return l, nil
}
