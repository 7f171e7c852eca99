package relay

import (
	"fmt"

	"github.com/caddyserver/caddy/v2"
)

// provisionBedrock sets up a channel to AWS Bedrock.
func (r *Relay) provisionBedrock(ctx caddy.Context, cfg *Channel, ch *channel) error {
	return fmt.Errorf("provider bedrock: not built yet")
}
