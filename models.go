package relay

import (
	"encoding/json"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/internal/money"
)

// modelInfo is one entry of GET /v1/models, in Anthropic's shape and
// OpenAI's at once: each SDK reads its own fields and ignores the others'.
type modelInfo struct {
	Type        string `json:"type"`
	ID          string `json:"id"`
	DisplayName string `json:"display_name"`
	// CreatedAt (Anthropic's) and Created (OpenAI's) are required by the
	// SDKs; the relay does not know a model's release date, so they are
	// the Unix epoch.
	CreatedAt string `json:"created_at"`
	Object    string `json:"object"`
	Created   int64  `json:"created"`
	OwnedBy   string `json:"owned_by"`
}

type modelList struct {
	Object  string      `json:"object"` // OpenAI's "list"
	Data    []modelInfo `json:"data"`
	HasMore bool        `json:"has_more"`
	FirstID *string     `json:"first_id"`
	LastID  *string     `json:"last_id"`
}

const (
	defaultModelsLimit = 20
	maxModelsLimit     = 1000
)

// modelCatalog is what GET /v1/models shows one group's keys, made when
// the config loads: the models its channels list, in their order, then,
// when a channel of it serves every model, the Claude models of the price
// table, newest first.
type modelCatalog struct {
	list  []modelInfo
	index map[string]int // list's entries by id
	// every says that a channel serves every model: GET /v1/models/{id}
	// also finds a dated snapshot or variant of a model the price table
	// knows
	every  bool
	prices money.Pricebook
}

// newModelCatalog builds the catalog of a group whose channels list listed
// (every: a channel serves every model).
func newModelCatalog(listed []string, every bool, prices money.Pricebook) *modelCatalog {
	ids := slices.Clone(listed)
	if every {
		for _, m := range claudeModels(prices) {
			if !slices.Contains(listed, m) {
				ids = append(ids, m)
			}
		}
	}
	c := &modelCatalog{index: make(map[string]int, len(ids)), every: every, prices: prices}
	for i, id := range ids {
		c.list = append(c.list, modelInfoOf(prices, id))
		c.index[id] = i
	}
	return c
}

// find is the entry of id, and whether the group serves it.
func (c *modelCatalog) find(id string) (modelInfo, bool) {
	if i, ok := c.index[id]; ok {
		return c.list[i], true
	}
	if c.every && c.prices.Lookup(id) != nil {
		return modelInfoOf(c.prices, id), true
	}
	return modelInfo{}, false
}

// serveModels answers GET /v1/models and GET /v1/models/{id} from the
// key's group's catalog, without calling any upstream. An error is
// returned for the request's exit to write.
func serveModels(w http.ResponseWriter, req *http.Request, in *inbound) *relayError {
	c := in.who.key.group.catalog
	if in.route == routeModel {
		id := strings.TrimPrefix(req.URL.Path, "/v1/models/")
		m, ok := c.find(id)
		if !ok {
			return &relayError{status: http.StatusNotFound, typ: "not_found_error", msg: "model " + strconv.Quote(id) + " is not served by this key's group"}
		}
		writeJSON(w, m)
		return nil
	}

	q := req.URL.Query()
	limit := defaultModelsLimit
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxModelsLimit {
			return errInvalid("limit: must be an integer between 1 and 1000")
		}
		limit = n
	}
	from, to, hasMore := 0, len(c.list), false
	if after := q.Get("after_id"); after != "" {
		if i, ok := c.index[after]; ok {
			from = i + 1
		}
	}
	if before := q.Get("before_id"); before != "" {
		if i, ok := c.index[before]; ok && i >= from {
			// the page that ends just before it; has_more: there are
			// more before the page
			to = i
			if to-from > limit {
				from = to - limit
				hasMore = true
			}
		}
	}
	list := modelList{Object: "list", Data: c.list[from:to], HasMore: hasMore}
	if list.Data == nil {
		list.Data = []modelInfo{} // "data": [], not null
	}
	if to-from > limit {
		list.Data, list.HasMore = list.Data[:limit], true
	}
	if n := len(list.Data); n > 0 {
		list.FirstID, list.LastID = &list.Data[0].ID, &list.Data[n-1].ID
	}
	writeJSON(w, list)
	return nil
}

// modelInfoOf is the entry of model id: its display name is the one of its price
// row, or the id when the price table does not know it.
func modelInfoOf(pb money.Pricebook, id string) modelInfo {
	name := id
	if r := pb.Lookup(id); r != nil && r.Name() != "" {
		name = r.Name()
	}
	return modelInfo{Type: "model", ID: id, DisplayName: name, CreatedAt: "1970-01-01T00:00:00Z", Object: "model", OwnedBy: "anthropic"}
}

// claudeModels lists the price table's rows whose names start with
// "claude", newest first as Anthropic lists its models: by version, highest
// first (claude-opus-4-1 before claude-opus-4, claude-3-7-sonnet before
// claude-3-5-haiku), then by name; a row without a version comes last.
func claudeModels(pb money.Pricebook) []string {
	var ids []string
	for m := range pb {
		if strings.HasPrefix(m, "claude") {
			ids = append(ids, m)
		}
	}
	slices.SortFunc(ids, func(a, b string) int {
		if c := slices.Compare(modelVersion(b), modelVersion(a)); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	return ids
}

// modelVersion is the version in a model name: its short numeric parts in
// order ([4 5] for claude-sonnet-4-5-20250929 and claude-3-5-haiku); a date
// is not one.
func modelVersion(id string) []int {
	var v []int
	for part := range strings.SplitSeq(withoutVariant(id), "-") {
		if versionPart(part) {
			n, _ := strconv.Atoi(part)
			v = append(v, n)
		}
	}
	return v
}

// anthropicName is the name Anthropic gives a Claude model, made from its
// id: "Claude", the family capitalised, then the version with dots
// (claude-sonnet-4-5 and its snapshot claude-sonnet-4-5-20250929 are
// "Claude Sonnet 4.5", claude-3-5-haiku is "Claude Haiku 3.5",
// claude-opus-4 is "Claude Opus 4"). An id of another shape has none: "".
func anthropicName(id string) string {
	parts := strings.Split(withoutVariant(id), "-")
	if len(parts) < 2 || parts[0] != "claude" {
		return ""
	}
	parts = parts[1:]
	if last := parts[len(parts)-1]; len(last) == 8 && digits(last) {
		parts = parts[:len(parts)-1] // a dated snapshot
	}
	var family string
	var version []string
	for i, p := range parts {
		switch {
		case versionPart(p):
			if len(version) > 0 && !versionPart(parts[i-1]) {
				return "" // two versions: claude-3-haiku-4
			}
			version = append(version, p)
		case p != "" && letters(p) && family == "":
			family = strings.ToUpper(p[:1]) + p[1:]
		default:
			return ""
		}
	}
	if len(version) == 0 {
		return ""
	}
	name := "Claude"
	if family != "" {
		name += " " + family
	}
	return name + " " + strings.Join(version, ".")
}

// withoutVariant is a model id without a Vertex snapshot or a variant
// (claude-sonnet-4-5@20250929, claude-sonnet-4-5[1m]).
func withoutVariant(id string) string {
	if i := strings.IndexAny(id, "@["); i >= 0 {
		return id[:i]
	}
	return id
}

// versionPart reports whether part of a model id is a version number.
func versionPart(p string) bool {
	return p != "" && len(p) <= 2 && digits(p)
}

func digits(s string) bool {
	return s != "" && strings.Trim(s, "0123456789") == ""
}

func letters(s string) bool {
	return strings.Trim(s, "abcdefghijklmnopqrstuvwxyz") == ""
}

func writeJSON(w http.ResponseWriter, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}
