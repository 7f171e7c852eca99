package relay

import (
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Access logs. Caddy's access log records each request's headers as they
// arrived, X-Api-Key (the relay key) included, unless the log's encoder
// filters it (format filter { request>headers>X-Api-Key delete }, or hash,
// or replace). The relay cannot add that filter; it checks whether each
// access log of its server has one, by encoding a request that carries a
// probe key with the log's own encoder, and warns when the key shows.

// accessLogProbe is the relay key of the request an access log's encoder
// is tried on.
const accessLogProbe = "sk-relay-access-log-probe-5d1e"

// accessLogShowsKey reports whether an access log of srv may write a relay
// key in clear: when one of its encoders writes the probe's, or when the
// relay cannot tell.
func accessLogShowsKey(ctx caddy.Context, srv *caddyhttp.Server) bool {
	// the default logger logs the hosts no name is mapped for; where names
	// are mapped (a site per host), the relay's requests are theirs
	names := map[string]bool{}
	if srv.Logs.DefaultLoggerName != "" || len(srv.Logs.LoggerNames) == 0 {
		names[srv.Logs.DefaultLoggerName] = true
	}
	for _, list := range srv.Logs.LoggerNames {
		for _, n := range list {
			names[n] = true
		}
	}
	req := &http.Request{Method: http.MethodPost, URL: &url.URL{Path: "/v1/messages"}, RequestURI: "/v1/messages",
		Proto: "HTTP/1.1", Host: "relay", RemoteAddr: "192.0.2.1:1",
		Header: http.Header{"X-Api-Key": {accessLogProbe}}}
	field := zap.Object("request", caddyhttp.LoggableHTTPRequest{Request: req, ShouldLogCredentials: srv.Logs.ShouldLogCredentials})
	for name := range names {
		logger := "http.log.access"
		if name != "" {
			logger += "." + name
		}
		// the logger Caddy gives the access log of that name: its cores are
		// the logs that take it, each with its own encoder
		encs, ok := coreEncoders(ctx.Logger(loggerModule(logger)).Core())
		if !ok {
			return true
		}
		for _, enc := range encs { // each a clone of the log's own, its alone
			buf, err := enc.EncodeEntry(zapcore.Entry{Level: zapcore.InfoLevel, Time: time.Now(), LoggerName: logger, Message: "handled request"}, []zapcore.Field{field})
			if err != nil {
				return true
			}
			shows := strings.Contains(buf.String(), accessLogProbe)
			buf.Free()
			if shows {
				return true
			}
		}
	}
	return false
}

// loggerModule stands for a module whose logger has the given name: Caddy
// picks a logger's logs by its name.
type loggerModule string

func (m loggerModule) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: caddy.ModuleID(m), New: func() caddy.Module { return m }}
}

// coreEncoders lists the encoders of the cores under c, through zap's own
// Core.With: every core hands the fields it is given to its encoders (zap's
// I/O core to a clone of its encoder, its tee and sampler and Caddy's
// filtering core to the cores they hold), and an inline field's marshaler
// is given the encoder itself. False when a core hands it something that
// is not an encoder, or when a core that logs at info hands it nothing
// (zap's nop core logs nothing): the relay cannot tell what it writes.
func coreEncoders(c zapcore.Core) ([]zapcore.Encoder, bool) {
	if c == nil {
		return nil, true
	}
	var g encoderGrab
	c.With([]zapcore.Field{zap.Inline(&g)})
	if g.unknown || len(g.encs) == 0 && c.Enabled(zapcore.InfoLevel) {
		return nil, false
	}
	return g.encs, true
}

// encoderGrab is an inline field that adds nothing to an entry: it notes
// the encoders it is given.
type encoderGrab struct {
	encs    []zapcore.Encoder
	unknown bool // it was given an object encoder that is not an Encoder
}

// MarshalLogObject implements zapcore.ObjectMarshaler.
func (g *encoderGrab) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	if e, ok := enc.(zapcore.Encoder); ok {
		g.encs = append(g.encs, e)
	} else {
		g.unknown = true
	}
	return nil
}
