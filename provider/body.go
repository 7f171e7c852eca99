package provider

import (
	"bytes"
	"net/http"
	"strconv"

	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// CloudBody rewrites a Messages body for a cloud endpoint (Bedrock,
// Vertex): the top-level fields in drop leave it (the model goes in the
// URL; fields the cloud rejects), and anthropic_version is set to version
// when the client sent none. Every other byte stays as the client sent it.
// The result never shares body's memory when it differs from it.
func CloudBody(body []byte, version string, drop []string) ([]byte, error) {
	out := body
	for _, f := range drop {
		if !gjson.GetBytes(out, gjson.Escape(f)).Exists() {
			continue
		}
		var err error
		if out, err = sjson.DeleteBytes(out, gjson.Escape(f)); err != nil {
			return nil, err
		}
	}
	if gjson.GetBytes(out, "anthropic_version").Exists() {
		return out, nil
	}
	return sjson.SetBytes(out, "anthropic_version", version)
}

// replacedBody is the body of an upstream answer a provider rewrote. It
// carries what only the provider could tell from the original.
type replacedBody struct {
	*bytes.Reader
	refusesModel bool
}

func (*replacedBody) Close() error { return nil }

// ReplaceBody returns resp with body (of contentType) in place of its own,
// which it closes; its headers are a copy, with Content-Type and
// Content-Length set.
func ReplaceBody(resp *http.Response, contentType string, body []byte) *http.Response {
	_ = resp.Body.Close()
	out := *resp
	out.Header = resp.Header.Clone()
	out.Header.Set("Content-Type", contentType)
	out.Header.Set("Content-Length", strconv.Itoa(len(body)))
	out.ContentLength = int64(len(body))
	out.Body = &replacedBody{Reader: bytes.NewReader(body)}
	return &out
}

// RefusesModel reports whether a provider's Response made resp from an
// upstream's refusal of the model (UpstreamError.RefusesModel): the relay
// asks it.
func RefusesModel(resp *http.Response) bool {
	b, ok := resp.Body.(*replacedBody)
	return ok && b.refusesModel
}
