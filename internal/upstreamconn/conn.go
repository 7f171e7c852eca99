// Package upstreamconn makes the plain TCP connections of an upstream's
// transport copy request bodies through pooled buffers.
package upstreamconn

import (
	"context"
	"io"
	"net"
	"net/http"
	"sync"
)

// Conn is a plain TCP connection to an upstream whose ReadFrom copies
// through a pooled buffer.
//
// net/http writes a request body that does not fit its connection's write
// buffer (4 KiB by default) with the connection's ReadFrom, handing it the
// body behind an io.LimitedReader. A *net.TCPConn can splice only from
// sockets and files, so for a body in memory its ReadFrom falls back to
// io.Copy, which allocates a buffer of the rest of the body, up to 32 KiB,
// for every request: a Messages request of 10 KB allocated more bytes for
// that copy than the relay did for all the rest of its work, and the
// garbage collector paid for them. The relay's upstream request bodies are
// in memory (the replay buffer) or a client's body read through a buffer,
// never a socket or a file, so copying them through a pooled buffer loses
// nothing.
type Conn struct{ *net.TCPConn }

// ReadFrom copies r to the connection through a pooled buffer.
func (c Conn) ReadFrom(r io.Reader) (int64, error) {
	bp := copyBuffers.Get().(*[]byte)
	n, err := io.CopyBuffer(writeOnly{c.TCPConn}, r, *bp)
	copyBuffers.Put(bp)
	return n, err
}

// writeOnly hides the connection's ReadFrom from io.CopyBuffer, which
// would call it back. (One pointer: made an io.Writer, it allocates
// nothing.)
type writeOnly struct{ c *net.TCPConn }

func (w writeOnly) Write(p []byte) (int, error) { return w.c.Write(p) }

// copyBuffers are the buffers of Conn.ReadFrom: the size io.Copy would
// allocate.
var copyBuffers = sync.Pool{New: func() any {
	b := make([]byte, 32<<10)
	return &b
}}

// PooledCopies makes the TCP connections t dials Conns. (Over TLS, the
// *tls.Conn on top has no ReadFrom, and HTTP/1.1's copy to it still
// allocates; HTTP/2, which an https upstream negotiates, writes through
// buffers of its own.)
func PooledCopies(t *http.Transport) {
	dial := t.DialContext
	if dial == nil {
		return
	}
	t.DialContext = func(ctx context.Context, network, address string) (net.Conn, error) {
		c, err := dial(ctx, network, address)
		if tc, ok := c.(*net.TCPConn); ok && err == nil {
			return Conn{tc}, nil
		}
		return c, err
	}
}
