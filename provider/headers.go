package provider

import (
	"net/http"
	"slices"
	"strings"
)

// AnthropicVersion is the API version a request to an Anthropic-wire
// upstream carries when its client named none (an OpenAI client knows of no
// such header): the version the official SDKs send. The API refuses a
// request without one.
const AnthropicVersion = "2023-06-01"

// ForwardHeaders copies the client headers in src that an upstream may see
// into dst: every anthropic-* header, content-type, accept and user-agent.
// Credentials, hop-by-hop headers and Host never pass. Without a
// content-type it sets application/json, and without a user-agent an empty
// one, as reverse_proxy does (no Go default user agent).
func ForwardHeaders(dst, src http.Header) {
	for k, vs := range src {
		switch {
		case strings.HasPrefix(k, "Anthropic-"), k == "Content-Type", k == "Accept", k == "User-Agent":
			dst[k] = vs
		}
	}
	if dst.Get("Content-Type") == "" {
		dst.Set("Content-Type", "application/json")
	}
	if _, ok := dst["User-Agent"]; !ok {
		dst["User-Agent"] = []string{""}
	}
}

// Betas splits the anthropic-beta headers of h (comma-separated, possibly
// repeated) into their distinct flags. A Call's header holds only those
// the channel's selection let through.
func Betas(h http.Header) []string {
	var out []string
	for _, v := range h.Values("Anthropic-Beta") {
		for flag := range strings.SplitSeq(v, ",") {
			if flag = strings.TrimSpace(flag); flag != "" && !slices.Contains(out, flag) {
				out = append(out, flag)
			}
		}
	}
	return out
}
