// Package bedrock is the relay's provider for AWS Bedrock's InvokeModel:
// module http.handlers.relay.providers.bedrock.
package bedrock

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream"
	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream/eventstreamapi"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/caddy-relay/relay/internal/sse"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// Bedrock defaults.
const bedrockVersion = "bedrock-2023-05-31"

func init() {
	caddy.RegisterModule(Provider{})
}

// Provider speaks AWS Bedrock's InvokeModel: the model in the path,
// the body without model and stream but with anthropic_version and the
// betas, SigV4 (or a Bedrock API key), and an AWS event stream for streams,
// which becomes Anthropic's SSE.
type Provider struct {
	// Region is the AWS region the channel signs for: us-east-1... Required.
	Region string `json:"region,omitempty"`

	// URL is the runtime endpoint. Default: the region's
	// (https://bedrock-runtime.<region>.amazonaws.com); set it to reach a
	// VPC endpoint or a test server.
	URL string `json:"url,omitempty"`

	// AccessKeyID, SecretAccessKey and SessionToken are the AWS credentials,
	// usually placeholders. Without them (and without an api_key), the AWS
	// default credential chain is used: environment, shared config files,
	// container and instance roles.
	AccessKeyID     string `json:"access_key_id,omitempty"`
	SecretAccessKey string `json:"secret_access_key,omitempty"`
	SessionToken    string `json:"session_token,omitempty"`

	// APIKey is a Bedrock API key, sent as a bearer token instead of SigV4
	// credentials.
	APIKey string `json:"api_key,omitempty"`

	// AnthropicVersion is the `anthropic_version` put in the body when the
	// request has none. Default: bedrock-2023-05-31.
	AnthropicVersion string `json:"anthropic_version,omitempty"`

	// Betas lists the anthropic-beta flags this channel supports, in place
	// of the feature table's Bedrock column (`*`: every flag). A request
	// carrying another flag goes to another channel, or gets
	// capability_not_available: Bedrock refuses a whole request for a flag
	// it does not know. Supported flags go in the body, as anthropic_beta.
	Betas []string `json:"betas,omitempty"`

	// StripFields lists top-level body fields removed from every request
	// on this channel (the channel's `strip` line says the same for the
	// feature table's fields). Default: none; nothing a client sent is
	// removed unless configured.
	StripFields []string `json:"strip_fields,omitempty"`

	endpoint string                  // scheme://host of the runtime API
	creds    aws.CredentialsProvider // nil with an API key
	apiKey   string
	signer   *v4.Signer
	version  string
	drop     []string // body fields removed: model, stream and strip_fields
	account  string   // the credential's account, as Account says
}

// CaddyModule returns the Caddy module information.
func (Provider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.bedrock",
		New: func() caddy.Module { return new(Provider) },
	}
}

// check validates what needs no secret; the Caddyfile adapter runs it too.
func (p *Provider) check() error {
	switch {
	case p.Region == "":
		return fmt.Errorf("no region: a bedrock channel signs for one region")
	case (p.AccessKeyID == "") != (p.SecretAccessKey == ""):
		return fmt.Errorf("access_key_id and secret_access_key go together")
	case p.APIKey != "" && p.AccessKeyID != "":
		return fmt.Errorf("an api_key (bearer) and access keys (SigV4) exclude each other")
	}
	return provider.CheckURL(p.URL)
}

// BaseURL implements provider.Provider.
func (p *Provider) BaseURL() string {
	return strings.TrimSuffix(cmp.Or(p.URL, "https://bedrock-runtime."+p.Region+".amazonaws.com"), "/")
}

// Provision resolves the credentials; the default chain fetches nothing
// until the first request.
func (p *Provider) Provision(ctx caddy.Context) error {
	if err := p.check(); err != nil {
		return err
	}
	p.endpoint = p.BaseURL()
	p.signer = v4.NewSigner()
	p.version = cmp.Or(p.AnthropicVersion, bedrockVersion)
	p.drop = append([]string{"model", "stream"}, p.StripFields...)
	var err error
	switch {
	case p.APIKey != "":
		p.apiKey, err = provider.Secret(ctx, "api_key", p.APIKey)
		p.account = p.Region + "/key-" + provider.Digest(p.apiKey)
	case p.AccessKeyID != "":
		var id, secret, session string
		if id, err = provider.Secret(ctx, "access_key_id", p.AccessKeyID); err != nil {
			return err
		}
		if secret, err = provider.Secret(ctx, "secret_access_key", p.SecretAccessKey); err != nil {
			return err
		}
		if p.SessionToken != "" {
			if session, err = provider.Secret(ctx, "session_token", p.SessionToken); err != nil {
				return err
			}
		}
		p.creds = credentials.NewStaticCredentialsProvider(id, secret, session)
		p.account = p.Region + "/key-" + provider.Digest(id)
	default:
		awsCfg, cerr := awsconfig.LoadDefaultConfig(ctx, awsconfig.WithRegion(p.Region))
		if cerr != nil {
			return fmt.Errorf("AWS default credentials: %v", cerr)
		}
		p.creds = awsCfg.Credentials
		p.account = p.Region + "/default-credentials"
	}
	return err
}

// Account implements provider.AccountNamer: the region and the digest of
// the credential (the access key id, or the API key); with the AWS default
// chain, the region alone, since every such channel of a process signs as
// the same principal. An AWS account reached with two access keys is two
// domains unless the channels' config names one (signature_domain).
func (p *Provider) Account() string { return p.account }

// GenAIProviderName implements provider.GenAINamer: the conventions' name of
// AWS Bedrock.
func (*Provider) GenAIProviderName() string { return "aws.bedrock" }

// features is what InvokeModel takes of the feature table; it refuses
// every other feature, and a whole request for a beta flag it does not know
// (docs/providers.md gives the source of each).
var features = map[string]provider.Support{
	"context_management":                       provider.Supported,
	"output_config":                            provider.Supported,
	"tool_search":                              provider.Supported,
	"long_context":                             provider.Supported,
	"compact-2026-01-12":                       provider.Supported,
	"computer-use-2024-10-22":                  provider.Supported,
	"computer-use-2025-01-24":                  provider.Supported,
	"context-1m-2025-08-07":                    provider.Supported,
	"context-management-2025-06-27":            provider.Supported,
	"dev-full-thinking-2025-05-14":             provider.Supported,
	"effort-2025-11-24":                        provider.Supported,
	"fine-grained-tool-streaming-2025-05-14":   provider.Supported,
	"interleaved-thinking-2025-05-14":          provider.Supported,
	"mcp-client-2025-04-04":                    provider.Supported,
	"mcp-client-2025-11-20":                    provider.Supported,
	"model-context-window-exceeded-2025-08-26": provider.Supported,
	"output-128k-2025-02-19":                   provider.Supported,
	"pdfs-2024-09-25":                          provider.Supported,
	"search-results-2025-06-09":                provider.Supported,
	"token-counting-2024-11-01":                provider.Supported,
	"token-efficient-tools-2025-02-19":         provider.Supported,
	"tool-search-tool-2025-10-19":              provider.Supported,
	"web-search-2025-03-05":                    provider.Supported,
}

// Supports implements provider.FeatureSupport: the feature table's Bedrock
// column, with the channel's betas and strip_fields in place of its own.
func (p *Provider) Supports(name string) provider.Support {
	c := provider.Column{Default: provider.Unsupported, Features: features, Betas: p.Betas, Strip: p.StripFields}
	return c.Supports(name)
}

// The starts of Bedrock's refusals of a feature (as Response words them);
// the rest of the message names it, or not.
const (
	wordExtraneousKey = "bedrock: ValidationException: Malformed input request: #: extraneous key [" // "...[<field>] is not permitted"
	wordInvalidBeta   = "bedrock: ValidationException: invalid beta flag"
)

// ReadRefusal implements provider.RefusalReader: Bedrock names a body field
// it does not take, and refuses a beta flag without naming it.
func (*Provider) ReadRefusal(msg string) provider.Refusal {
	if rest, ok := strings.CutPrefix(msg, wordExtraneousKey); ok {
		if name, _, found := strings.Cut(rest, "] is not permitted"); found {
			return provider.Refusal{Fields: []string{name}}
		}
		return provider.Refusal{}
	}
	return provider.Refusal{SomeBeta: strings.HasPrefix(msg, wordInvalidBeta)}
}

// NewRequest implements provider.Provider.
func (p *Provider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	id := c.Model
	body, err := provider.CloudBody(c.Body(), p.version, p.drop)
	if err != nil {
		return nil, err
	}
	// the betas the selection let through (the client may not send the
	// body's anthropic_beta itself: inspect refuses it)
	if betas := provider.Betas(c.Header); len(betas) > 0 {
		if body, err = sjson.SetBytes(body, "anthropic_beta", betas); err != nil {
			return nil, err
		}
	}
	action := "invoke"
	switch {
	case c.CountTokens():
		id, action = foundationModel(id), "count-tokens"
		if body, err = countTokensBody(body); err != nil {
			return nil, err
		}
	case c.Stream:
		action = "invoke-with-response-stream"
	}
	u, err := url.Parse(p.endpoint + "/model/" + url.PathEscape(id) + "/" + action)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if c.Stream && !c.CountTokens() {
		req.Header.Set("X-Amzn-Bedrock-Accept", "application/json")
	} else {
		req.Header.Set("Accept", "application/json")
	}
	if ua := c.Header.Get("User-Agent"); ua != "" {
		req.Header.Set("User-Agent", ua)
	}
	return req, p.sign(ctx, req, body)
}

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	region            <region>
//	url               <runtime endpoint>
//	access_key_id     <id|{env.NAME}>
//	secret_access_key <secret|{env.NAME}>
//	session_token     <token|{env.NAME}>
//	api_key           <bedrock api key|{env.NAME}>
//	anthropic_version <version>
//	betas             <flag>...|*
//	strip_fields      <field>...
func (p *Provider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return provider.UnmarshalOptions(d, p.CaddyfileOptions(), p.check)
}

// CaddyfileOptions implements provider.OptionsProvider.
func (p *Provider) CaddyfileOptions() provider.Options {
	return provider.Options{
		Strings: map[string]*string{"region": &p.Region, "url": &p.URL, "access_key_id": &p.AccessKeyID,
			"secret_access_key": &p.SecretAccessKey, "session_token": &p.SessionToken, "api_key": &p.APIKey,
			"anthropic_version": &p.AnthropicVersion},
		Lists: map[string]*[]string{"betas": &p.Betas, "strip_fields": &p.StripFields},
	}
}

// sign authenticates req: a Bedrock API key as a bearer token, or SigV4
// over the final body (any later change would void the signature).
func (p *Provider) sign(ctx context.Context, req *http.Request, body []byte) error {
	if p.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+p.apiKey)
		return nil
	}
	creds, err := p.creds.Retrieve(ctx)
	if err != nil {
		return fmt.Errorf("AWS credentials: %w", err)
	}
	sum := sha256.Sum256(body)
	return p.signer.SignHTTP(ctx, creds, req, hex.EncodeToString(sum[:]), "bedrock", p.Region, time.Now())
}

// foundationModel strips a cross-region inference profile's prefix
// (us.anthropic... -> anthropic...): CountTokens takes the model itself.
func foundationModel(id string) string {
	if i := strings.Index(id, ".anthropic."); i > 0 && !strings.ContainsAny(id[:i], ":/") {
		return id[i+1:]
	}
	return id
}

// countTokensBody wraps an InvokeModel body the way CountTokens takes it;
// the inner body must be a valid InvokeModel body, max_tokens included.
func countTokensBody(invoke []byte) ([]byte, error) {
	if !gjson.GetBytes(invoke, "max_tokens").Exists() {
		var err error
		if invoke, err = sjson.SetBytes(invoke, "max_tokens", 1); err != nil {
			return nil, err
		}
	}
	return json.Marshal(map[string]any{"input": map[string]any{"invokeModel": map[string]string{
		"body": base64.StdEncoding.EncodeToString(invoke)}}})
}

// Response implements provider.Provider: errors become Anthropic errors, an event
// stream becomes Anthropic's SSE, a CountTokens answer Anthropic's.
func (p *Provider) Response(resp *http.Response, c *provider.Call) (*http.Response, error) {
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		body, err := io.ReadAll(io.LimitReader(resp.Body, provider.MaxErrorBody))
		if err != nil {
			return nil, err
		}
		name := bedrockErrorName(resp.Header.Get("X-Amzn-Errortype"), body)
		msg := cmp.Or(gjson.GetBytes(body, "message").String(), gjson.GetBytes(body, "Message").String())
		return provider.UpstreamError{
			Status:    bedrockStatus(name, resp.StatusCode, body),
			Message:   "bedrock: " + strings.TrimSpace(name+": "+msg),
			RequestID: resp.Header.Get("X-Amzn-Requestid"),
			// Bedrock refuses a model the account may not invoke (not
			// enabled, or outside the role's policy) with
			// AccessDeniedException; bad credentials have exceptions of
			// their own
			RefusesModel: strings.EqualFold(name, "AccessDeniedException"),
		}.Response(resp), nil
	}
	if c.CountTokens() {
		body, err := io.ReadAll(io.LimitReader(resp.Body, provider.MaxErrorBody))
		if err != nil {
			return nil, err
		}
		return provider.ReplaceBody(resp, "application/json", []byte(`{"input_tokens":`+strconv.FormatInt(gjson.GetBytes(body, "inputTokens").Int(), 10)+`}`)), nil
	}
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/vnd.amazon.eventstream") {
		return resp, nil
	}
	out := *resp
	out.Header = resp.Header.Clone()
	out.Header.Set("Content-Type", "text/event-stream; charset=utf-8")
	out.Header.Del("Content-Length")
	out.Header.Del("X-Amzn-Bedrock-Content-Type")
	out.ContentLength = -1
	out.Body = sse.NewTranslator(resp.Body, (&eventStream{src: resp.Body, dec: eventstream.NewDecoder()}).step)
	return &out, nil
}

// bedrockErrorName is the exception name of a Bedrock error: the
// X-Amzn-ErrorType header (before any ':'), else the body's __type (after
// any '#').
func bedrockErrorName(header string, body []byte) string {
	name := header
	if name == "" {
		name = gjson.GetBytes(body, "__type").String()
	}
	name, _, _ = strings.Cut(name, ":")
	if i := strings.LastIndexByte(name, '#'); i >= 0 {
		name = name[i+1:]
	}
	return name
}

// bedrockStatuses maps Bedrock's exceptions (lower-cased) onto the status
// Anthropic answers the same condition with; the classification table gives
// the error type and what the relay does: throttling is a 429, an
// unavailable service or model an overload, a refused credential the
// channel's problem, a bad request the client's.
var bedrockStatuses = map[string]int{
	"validationexception":           http.StatusBadRequest,
	"servicequotaexceededexception": http.StatusTooManyRequests,
	"accessdeniedexception":         http.StatusForbidden,
	"unrecognizedclientexception":   http.StatusForbidden,
	"invalidsignatureexception":     http.StatusForbidden,
	"expiredtokenexception":         http.StatusForbidden,
	"resourcenotfoundexception":     http.StatusNotFound,
	"modeltimeoutexception":         http.StatusGatewayTimeout,
	"modelerrorexception":           http.StatusInternalServerError,
	"throttlingexception":           http.StatusTooManyRequests,
	"modelnotreadyexception":        529,
	"internalserverexception":       http.StatusInternalServerError,
	"serviceunavailableexception":   529,
}

// bedrockStatus is the Anthropic status of a Bedrock exception (names
// compare case-insensitively: streams use lowerCamel). A model stream error
// carries the model's own status.
func bedrockStatus(name string, status int, body []byte) int {
	if strings.EqualFold(name, "ModelStreamErrorException") {
		if orig := int(gjson.GetBytes(body, "originalStatusCode").Int()); orig != 0 {
			return orig
		}
	} else if s, ok := bedrockStatuses[strings.ToLower(name)]; ok {
		return s
	}
	return status
}

// eventStream turns Bedrock's AWS event stream into the exact SSE
// Anthropic sends, a frame at a time (sse.Translator reads it): each chunk
// carries one Anthropic event's JSON, emitted as `event: <type>\ndata:
// <json>\n\n`. An exception frame becomes an Anthropic `event: error` (so
// before the commit point the relay fails over on it, and after it the
// client's SDK raises it) and ends the stream.
type eventStream struct {
	src     io.Reader
	dec     *eventstream.Decoder
	payload []byte
}

// step decodes one frame into out; an error (io.EOF after an error event)
// ends the stream.
func (c *eventStream) step(out *bytes.Buffer) error {
	msg, err := c.dec.Decode(c.src, c.payload[:0])
	if err != nil {
		return err
	}
	c.payload = msg.Payload[:0]
	switch header(msg, eventstreamapi.MessageTypeHeader) {
	case eventstreamapi.EventMessageType:
		if header(msg, eventstreamapi.EventTypeHeader) == "chunk" {
			return chunk(out, msg.Payload)
		}
	case eventstreamapi.ExceptionMessageType:
		name := header(msg, eventstreamapi.ExceptionTypeHeader)
		return fail(out, provider.ErrorType(bedrockStatus(name, 500, msg.Payload)), name+": "+gjson.GetBytes(msg.Payload, "message").String())
	case eventstreamapi.ErrorMessageType:
		return fail(out, "api_error", header(msg, eventstreamapi.ErrorCodeHeader)+": "+header(msg, eventstreamapi.ErrorMessageHeader))
	}
	return nil
}

// chunk writes the Anthropic event a chunk carries. A chunk without a type
// is a keep-alive. The usage metrics Bedrock appends to message_stop are
// not Anthropic's and are left out.
func chunk(out *bytes.Buffer, payload []byte) error {
	raw := gjson.GetBytes(payload, "bytes").String()
	ev, err := base64.StdEncoding.DecodeString(raw)
	if err != nil {
		return fail(out, "api_error", "undecodable chunk from Bedrock")
	}
	typ := gjson.GetBytes(ev, "type").String()
	if typ == "" {
		return nil
	}
	if typ == "message_stop" && gjson.GetBytes(ev, "amazon-bedrock-invocationMetrics").Exists() {
		ev, _ = sjson.DeleteBytes(ev, "amazon-bedrock-invocationMetrics")
	}
	if bytes.IndexByte(ev, '\n') >= 0 { // SSE data must be one line
		var compact bytes.Buffer
		if json.Compact(&compact, ev) == nil {
			ev = compact.Bytes()
		}
	}
	out.WriteString("event: ")
	out.WriteString(typ)
	out.WriteString("\ndata: ")
	out.Write(ev)
	out.WriteString("\n\n")
	return nil
}

// fail writes an Anthropic error event, and ends the stream.
func fail(out *bytes.Buffer, typ, msg string) error {
	out.Write(provider.ErrorEvent(typ, "bedrock: "+msg, ""))
	return io.EOF
}

// header reads a string header of an event-stream message.
func header(m eventstream.Message, name string) string {
	if v := m.Headers.Get(name); v != nil {
		return v.String()
	}
	return ""
}

// Interface guards
var (
	_ provider.GenAINamer      = (*Provider)(nil)
	_ provider.Provider        = (*Provider)(nil)
	_ provider.FeatureSupport  = (*Provider)(nil)
	_ provider.RefusalReader   = (*Provider)(nil)
	_ provider.OptionsProvider = (*Provider)(nil)
	_ provider.AccountNamer    = (*Provider)(nil)
	_ caddy.Provisioner        = (*Provider)(nil)
	_ caddyfile.Unmarshaler    = (*Provider)(nil)
)
