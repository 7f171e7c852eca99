package relay

import (
	"strconv"

	"go.uber.org/zap"
)

// What the relay says when a config loads: one line per relay handler with
// what it loaded, so that a first start is not silent (a status page says
// where it listens).

// logReady logs what r loaded.
func (r *Relay) logReady() {
	r.logger.Info("relay ready: "+count(len(r.Channels), "channel")+", "+count(len(r.groups), "group")+", "+count(len(r.keys), "key"),
		zap.Int("channels", len(r.Channels)), zap.Int("groups", len(r.groups)), zap.Int("keys", len(r.keys)))
}

// count is "1 key", "3 keys".
func count(n int, noun string) string {
	if n != 1 {
		noun += "s"
	}
	return strconv.Itoa(n) + " " + noun
}
