package ledger

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"sync/atomic"
	"time"
)

// A SQLite ledger is a file of this machine, which an operator, a cleanup
// job or a restore from a backup may delete, move or replace while the
// relay runs. SQLite goes on writing through the file it has open, without
// an error, when no path names it any more: the rows written so are gone
// once the relay lets go of it, and a reader that opens the path meanwhile
// finds another file (or makes an empty one, without the schema). So before
// each batch the writer looks whether the path still names the file it
// writes; when it does not, it lets go of that file and opens the one at
// the path, made with the schema when there is none, and writes there.

// fileStore is a ledger store kept in a file of this machine.
type fileStore interface {
	// reopen makes sure the store writes the file its path names: when
	// the path names another file, or none, it lets go of the file it had
	// open and opens the one at the path (making it, with the schema),
	// and says what became of the one it had. An error says no file is
	// open: the batch is not written, and waits as in an outage.
	reopen(ctx context.Context) (fileChange, error)
}

// fileChange is what became of the file a store had open, once its path
// named another file or none.
type fileChange struct {
	changed bool
	// moved says another path still names it (it was renamed): its rows
	// are there
	moved bool
	// lost is how many rows it held when no path named it any more (it
	// was deleted, or replaced by another file): rows gone with it, those
	// SQLite wrote to it after it was deleted included; -1 when they could
	// not be counted
	lost int64
}

// sqliteFile is a SQLite ledger that notices its file deleted, moved or
// replaced under it (reopen, before each batch).
type sqliteFile struct {
	path   string
	digest func(string) string      // a session id as its rows keep it
	cur    atomic.Pointer[sqlStore] // nil while no file is open: making it again failed
	// file is the file cur has open, held by a descriptor of its own:
	// stat on it says whether the path still names it, and, once it does
	// not, whether another path does. Only the writer uses it. (SQLite's
	// locks on Linux belong to its own descriptors, which closing this one
	// leaves alone; it is closed only once SQLite let go of the file.)
	file *os.File
}

// openSQLiteFile opens (and makes) the SQLite ledger at path.
func openSQLiteFile(path string, digest func(string) string) (*sqliteFile, error) {
	f := &sqliteFile{path: path, digest: digest}
	if err := f.open(); err != nil {
		return nil, err
	}
	return f, nil
}

// open opens the ledger at f's path, and holds its file.
func (f *sqliteFile) open() error {
	s, err := openSQLiteStore(f.path, f.digest)
	if err != nil {
		return err
	}
	file, err := os.Open(f.path)
	if err != nil {
		_ = s.Close()
		return fmt.Errorf("ledger sqlite %s: %w", f.path, err)
	}
	f.file = file
	f.cur.Store(s)
	return nil
}

func (f *sqliteFile) reopen(ctx context.Context) (fileChange, error) {
	var ch fileChange
	if s := f.cur.Load(); s != nil {
		at, err := os.Stat(f.path)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return ch, nil // the path cannot be looked at now: the file open is written on
		}
		held, herr := f.file.Stat()
		if err == nil && herr == nil && os.SameFile(at, held) {
			return ch, nil
		}
		f.cur.Store(nil) // no reader starts on the old file any more
		ch = fileChange{changed: true, lost: -1}
		if links, ok := fileLinks(held); herr == nil && ok && links > 0 {
			ch.moved, ch.lost = true, 0
		} else if n, err := s.raw.rows(ctx); err == nil {
			ch.lost = n
		}
		// SQLite names a file's WAL after the path, and once the file
		// has moved it neither writes its WAL into it nor deletes it as
		// it lets go: the WAL is written into the file and emptied
		// first, so that a file moved away holds every row, and a file
		// put in its place is not read with another's WAL (which would
		// corrupt it). Then SQLite lets go of it before a new file is
		// opened at the path. It has time of its own: counting may
		// have taken the batch's.
		wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ledgerWriteTimeout)
		_ = s.raw.checkpoint(wctx)
		cancel()
		_ = s.Close()
		_ = f.file.Close()
		f.file = nil
	}
	return ch, f.open()
}

// now is the ledger f has open, or why there is none.
func (f *sqliteFile) now() (*sqlStore, error) {
	if s := f.cur.Load(); s != nil {
		return s, nil
	}
	return nil, fmt.Errorf("ledger sqlite %s: no file is open: it went, and could not be made again", f.path)
}

func (f *sqliteFile) Write(ctx context.Context, rows []Row) error {
	s, err := f.now()
	if err != nil {
		return err
	}
	return s.Write(ctx, rows)
}

func (f *sqliteFile) Prune(ctx context.Context, before time.Time) (int64, error) {
	s, err := f.now()
	if err != nil {
		return 0, err
	}
	return s.Prune(ctx, before)
}

func (f *sqliteFile) Usage(ctx context.Context, q Query, emit func(UsageRow) error) error {
	s, err := f.now()
	if err != nil {
		return err
	}
	return s.Usage(ctx, q, emit)
}

func (f *sqliteFile) Close() error {
	var err error
	if s := f.cur.Swap(nil); s != nil {
		err = s.Close()
	}
	if f.file != nil {
		_ = f.file.Close()
		f.file = nil
	}
	return err
}

// Interface guards
var (
	_ Store     = (*sqliteFile)(nil)
	_ fileStore = (*sqliteFile)(nil)
)
