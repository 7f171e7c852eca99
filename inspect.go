package relay

import (
	"bytes"
	"errors"
	"io"
	"strconv"
	"strings"
	"sync"

	"github.com/caddy-relay/relay/internal/affinity"
	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/jsonscan"
	"github.com/caddy-relay/relay/internal/money"
	"github.com/go-json-experiment/json/jsontext"
)

// scanners pools the strict JSON scanners of request bodies, which keep
// the buffers they grew (internal/jsonscan).
var scanners = sync.Pool{New: func() any { return new(jsonscan.Scanner) }}

// maxModelLen bounds a model name: the longest real ids (Bedrock inference
// profile ARNs) are about 100 characters.
const maxModelLen = 256

// inspect reads the fields routing needs in one strict pass over the body:
// model, stream, metadata.user_id and the features it needs (the feature
// fields, the types of its tools; and its anthropic-beta values and
// whether its prompt needs a long context), and what its conversation
// says to the features that read it, in one walk of its messages
// (inspect_messages.go: cache breakpoints, thinking signers, the tool
// call and result it ends with). The body must
// be exactly one valid JSON object, with no data after it and no key twice
// in any object: a parser that kept the first of two "model" keys, or read
// only the first of two objects, would otherwise serve another model than
// the one the relay routed and priced. Values the relay does not read are
// validated and skipped, never decoded. The scan is internal/jsonscan's,
// which accepts exactly what jsontext accepts, eight bytes a step.
func (in *inbound) inspect() *relayError {
	sc := scanners.Get().(*jsonscan.Scanner)
	defer func() {
		sc.Reset(nil) // no reference to the pooled body stays
		scanners.Put(sc)
	}()
	sc.Reset(in.ask.body)
	in.ask.prefix = newCachePrefix(in) // nil: no breakpoint in the body, nothing more to read

	if k := sc.PeekKind(); k != '{' && k != 0 { // 0: not JSON, which ReadObjectStart says
		return errInvalid("request body must be a JSON object")
	}
	if err := sc.ReadObjectStart(); err != nil {
		return errBodyJSON(err)
	}
	var model []byte
	for {
		name, err := sc.NextName()
		if err != nil {
			return errBodyJSON(err)
		}
		if name == nil { // the closing brace
			break
		}
		field := unquoteJSON(name)
		switch k := sc.PeekKind(); {
		case field == "tools" && k == '[':
			start := sc.ValueOffset()
			if err := in.scanTools(sc); err != nil {
				return errBodyJSON(err)
			}
			if in.ask.prefix != nil {
				in.ask.prefix.NoteSpan(affinity.SectTools, start, sc.InputOffset())
			}
		case field == "messages" && k == '[' && in.walksMessages():
			// one walk for every feature that reads the conversation
			if err := in.scanMessages(sc); err != nil {
				return errBodyJSON(err)
			}
		case in.ask.prefix != nil && (field == "system" || field == "messages"):
			if err := in.ask.prefix.scanSection(sc, sectionOf(field)); err != nil {
				return errBodyJSON(err)
			}
		case field == "metadata" && k == '{':
			if err := in.scanMetadata(sc); err != nil {
				return errBodyJSON(err)
			}
		default:
			if rerr := in.readField(sc, field, &model); rerr != nil {
				return rerr
			}
		}
	}
	if err := sc.End(); err != nil {
		if errors.Is(err, jsonscan.ErrSyntax) {
			return errInvalid("request body is not valid JSON: data after the top-level object")
		}
		return errBodyJSON(err)
	}

	if model == nil {
		return errInvalid("model: field required")
	}
	if jsonscan.KindOf(model) != '"' || len(model) == 2 {
		return errInvalid("model: must be a non-empty string")
	}
	name := unquoteJSON(model) // valid: the scan checked it
	if msg := modelIDProblem(name); msg != "" {
		return errInvalid("model: " + msg)
	}
	in.ask.model = strings.Clone(name)
	in.grant.target = in.ask.model
	if in.route == routeMessages && estimateTokens(in.ask.body) > features.LongContextTokens {
		in.ask.needs.Set |= features.LongContext
	}
	if _, ok := in.ask.header["Anthropic-Beta"]; ok {
		in.ask.needs.Betas = make([]string, 0, 4)
		if !in.ask.needs.ReadBetas(in.ask.header) {
			return errInvalid("anthropic-beta: more than " + strconv.Itoa(features.MaxBetas) + " values")
		}
	}
	return nil
}

// readField reads the value of the top-level field, noting what the relay
// routes on: the raw model (into model, with its offsets), stream,
// max_tokens and the feature fields; a body anthropic_beta is refused.
func (in *inbound) readField(sc *jsonscan.Scanner, field string, model *[]byte) *relayError {
	v, err := sc.ReadValue()
	if err != nil {
		return errBodyJSON(err)
	}
	switch field {
	case "model":
		*model = v
		in.ask.modelEnd = sc.InputOffset()
		in.ask.modelStart = in.ask.modelEnd - len(v)
	case "stream":
		in.ask.stream = jsonscan.KindOf(v) == 't'
	case "max_tokens":
		if jsonscan.KindOf(v) == '0' {
			n, _ := strconv.ParseInt(jsonscan.String(v), 10, 32)
			in.ask.maxOut = int32(n)
		}
	case "thinking":
		in.ask.thinking.on = thinkingOn(v)
	case "anthropic_beta":
		return errInvalid("anthropic_beta: betas go in the anthropic-beta header, which the relay routes on")
	default:
		if f := features.OfField(field); f != 0 && jsonscan.KindOf(v) != 'n' {
			in.ask.needs.Set |= f
		}
		if field == "cache_control" && in.ask.prefix != nil { // automatic caching
			in.ask.prefix.noteAutomatic(v)
		}
	}
	return nil
}

// scanMetadata reads a `metadata` object for its user_id, a string: the
// same strict pass, one level deeper.
func (in *inbound) scanMetadata(sc *jsonscan.Scanner) error {
	if err := sc.ReadObjectStart(); err != nil {
		return err
	}
	for {
		name, err := sc.NextName()
		if err != nil || name == nil {
			return err
		}
		v, err := sc.ReadValue()
		if err != nil {
			return err
		}
		if jsonscan.KindOf(v) == '"' && unquoteJSON(name) == "user_id" {
			in.ask.userID = strings.Clone(unquoteJSON(v))
		}
	}
}

// scanTools reads a `tools` array, noting the server tools among them by
// the type of each, and the searches its web search tools may make: the
// same strict pass, one level deeper.
func (in *inbound) scanTools(sc *jsonscan.Scanner) error {
	if err := sc.ReadArrayStart(); err != nil {
		return err
	}
	for {
		more, err := sc.NextElement()
		if err != nil || !more {
			return err
		}
		if sc.PeekKind() != '{' {
			if _, err := sc.ReadValue(); err != nil {
				return err
			}
			continue
		}
		if err := sc.ReadObjectStart(); err != nil {
			return err
		}
		marked, long := false, false
		search, maxUses := false, "" // a web search tool, and its max_uses (the body's bytes)
		for {
			name, err := sc.NextName()
			if err != nil {
				return err
			}
			if name == nil {
				break
			}
			v, err := sc.ReadValue()
			if err != nil {
				return err
			}
			switch kind := jsonscan.KindOf(v); {
			case kind == '"' && unquoteJSON(name) == "type":
				typ := unquoteJSON(v)
				in.ask.needs.Set |= features.OfTool(typ)
				search = strings.HasPrefix(typ, money.WebSearchTool)
			case kind == '0' && unquoteJSON(name) == "max_uses":
				maxUses = jsonscan.String(v)
			}
			if in.ask.prefix != nil && fieldName(name) == "cache_control" {
				marked, long = isBreakpoint(v)
			}
		}
		if search {
			in.ask.searches += money.WebSearchUses(maxUses)
		}
		if marked {
			in.ask.prefix.Mark(affinity.SectTools, sc.InputOffset(), long)
		}
	}
}

// unquoteJSON is the string a raw JSON string holds: shared with the body
// when it has no escape sequence (compare it, never keep it), decoded
// when it has. The string must be valid (the scan checked it).
func unquoteJSON(raw []byte) string {
	if s := fieldName(raw); s != "" || len(raw) == 2 {
		return s
	}
	return string(jsonscan.AppendUnquote(nil, raw))
}

// fieldName is the name a raw JSON object key holds when it has no escape
// sequence, else "". It shares the body's memory: compare it, never keep
// it.
func fieldName(raw []byte) string {
	inner := raw[1 : len(raw)-1]
	if bytes.IndexByte(inner, '\\') >= 0 {
		return ""
	}
	return jsonscan.String(inner)
}

// errBodyJSON answers a body the strict scan refused (internal/jsonscan's,
// or jsontext's where a route still decodes with it), saying where and why
// without echoing more of the body than a short key.
func errBodyJSON(err error) *relayError {
	if err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF) {
		return errInvalid("request body is not valid JSON: it ends before the object does")
	}
	var key, pointer string
	var offset int64
	var se *jsonscan.Error
	var jse *jsontext.SyntacticError
	switch {
	case errors.As(err, &se):
		key, pointer, offset = se.Name, se.Pointer, int64(se.Offset)
		if !errors.Is(se.Err, jsonscan.ErrDuplicateName) {
			pointer = ""
		}
	case errors.As(err, &jse):
		offset = jse.ByteOffset
		if errors.Is(jse.Err, jsontext.ErrDuplicateName) {
			key, pointer = jse.JSONPointer.LastToken(), string(jse.JSONPointer)
		}
	default:
		return errInvalid("request body is not valid JSON")
	}
	if pointer != "" {
		if len(key) > 64 {
			key = key[:64] + "..."
		}
		return errInvalid("request body is not valid JSON: duplicate key " + strconv.Quote(key) + " at " + strconv.Quote(pointer[:min(len(pointer), 128)]))
	}
	return errInvalid("request body is not valid JSON: error at byte offset " + strconv.FormatInt(offset, 10))
}

// modelIDProblem says why s cannot be a model id, or "" when it can be:
// ids are at most maxModelLen characters among letters, digits and -._:@/
// (Anthropic's names, Bedrock's ids and ARNs, Vertex's name@version), with
// no "." or ".." path segment, since providers put the id in a URL path.
func modelIDProblem(s string) string {
	switch {
	case s == "":
		return "must be a non-empty string"
	case len(s) > maxModelLen:
		return "longer than " + strconv.Itoa(maxModelLen) + " characters; not a model id"
	case !validModelName(s):
		return "not a model id: only letters, digits and - . _ : @ / may appear"
	}
	for seg := range strings.SplitSeq(s, "/") {
		if seg == "." || seg == ".." {
			return "not a model id: it has a \".\" or \"..\" path segment"
		}
	}
	return ""
}
