package relay

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/cespare/xxhash/v2"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	"go.uber.org/zap"
)

// A keys file holds relay keys outside Caddy's config, for a relay with
// many of them: Caddy keeps its config as JSON, encodes and decodes it
// again at every load, and serves it at GET /config/, which costs seconds
// and hundreds of megabytes at a hundred thousand keys. The relay reads the
// file itself when its config loads, so a reload (`caddy reload --force`
// when only the file changed) reads it again.

// fileKey is a key read from the keys file.
type fileKey struct {
	*Key
	line int    // where its entry starts, for errors
	sum  uint64 // of its entry as written: what it declares (see declareFileKeys)
}

// maxKeysFileSize bounds the keys file: it is read whole.
const maxKeysFileSize = 1 << 30

// readKeysFile reads r.KeysFile, when set, into r.fileKeys: a JSON array of
// key objects of the same form as the config's keys, or one key object
// after another (one a line, say). Each is checked as a config's key is;
// their names may not be taken by the config's keys or user entries.
func (r *Relay) readKeysFile() error {
	if r.KeysFile == "" {
		return nil
	}
	path := caddy.NewReplacer().ReplaceKnown(r.KeysFile, "")
	fail := func(format string, args ...any) error {
		return fmt.Errorf("keys_file %s: %s", path, fmt.Sprintf(format, args...))
	}
	info, err := os.Stat(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return fail("no such file")
		}
		return fail("%v", err)
	}
	if info.Size() > maxKeysFileSize {
		return fail("it is %d bytes, more than the %d a keys file may have", info.Size(), maxKeysFileSize)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return fail("%v", err)
	}
	groups := make(map[string]bool, len(r.Groups))
	for _, g := range r.Groups {
		groups[g.Name] = true
	}
	taken := make(map[string]string, len(r.Keys)+len(r.Users)) // name -> what has it
	for i, k := range r.Keys {
		if k.Name != "" {
			taken[k.Name] = "the config's key #" + strconv.Itoa(i+1)
		}
	}
	for _, u := range r.Users {
		taken[cmp.Or(u.Name, userStatePrefix+u.ID)] = u.label()
	}

	keys := make([]fileKey, 0, bytes.Count(b, []byte{'\n'})+1) // a key a line, usually
	literal := 0
	interned := map[string]string{}
	intern := func(s string) string {
		if v, ok := interned[s]; ok || s == "" {
			return v
		}
		interned[s] = s
		return s
	}
	lines := lineCounter{b: b}
	dec := jsontext.NewDecoder(bytes.NewReader(b))
	open := dec.PeekKind() == '[' // an array of keys, not yet closed
	if open {
		_, _ = dec.ReadToken()
	}
	for {
		kind := dec.PeekKind()
		if kind == 0 { // the end, or not JSON: the read below tells
			break
		}
		if open && kind == ']' {
			_, _ = dec.ReadToken()
			open = false
			break
		}
		line := lines.at(dec.InputOffset())
		v, err := dec.ReadValue()
		if err != nil {
			return fail("line %d: %v", line, err)
		}
		i := len(keys)
		k := new(Key)
		if err := json.Unmarshal(v, k, json.RejectUnknownMembers(true)); err != nil {
			return fail("line %d: key #%d: %s", line, i+1, entryError(err))
		}
		if err := k.check(i, groups); err != nil {
			return fail("line %d: %v", line, err)
		}
		if k.Name != "" {
			if was, dup := taken[k.Name]; dup {
				return fail("line %d: %s and %s have the same name %q", line, k.label(i), was, k.Name)
			}
			taken[k.Name] = "key #" + strconv.Itoa(i+1) + " of the file"
		}
		if literalSecret(k.Secret) {
			literal++
		}
		// many keys share their group and limits: one copy of each
		for _, f := range []*string{&k.Group, &k.Priority, &k.Rate, &k.Tokens, &k.UserRate, &k.UserTokens, &k.Expires} {
			*f = intern(*f)
		}
		keys = append(keys, fileKey{Key: k, line: line, sum: xxhash.Sum64(v)})
	}
	switch _, err := dec.ReadToken(); {
	case err == nil:
		return fail("line %d: something follows the array of keys", lines.at(dec.InputOffset()))
	case !errors.Is(err, io.EOF):
		return fail("line %d: %v", lines.at(dec.InputOffset()), err)
	case open:
		return fail("the array of keys is not closed")
	}
	if len(keys) == 0 && len(r.Keys) == 0 && len(r.Users) == 0 {
		return fail("it holds no key, and the config has none: every request would be refused")
	}
	if literal > 0 && info.Mode().Perm()&0o004 != 0 {
		r.logger.Warn("the keys file holds secrets as they are and every user of this machine can read it; "+
			"make it readable by caddy alone (chmod 600), or give each secret's sha256 (\"secret\": \"sha256:<64 hex digits>\")",
			zap.String("keys_file", path), zap.Int("literal_secrets", literal))
	}
	r.fileKeys = keys
	return nil
}

// lineCounter tells the line of an offset into b, for offsets that only
// grow: each byte is looked at once.
type lineCounter struct {
	b    []byte
	off  int64
	line int
}

// at is the line of the first byte at or after off that is neither space
// nor a comma: where the next value starts.
func (c *lineCounter) at(off int64) int {
	for off < int64(len(c.b)) && bytes.IndexByte([]byte(" \t\r\n,"), c.b[off]) >= 0 {
		off++
	}
	if c.line == 0 {
		c.line = 1
	}
	if off > c.off {
		c.line += bytes.Count(c.b[c.off:off], []byte{'\n'})
		c.off = off
	}
	return c.line
}

// entryError says what is wrong in an entry of the keys file that does not
// decode as a key, without the JSON library's wording (which varies on
// purpose) and without any value: a secret may be one.
func entryError(err error) string {
	var se *json.SemanticError
	if !errors.As(err, &se) {
		return "not a key"
	}
	field := strings.TrimPrefix(string(se.JSONPointer), "/")
	switch {
	case errors.Is(se.Err, json.ErrUnknownName):
		return fmt.Sprintf("%q is not a field of a key", field)
	case field == "":
		return "not an object with the fields of a key"
	case se.GoType != nil:
		return fmt.Sprintf("field %q: a JSON %s where a %s belongs", field, se.JSONKind, se.GoType)
	}
	return fmt.Sprintf("field %q is not what a key takes", field)
}
