//go:build !unix

package main

// deadAddr is a loopback address nothing listens on (another process may
// take it during the run: on Unix the port is held, dead_unix.go).
func deadAddr() (string, func(), error) {
	addr, err := freeAddr()
	return addr, func() {}, err
}
