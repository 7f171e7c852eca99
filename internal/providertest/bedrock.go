package providertest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/aws/protocol/eventstream"
	v4 "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// The fake Bedrock's credentials: the AWS access key it checks signatures
// with, in its region, and the Bedrock API key it takes as a bearer token.
const (
	AWSKeyID      = "AKIDTESTRELAY000"
	AWSSecret     = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYTESTKEY"
	AWSSession    = "session-token-for-tests"
	AWSRegion     = "us-east-1"
	BedrockAPIKey = "bedrock-api-key-test-123"
)

// FakeBedrock is a Bedrock runtime endpoint on 127.0.0.1. It recomputes
// every request's SigV4 signature with the same credentials and refuses a
// request whose signature differs, as AWS would; a request with the API
// key as its bearer token needs no signature.
type FakeBedrock struct {
	*fakeupstream.Upstream
	mu     sync.Mutex
	answer http.HandlerFunc
	bad    []string // why signatures were refused
}

// NewFakeBedrock starts a fake Bedrock that answers a request it accepts
// with answer, and stops it when the test ends.
func NewFakeBedrock(t testing.TB, answer http.HandlerFunc) *FakeBedrock {
	f := &FakeBedrock{answer: answer}
	f.Upstream = fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+BedrockAPIKey {
			if why := verifySigV4(r); why != "" {
				f.mu.Lock()
				f.bad = append(f.bad, why)
				f.mu.Unlock()
				w.Header().Set("X-Amzn-ErrorType", "InvalidSignatureException:http://internal.amazon.com/coral/com.amazon.coral.service/")
				fakeupstream.Raw(403, []byte(`{"message":"The request signature we calculated does not match the signature you provided."}`))(w, r)
				return
			}
		}
		f.mu.Lock()
		answer := f.answer
		f.mu.Unlock()
		answer(w, r)
	}), fakeupstream.AcceptKeys(BedrockAPIKey))
	return f
}

// Refused says why the signatures it refused were wrong.
func (f *FakeBedrock) Refused() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.bad...)
}

// verifySigV4 signs a copy of r made of what r carried (the path as sent,
// the headers its Authorization says were signed, the body) and compares.
func verifySigV4(r *http.Request) string {
	auth := r.Header.Get("Authorization")
	if !strings.HasPrefix(auth, "AWS4-HMAC-SHA256 ") {
		return "not signed: " + auth
	}
	_, signed, _ := strings.Cut(auth, "SignedHeaders=")
	signed, _, _ = strings.Cut(signed, ",")
	at, err := time.Parse("20060102T150405Z", r.Header.Get("X-Amz-Date"))
	if err != nil {
		return "no X-Amz-Date"
	}
	body, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(body))
	cp, _ := http.NewRequest(r.Method, "http://"+r.Host+r.URL.RequestURI(), bytes.NewReader(body))
	cp.URL = &url.URL{Scheme: "http", Host: r.Host, Path: r.URL.Path, RawPath: r.URL.RawPath}
	cp.Host = r.Host
	cp.Header = http.Header{}
	for _, name := range strings.Split(signed, ";") {
		if name != "host" && name != "content-length" {
			cp.Header[http.CanonicalHeaderKey(name)] = r.Header.Values(name)
		}
	}
	cp.Header.Del("Authorization")
	sum := sha256.Sum256(body)
	creds := aws.Credentials{AccessKeyID: AWSKeyID, SecretAccessKey: AWSSecret, SessionToken: AWSSession}
	if err := v4.NewSigner().SignHTTP(context.Background(), creds, cp, hex.EncodeToString(sum[:]), "bedrock", AWSRegion, at); err != nil {
		return err.Error()
	}
	if got := cp.Header.Get("Authorization"); got != auth {
		return "signature mismatch: want " + got + ", got " + auth
	}
	return ""
}

// EventStream answers with the events (Anthropic SSE, as fakeupstream
// renders them) framed as Bedrock does: each event's JSON base64-encoded
// in a chunk frame, made by aws-sdk-go-v2's own encoder; message_stop
// gains Bedrock's invocation metrics. Exception frames follow when given.
func EventStream(events []string, exceptions ...eventstream.Message) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/vnd.amazon.eventstream")
		w.Header().Set("X-Amzn-Bedrock-Content-Type", "application/json")
		w.WriteHeader(200)
		enc := eventstream.NewEncoder()
		for _, ev := range events {
			data := strings.TrimSuffix(ev[strings.Index(ev, "data: ")+6:], "\n\n")
			if strings.Contains(data, `"message_stop"`) {
				data = strings.TrimSuffix(data, "}") + `,"amazon-bedrock-invocationMetrics":{"inputTokenCount":10,"outputTokenCount":3,"invocationLatency":12,"firstByteLatency":5}}`
			}
			var msg eventstream.Message
			msg.Headers.Set(":message-type", eventstream.StringValue("event"))
			msg.Headers.Set(":event-type", eventstream.StringValue("chunk"))
			msg.Headers.Set(":content-type", eventstream.StringValue("application/json"))
			msg.Payload = []byte(`{"bytes":"` + base64.StdEncoding.EncodeToString([]byte(data)) + `","p":"abcdefghij"}`)
			if enc.Encode(w, msg) != nil {
				return
			}
			_ = http.NewResponseController(w).Flush()
		}
		for _, msg := range exceptions {
			_ = enc.Encode(w, msg)
		}
	}
}

// ExceptionFrame is an exception of Bedrock's event stream: its name and
// message.
func ExceptionFrame(name, msg string) eventstream.Message {
	var m eventstream.Message
	m.Headers.Set(":message-type", eventstream.StringValue("exception"))
	m.Headers.Set(":exception-type", eventstream.StringValue(name))
	m.Headers.Set(":content-type", eventstream.StringValue("application/json"))
	m.Payload = []byte(`{"message":"` + msg + `"}`)
	return m
}

// BedrockFailure answers as Bedrock's REST API does: the exception's name
// in X-Amzn-ErrorType, its message in the body.
func BedrockFailure(status int, name, msg string) http.HandlerFunc {
	return fakeupstream.Raw(status, []byte(`{"message":"`+msg+`"}`), "X-Amzn-ErrorType", name+":http://internal.amazon.com/coral/com.amazon.bedrock/")
}
