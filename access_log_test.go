package relay

import (
	"encoding/json"
	"io"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestTheAccessLogWarningReadsTheEncoder provisions Caddy's logging as a
// config would and asks whether each server's access log shows the key.
func TestTheAccessLogWarningReadsTheEncoder(t *testing.T) {
	filter := func(filters string) string {
		return `{"format":"filter","wrap":{"format":"json"},"fields":{` + filters + `}}`
	}
	for _, tt := range []struct {
		name    string
		encoder string // the access log's; "": no log of its own, the default log writes it
		logger  string
		shows   bool
		sampled bool // the log samples its entries (zap's sampler holds its core)
	}{
		{"a bare log", `{"format":"json"}`, "log0", true, false},
		{"the filter deletes the key", filter(`"request>headers>X-Api-Key":{"filter":"delete"}`), "log0", false, false},
		{"the filter hashes the key", filter(`"request>headers>X-Api-Key":{"filter":"hash"}`), "log0", false, false},
		{"the filter replaces the key", filter(`"request>headers>X-Api-Key":{"filter":"replace","value":"REDACTED"}`), "log0", false, false},
		{"the filter deletes another header", filter(`"request>headers>Authorization":{"filter":"delete"}`), "log0", true, false},
		{"the console format", `{"format":"console"}`, "log0", true, false},
		{"the default log", "", "", true, false},
		{"a sampled log", `{"format":"json"}`, "log0", true, true},
		{"a sampled log whose filter deletes the key", filter(`"request>headers>X-Api-Key":{"filter":"delete"}`), "log0", false, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// a log that writes to discard is dropped: these write files
			writer := json.RawMessage(`{"output":"file","filename":` + strconv.Quote(filepath.Join(t.TempDir(), "log")) + `}`)
			cfg := &caddy.Config{Logging: &caddy.Logging{Logs: map[string]*caddy.CustomLog{}}}
			if tt.encoder != "" {
				cfg.Logging.Logs["log0"] = &caddy.CustomLog{
					BaseLog: caddy.BaseLog{WriterRaw: writer, EncoderRaw: json.RawMessage(tt.encoder)},
					Include: []string{"http.log.access.log0"},
				}
				if tt.sampled {
					cfg.Logging.Logs["log0"].Sampling = &caddy.LogSampling{First: 10, Thereafter: 10}
				}
				cfg.Logging.Logs["default"] = &caddy.CustomLog{
					BaseLog: caddy.BaseLog{WriterRaw: json.RawMessage(`{"output":"discard"}`)},
					Exclude: []string{"http.log.access.log0"},
				}
			}
			ctx, err := caddy.ProvisionContext(cfg)
			if err != nil {
				t.Fatal(err)
			}
			srv := &caddyhttp.Server{Logs: &caddyhttp.ServerLogConfig{DefaultLoggerName: tt.logger}}
			if got := accessLogShowsKey(ctx, srv); got != tt.shows {
				t.Errorf("accessLogShowsKey = %v, want %v", got, tt.shows)
			}
			// a site for a host: its requests take its logger by name
			srv = &caddyhttp.Server{Logs: &caddyhttp.ServerLogConfig{LoggerNames: map[string]caddyhttp.StringArray{"relay.example": {tt.logger}}}}
			if got := accessLogShowsKey(ctx, srv); got != tt.shows {
				t.Errorf("for a host's site: accessLogShowsKey = %v, want %v", got, tt.shows)
			}
		})
	}
}

// TestCoreEncodersCannotTellEveryCore: a core that logs nothing has no
// encoder to read and shows nothing; one that logs without handing its
// fields to an encoder (zap's observer keeps them) cannot be read, and
// the relay warns.
func TestCoreEncodersCannotTellEveryCore(t *testing.T) {
	if encs, ok := coreEncoders(zapcore.NewNopCore()); !ok || len(encs) != 0 {
		t.Errorf("the nop core: %v %v, want no encoder and no doubt", encs, ok)
	}
	obs, _ := observer.New(zapcore.InfoLevel)
	if _, ok := coreEncoders(obs); ok {
		t.Error("an observer's core was read as if it had encoders")
	}
	jsonCore := zapcore.NewCore(zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()), zapcore.AddSync(io.Discard), zapcore.InfoLevel)
	if encs, ok := coreEncoders(zapcore.NewTee(jsonCore, jsonCore)); !ok || len(encs) != 2 {
		t.Errorf("a tee of two JSON cores: %d encoders, %v", len(encs), ok)
	}
}
