package relay

import (
	"fmt"

	"github.com/caddyserver/caddy/v2"
)

// provisionVertex sets up a channel to Google Vertex AI.
func (r *Relay) provisionVertex(ctx caddy.Context, cfg *Channel, ch *channel) error {
	return fmt.Errorf("provider vertex: not built yet")
}
