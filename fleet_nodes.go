package relay

import (
	"fmt"
	"net/http"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddyserver/caddy/v2"
)

// fleet answers GET /relay/fleet: the nodes of the fleet this process
// belongs to, or this process alone when it keeps its state to itself.
func (adminAPI) fleet(w http.ResponseWriter, _ *http.Request) error {
	rows, err := fleetRows()
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: err}
	}
	return writeAdminJSON(w, rows)
}

// fleetRows lists the nodes of every fleet of the loaded configs, or this
// node alone when none has storage.
func fleetRows() ([]fleet.Node, error) {
	var rows []fleet.Node
	var failed error
	seen := map[string]bool{}
	fleets.Range(func(_, v any) bool {
		nodes, err := v.(*member).Nodes()
		if err != nil {
			failed = err
			return false
		}
		for _, n := range nodes {
			if !seen[n.ID] {
				seen[n.ID] = true
				rows = append(rows, n)
			}
		}
		return true
	})
	if failed != nil {
		return nil, fmt.Errorf("the fleet's storage (Redis) did not answer: %v", failed)
	}
	if rows == nil {
		rows = []fleet.Node{fleet.SelfNode()}
	}
	for i := range rows {
		rows[i].Self = rows[i].ID == fleet.ThisNode().ID
		if rows[i].Leases == nil {
			rows[i].Leases = []fleet.Block{}
		}
	}
	return rows, nil
}
