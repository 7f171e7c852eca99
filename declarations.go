package relay

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// State ownership. The state that outlives a config reload (a channel's
// health and limits, a group's queue and retry budget, a key's limits) is
// kept by name, process-wide. Two relay handlers of one config (two sites,
// say) that declare the same name share that state: one upstream credential
// has one health, however many sites use it. So their declarations must be
// the same; a config in which two handlers declare a channel, group, key
// name or user id differently fails to load, naming it and both handlers. A reload is
// not a conflict: the new config's declaration replaces the old one's, and
// the state carries over.

// declaration is what one handler says about a name: where (for errors)
// and what, as canonical JSON.
type declaration struct {
	by   string
	what []byte
}

// configDeclarations are the declarations of the relay handlers of one
// loaded config.
type configDeclarations struct {
	handlers  int
	names     map[string]declaration        // "channel main" -> its declaration
	fileKeys  map[string]fileKeyDeclaration // the keys of keys files, by name: there may be many
	accessLog bool                          // the access log warning was given
}

// declarations holds the declarations of every config being loaded or
// running, by the config's context: its Done channel is the config's own.
var declarations = struct {
	sync.Mutex
	configs map[<-chan struct{}]*configDeclarations
}{configs: map[<-chan struct{}]*configDeclarations{}}

// declare records r's declarations in its config's, and fails when another
// handler of the same config declared one of its names differently.
func (r *Relay) declare(ctx caddy.Context) error {
	declarations.Lock()
	defer declarations.Unlock()
	id := ctx.Done()
	c := declarations.configs[id]
	if c == nil {
		c = &configDeclarations{names: map[string]declaration{}}
		declarations.configs[id] = c
		go func() { // the config is unloaded, or its load failed
			<-id
			declarations.Lock()
			delete(declarations.configs, id)
			declarations.Unlock()
		}()
	}
	c.handlers++
	by := fmt.Sprintf("relay handler #%d", c.handlers)
	r.declaredAs = by
	own, err := r.declared(by)
	if err != nil {
		return err
	}
	for name, d := range own {
		if err := conflict(name, c.names[name], d); err != nil {
			return err
		}
		if f, ok := c.fileKeys[strings.TrimPrefix(name, "key ")]; ok && strings.HasPrefix(name, "key ") {
			return fileKeyConflict(name, f.by+" (in its keys file)", by)
		}
	}
	for name, d := range own {
		c.names[name] = d
	}
	return nil
}

// fileKeyDeclaration is what a handler says about a key of its keys file:
// its entry as written (a hash of it), so that two handlers that read one
// file agree.
type fileKeyDeclaration struct {
	by  string
	sum uint64
}

// fileKeyDecl is a key of the keys file, by its name, to be declared.
type fileKeyDecl struct {
	name string
	sum  uint64
}

// declareFileKeys records the keys of r's keys file in its config's
// declarations, once their names are known (a key's default name comes
// from its secret), and fails when another handler of the config declared
// one of them differently.
func (r *Relay) declareFileKeys(ctx caddy.Context, keys []fileKeyDecl) error {
	declarations.Lock()
	defer declarations.Unlock()
	c := declarations.configs[ctx.Done()]
	if c == nil || len(keys) == 0 {
		return nil
	}
	if c.fileKeys == nil {
		c.fileKeys = make(map[string]fileKeyDeclaration, len(keys))
	}
	for _, k := range keys {
		if was, ok := c.names["key "+k.name]; ok {
			return fileKeyConflict("key "+k.name, was.by, r.declaredAs+" (in its keys file)")
		}
		if was, ok := c.fileKeys[k.name]; ok && was.sum != k.sum && was.by != r.declaredAs {
			return fileKeyConflict("key "+k.name, was.by+" (in its keys file)", r.declaredAs+" (in its keys file)")
		}
		c.fileKeys[k.name] = fileKeyDeclaration{by: r.declaredAs, sum: k.sum}
	}
	return nil
}

// fileKeyConflict is the error of a key that two handlers declare
// differently, one of them or both in a keys file.
func fileKeyConflict(name, was, now string) error {
	return fmt.Errorf("%s is declared by %s and differently by %s: handlers of one config that use the same name share its state, so they must declare it the same; give one of them another name",
		name, was, now)
}

// warnAccessLog warns, once per config, when the server that r serves in
// writes access logs: Caddy logs a copy of each request's headers taken
// before any handler runs, and redacts Authorization and Cookie but not
// X-Api-Key, which holds the relay key; no handler can change that copy,
// only the log's own filter can. A server whose access logs all filter it
// gets no warning (access_log.go).
func (r *Relay) warnAccessLog(ctx caddy.Context) {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv.Logs == nil || !accessLogShowsKey(ctx, srv) {
		return
	}
	declarations.Lock()
	c := declarations.configs[ctx.Done()]
	warn := c != nil && !c.accessLog
	if warn {
		c.accessLog = true
	}
	declarations.Unlock()
	if warn {
		r.logger.Warn("this server writes access logs, which record each request's X-Api-Key header, the relay key, in clear unless the log deletes it; " +
			"give every access log of a relay site this format: log { format filter { request>headers>X-Api-Key delete } }")
	}
}

// declared lists r's declarations, made by the handler called by: every
// channel as it takes effect (its tuning merged with the relay's), every
// group, every key by its name and every user entry by its id.
func (r *Relay) declared(by string) (map[string]declaration, error) {
	out := map[string]declaration{}
	add := func(kind, name string, v any) error {
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		out[kind+" "+strings.TrimSpace(name)] = declaration{by: by, what: b}
		return nil
	}
	for _, ch := range r.Channels {
		eff := *ch
		eff.Tuning = ch.Tuning.over(r.Tuning)
		if err := add("channel", ch.Name, eff); err != nil {
			return nil, err
		}
	}
	for _, g := range r.Groups {
		if err := add("group", g.Name, g); err != nil {
			return nil, err
		}
	}
	for _, k := range r.Keys {
		name := k.Name
		if name == "" {
			hexDigest, ok := strings.CutPrefix(k.Secret, sha256Prefix)
			if !ok {
				continue // a placeholder: its default name comes from its value
			}
			name = defaultKeyName(hexDigest)
		}
		if err := add("key", name, k); err != nil {
			return nil, err
		}
	}
	for _, u := range r.Users {
		if err := add("user", u.ID, u); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// conflict is the error of a name declared by was and again by now,
// differently; nil when was is empty or the same.
func conflict(name string, was, now declaration) error {
	if was.by == "" || bytes.Equal(was.what, now.what) {
		return nil
	}
	return fmt.Errorf("%s is declared by %s and differently by %s (%s): handlers of one config that use the same name share its state, so they must declare it the same; give one of them another name",
		name, was.by, now.by, differences(was.what, now.what))
}

// differences names the fields in which two JSON objects differ, never
// their values (a key's secret is one of them).
func differences(a, b []byte) string {
	var ma, mb map[string]json.RawMessage
	_ = json.Unmarshal(a, &ma)
	_ = json.Unmarshal(b, &mb)
	var fields []string
	for k, v := range ma {
		if w, ok := mb[k]; !ok || !bytes.Equal(v, w) {
			fields = append(fields, k)
		}
	}
	for k := range mb {
		if _, ok := ma[k]; !ok {
			fields = append(fields, k)
		}
	}
	slices.Sort(fields)
	return "they differ in " + strings.Join(fields, ", ")
}

// defaultKeyName is the name of an unnamed key: key- and the first 16 hex
// digits of its secret's sha256.
func defaultKeyName(hexDigest string) string {
	return "key-" + hexDigest[:min(16, len(hexDigest))]
}

// keyName is a key's name, given its digest: its own, or the default.
func keyName(cfg *Key, digest [32]byte) string {
	if cfg.Name != "" {
		return cfg.Name
	}
	return defaultKeyName(hex.EncodeToString(digest[:8]))
}
