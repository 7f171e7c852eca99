package provider

import (
	"context"
	"io"
	"net/http"
	"testing"
)

// countingSource is a Source that counts what it is asked.
type countingSource struct {
	body   []byte
	bodies int
}

func (s *countingSource) Body(model string) []byte {
	s.bodies++
	return append([]byte(model+":"), s.body...)
}

func (s *countingSource) NewRequest(ctx context.Context, method, url string, body []byte) (*http.Request, error) {
	return http.NewRequestWithContext(ctx, method, url, nil)
}

func TestCallBodyComesFromItsSourceOnce(t *testing.T) {
	src := &countingSource{body: []byte("{}")}
	c := NewCall(Call{Model: "m", Path: PathCountTokens}, src)
	if string(c.Body()) != "m:{}" || string(c.Body()) != "m:{}" || src.bodies != 1 {
		t.Errorf("Body %q, asked %d times", c.Body(), src.bodies)
	}
	if !c.CountTokens() {
		t.Error("a count_tokens call does not count tokens")
	}
}

func TestACallWithoutSourceSharesNothing(t *testing.T) {
	var c Call
	if c.Body() != nil {
		t.Error("a call without a source has a body")
	}
	req, err := c.NewRequest(context.Background(), http.MethodPost, "http://upstream.invalid/v1/messages", []byte("abc"))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		rd, _ := req.GetBody()
		if b, _ := io.ReadAll(rd); string(b) != "abc" {
			t.Errorf("GetBody %q", b)
		}
	}
}

func TestForwardHeaders(t *testing.T) {
	src := http.Header{"Anthropic-Beta": {"a-2030"}, "X-Api-Key": {"sk-client"}, "Authorization": {"Bearer sk"}, "Accept": {"*/*"}, "Connection": {"close"}}
	dst := http.Header{}
	ForwardHeaders(dst, src)
	if len(dst) != 4 || dst.Get("Anthropic-Beta") != "a-2030" || dst.Get("Accept") != "*/*" ||
		dst.Get("Content-Type") != "application/json" || dst["User-Agent"][0] != "" {
		t.Errorf("forwarded %v", dst)
	}
	if got := Betas(http.Header{"Anthropic-Beta": {"a, b", "b,c,,"}}); len(got) != 3 {
		t.Errorf("Betas = %q", got)
	}
}
