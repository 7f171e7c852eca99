package relay

// The built-in providers, each a module of its own package that uses only
// the provider package, as one from another repository does. Importing the
// relay compiles them in: `xcaddy build --with github.com/caddy-relay/relay`
// gets them all.
import (
	_ "github.com/caddy-relay/relay/providers/anthropic"
	_ "github.com/caddy-relay/relay/providers/bedrock"
	_ "github.com/caddy-relay/relay/providers/mock"
	_ "github.com/caddy-relay/relay/providers/openai"
	_ "github.com/caddy-relay/relay/providers/vertex"
)
