package relay

// Helpers shared by the package's tests.

import (
	"encoding/json"
)

// upstream renders a channel's provider config: its name and key, value
// pairs of its options (strings).
func upstream(provider string, kv ...string) json.RawMessage {
	m := map[string]string{"provider": provider}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	b, _ := json.Marshal(m)
	return b
}
