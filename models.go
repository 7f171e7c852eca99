package relay

import (
	"encoding/json"
	"net/http"
	"slices"
	"strconv"
	"strings"
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

// serveModels answers GET /v1/models and GET /v1/models/{id} from the
// models the key's group lists, without calling any upstream; a channel that
// serves every model adds no names. An error is returned for the request's
// exit to write.
func serveModels(w http.ResponseWriter, req *http.Request, in *inbound) *relayError {
	models := in.who.key.group.models
	if in.route == routeModel {
		id := strings.TrimPrefix(req.URL.Path, "/v1/models/")
		if !slices.Contains(models, id) {
			return &relayError{status: http.StatusNotFound, typ: "not_found_error", msg: "model " + strconv.Quote(id) + " is not served by this key's group"}
		}
		writeJSON(w, info(id))
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
	page := models
	if after := q.Get("after_id"); after != "" {
		if i := slices.Index(page, after); i >= 0 {
			page = page[i+1:]
		}
	}
	if before := q.Get("before_id"); before != "" {
		if i := slices.Index(page, before); i >= 0 {
			page = page[:i]
			if len(page) > limit {
				page = page[len(page)-limit:]
			}
		}
	}
	list := modelList{Object: "list", Data: make([]modelInfo, 0, min(limit, len(page)))}
	if len(page) > limit {
		page, list.HasMore = page[:limit], true
	}
	for _, m := range page {
		list.Data = append(list.Data, info(m))
	}
	if len(page) > 0 {
		list.FirstID, list.LastID = &page[0], &page[len(page)-1]
	}
	writeJSON(w, list)
	return nil
}

func info(id string) modelInfo {
	return modelInfo{Type: "model", ID: id, DisplayName: id, CreatedAt: "1970-01-01T00:00:00Z", Object: "model", OwnedBy: "anthropic"}
}

func writeJSON(w http.ResponseWriter, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}
