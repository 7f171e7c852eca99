//go:build unix

package ledger

import (
	"os"
	"syscall"
)

// fileLinks is how many paths name the file fi describes (0: it was
// deleted, and lives on only while it is open); false when fi does not say.
func fileLinks(fi os.FileInfo) (uint64, bool) {
	if fi == nil {
		return 0, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, false
	}
	return uint64(st.Nlink), true //nolint:unconvert // its type differs between systems
}
