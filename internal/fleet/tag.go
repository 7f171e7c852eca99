package fleet

import "strings"

// Tag is the hash tag of a thing (what Key's thing is): its kind (such
// as "k:" for a key, "c:" for a channel, "s:" for a spend account) and
// name, or a digest of the name when the name holds a brace, which would
// end the tag early.
func Tag(kind, name string) string {
	if strings.ContainsAny(name, "{}") {
		return kind + Digest(name)
	}
	return kind + name
}
