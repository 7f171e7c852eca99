//go:build unix

package main

import (
	"net"
	"strconv"
	"syscall"
)

// deadAddr is a loopback address that refuses connections for as long as
// the run lasts: a TCP socket bound to it but never listening, so a
// connection to it is refused, and no other process (a test of another
// package running beside the harness, say) can take the port and answer
// the dead channel's requests. close gives the port back.
func deadAddr() (addr string, close func(), err error) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		return "", nil, err
	}
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		syscall.Close(fd)
		return "", nil, err
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		syscall.Close(fd)
		return "", nil, err
	}
	port := sa.(*syscall.SockaddrInet4).Port
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), func() { syscall.Close(fd) }, nil
}
