package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"
)

const (
	// openParallel bounds the streams being opened at once, well below the
	// listen backlog.
	openParallel = 64
	// openTimeout bounds the opening of all the idle streams.
	openTimeout = 60 * time.Second
)

// heldStreams are idle streams held open until close.
type heldStreams struct {
	cancel context.CancelFunc
	mu     sync.Mutex
	bodies []io.ReadCloser
	err    error // why the first stream that failed did
}

// openIdleStreams opens n streams through url, openParallel at a time, each
// read up to its first content_block_delta, and holds them open.
func openIdleStreams(ctx context.Context, url string, n int) *heldStreams {
	ctx, cancel := context.WithCancel(ctx)
	h := &heldStreams{cancel: cancel}
	client := &http.Client{Transport: &http.Transport{}}
	body := messageBody(true)
	deadline := time.AfterFunc(openTimeout, cancel)
	defer deadline.Stop()
	sem := make(chan struct{}, openParallel)
	var wg sync.WaitGroup
	for range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			h.add(openIdleStream(ctx, client, url, body))
		})
	}
	wg.Wait()
	return h
}

// openIdleStream posts a streaming request and reads its events up to the
// first content_block_delta; the caller closes the body it returns.
func openIdleStream(ctx context.Context, client *http.Client, url string, body []byte) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header = requestHeader()
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		return nil, fmt.Errorf("status %d", resp.StatusCode)
	}
	lines := bufio.NewScanner(resp.Body)
	for lines.Scan() {
		if lines.Text() == "event: content_block_delta" {
			return resp.Body, nil
		}
	}
	resp.Body.Close()
	return nil, fmt.Errorf("stream ended before its first content_block_delta: %v", lines.Err())
}

// add keeps an opened stream, or the first error.
func (h *heldStreams) add(body io.ReadCloser, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case err == nil:
		h.bodies = append(h.bodies, body)
	case h.err == nil:
		h.err = err
	}
}

// opened is the number of streams held open.
func (h *heldStreams) opened() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.bodies)
}

// close closes every stream.
func (h *heldStreams) close() {
	h.cancel()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, b := range h.bodies {
		b.Close()
	}
}
