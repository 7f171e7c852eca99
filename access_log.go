package relay

import (
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"time"
	"unsafe"

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
		for _, enc := range encs {
			buf, err := enc.Clone().EncodeEntry(zapcore.Entry{Level: zapcore.InfoLevel, Time: time.Now(), LoggerName: logger, Message: "handled request"}, []zapcore.Field{field})
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

var (
	coreType    = reflect.TypeFor[zapcore.Core]()
	encoderType = reflect.TypeFor[zapcore.Encoder]()
)

// coreEncoders lists the encoders of the cores under c: zap's tee of
// cores, Caddy's filtering core and zap's sampler hold cores, zap's I/O
// core holds its encoder in a field zap does not export, which is read
// here. False when a core is of a shape it does not know.
func coreEncoders(c zapcore.Core) ([]zapcore.Encoder, bool) {
	v := reflect.ValueOf(c)
	switch {
	case !v.IsValid():
		return nil, true
	case v.Kind() == reflect.Slice: // zap's multiCore
		var out []zapcore.Encoder
		for i := range v.Len() {
			inner, ok := v.Index(i).Interface().(zapcore.Core)
			if !ok {
				return nil, false
			}
			encs, ok := coreEncoders(inner)
			if !ok {
				return nil, false
			}
			out = append(out, encs...)
		}
		return out, true
	case v.Kind() == reflect.Struct && v.NumField() == 0: // zap's nopCore
		return nil, true
	case v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct:
		return nil, false
	}
	s := v.Elem()
	if f := s.FieldByName("enc"); f.IsValid() && f.Type() == encoderType { // zap's ioCore
		enc, _ := reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem().Interface().(zapcore.Encoder)
		return []zapcore.Encoder{enc}, enc != nil
	}
	if f := s.FieldByName("Core"); f.IsValid() && f.Type() == coreType && f.CanInterface() { // an embedded core
		inner, _ := f.Interface().(zapcore.Core)
		return coreEncoders(inner)
	}
	return nil, false
}
