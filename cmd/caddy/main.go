// Command caddy is Caddy with the relay module built in: the same binary as
// xcaddy builds from this checkout (see docs/operations.md), buildable with
// nothing but the Go module cache.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddy-relay/relay"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

func main() {
	caddycmd.Main()
}
