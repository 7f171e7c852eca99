// Package providertest runs a provider as the relay runs it, for the
// providers' own tests: provisioned for a channel, handed a provider.Call
// made of a client's request, its upstream request sent to an upstream on
// 127.0.0.1, its answer turned into Anthropic's wire and read whole. It
// also holds the fakes of the clouds' APIs (Bedrock's SigV4 check and
// event streams, Google's token endpoint and Vertex's bearer check,
// OpenAI-format answers), the upstreams' error answers with what each
// provider must make of them, and a provider from another package, which
// the providers' tests and the relay's end-to-end tests share. It never
// imports the relay.
package providertest

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"testing"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/tidwall/gjson"
)

// Context is a Caddy context as the relay provisions the provider of the
// channel named channel with; it ends with the test, which gives back what
// a provider keeps in pools across reloads.
func Context(t testing.TB, channel string) caddy.Context {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	return provider.WithChannel(ctx, channel)
}

// Provision provisions p for the channel named channel, as the relay does
// when its config loads, and fails the test when p refuses its config.
func Provision(t testing.TB, p provider.Provider, channel string) {
	t.Helper()
	if pr, ok := p.(caddy.Provisioner); ok {
		if err := pr.Provision(Context(t, channel)); err != nil {
			t.Fatalf("provisioning %T: %v", p, err)
		}
	}
}

// Request is a client's request as the relay hands it to a provider, for
// one attempt on a channel.
type Request struct {
	// Channel is the channel's name. Default: "test".
	Channel string
	// Path is the client's route. Default: provider.PathMessages.
	Path string
	// RawQuery is the client's query string, without '?'.
	RawQuery string
	// Header holds the client's headers, as the relay passes them on (the
	// betas the channel strips already gone). Default: anthropic-version
	// 2023-06-01 and content-type application/json, as the SDKs send them.
	Header http.Header
	// Model is the model id the upstream knows: the body's after the
	// channel's mapping. Default: the body's model.
	Model string
	// Body is the client's body, a JSON object.
	Body string
}

// Call is the attempt's provider.Call: Stream read from the body, and
// Body() the client's body with its model replaced by Model, byte for
// byte as the relay replaces it (every other byte as the client sent it).
func (r Request) Call() *provider.Call {
	if r.Channel == "" {
		r.Channel = "test"
	}
	if r.Path == "" {
		r.Path = provider.PathMessages
	}
	if r.Header == nil {
		r.Header = http.Header{"Anthropic-Version": {provider.AnthropicVersion}, "Content-Type": {"application/json"}}
	}
	src := &source{body: []byte(r.Body), model: gjson.Get(r.Body, "model")}
	if r.Model == "" {
		r.Model = src.model.Str
	}
	c := provider.NewCall(provider.Call{Channel: r.Channel, Path: r.Path, RawQuery: r.RawQuery, Header: r.Header,
		Model: r.Model, Stream: gjson.Get(r.Body, "stream").Type == gjson.True}, src)
	return &c
}

// source is a Call's body: the client's, its model replaced as the relay
// replaces it.
type source struct {
	body  []byte
	model gjson.Result // the body's model, where it stands
}

// Body implements provider.Source.
func (s *source) Body(model string) []byte {
	if model == s.model.Str || !s.model.Exists() {
		return s.body
	}
	out := append([]byte(nil), s.body[:s.model.Index]...)
	out = append(out, '"')
	out = append(out, model...)
	out = append(out, '"')
	return append(out, s.body[s.model.Index+len(s.model.Raw):]...)
}

// NewRequest implements provider.Source.
func (s *source) NewRequest(ctx context.Context, method, url string, body []byte) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	return req, nil
}

// Answer is what a provider made of an upstream's answer, read whole.
type Answer struct {
	// Status and Header are the answer's, as the provider made them.
	Status int
	Header http.Header
	// Body is the answer's body, read whole.
	Body []byte
	// RefusesModel: the provider says the upstream refused the model
	// (provider.RefusesModel).
	RefusesModel bool
}

// Do runs one attempt of c on p as the relay does: p builds the upstream
// request, p's own transport (a provider.Transporter's) or an HTTP client
// sends it, and p turns the answer into Anthropic's wire, which Do reads
// whole. Its error is NewRequest's (an UpstreamError among them: the relay
// answers it as the upstream's), the transport's or Response's; an answer
// that breaks off is what came before it, with the read's error.
func Do(t testing.TB, p provider.Provider, c *provider.Call) (*Answer, error) {
	t.Helper()
	req, err := p.NewRequest(t.Context(), c)
	if err != nil {
		return nil, err
	}
	rt := http.DefaultTransport
	if tr, ok := p.(provider.Transporter); ok {
		rt = tr.Transport()
	}
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out, err := p.Response(resp, c)
	if err != nil {
		return nil, err
	}
	defer out.Body.Close()
	a := &Answer{Status: out.StatusCode, Header: out.Header, RefusesModel: provider.RefusesModel(out)}
	a.Body, err = io.ReadAll(out.Body)
	return a, err
}

// Send is Do for an attempt that must get an answer: it fails the test
// on an error.
func Send(t testing.TB, p provider.Provider, c *provider.Call) *Answer {
	t.Helper()
	a, err := Do(t, p, c)
	if err != nil {
		t.Fatalf("the attempt failed: %v", err)
	}
	return a
}

// Bodies of the tests' requests: a short message, and the same streamed.
const (
	SimpleBody = `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	StreamBody = `{"model":"claude-sonnet-4-5","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`
)
