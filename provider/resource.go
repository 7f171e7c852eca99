package provider

import (
	"context"
	"io"
	"net/http"
)

// ResourceProvider is a Provider whose upstream also serves Anthropic's
// Message Batches and Files APIs. A provider that does not implement it
// serves neither: its channels are never asked to create a batch or take a
// file, and are left out of the lists.
type ResourceProvider interface {
	Provider

	// ServesResource reports whether the upstream serves a resource:
	// ResourceBatches or ResourceFiles.
	ServesResource(resource string) bool

	// NewResourceRequest builds a request of those APIs: c.Method on
	// c.Path (which holds the upstream's own ids) with c.RawQuery and
	// c.Body unchanged, the channel's credential and c.ForwardHeaders.
	NewResourceRequest(ctx context.Context, c *ResourceCall) (*http.Request, error)
}

// Resources a ResourceProvider may serve.
const (
	ResourceBatches = "batches"
	ResourceFiles   = "files"
)

// ResourceCall is one request of the Message Batches or Files API, as a
// provider sees it.
type ResourceCall struct {
	// Channel is the name of the channel the request goes to.
	Channel string
	// Method and Path are the upstream request's, such as GET
	// /v1/files/file_011.../content: the upstream's own ids, escaped.
	Method, Path string
	// RawQuery is the query string, without '?'.
	RawQuery string
	// Header holds the client's request headers.
	Header http.Header
	// Body is the request's body, nil for none. An upload's is the
	// client's own, streamed: it can be read once.
	Body io.Reader
	// ContentLength is Body's length, -1 when it is not known.
	ContentLength int64
}

// ForwardHeaders copies the client headers an upstream may see into dst,
// as Call.ForwardHeaders does.
func (c *ResourceCall) ForwardHeaders(dst http.Header) { ForwardHeaders(dst, c.Header) }
