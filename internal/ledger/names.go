package ledger

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
)

// A row's seven names (its key, user, group, channel, requested and
// served model, and cause) are the same for most rows, and cost the most
// to write: SQLite copies each string it binds and builds a record of
// them. The ledger stores each set of names once, in relay_usage_names,
// and a row refers to it by its id (names_id in relay_usage_rows); the
// view relay_usage joins them back into the row (ledgerViewColumns) that
// GET /relay/usage and SQL users read. A row of one integer where it had
// seven strings costs SQLite about half as much to write.

// ledgerNames is a row's names, as relay_usage_names holds them.
type ledgerNames struct{ key, user, group, channel, model, served, cause string }

// ledgerNameColumns are relay_usage_names' columns of a ledgerNames, in
// the order of its fields.
var ledgerNameColumns = []string{"key_name", "user_name", "group_name", "channel_name", "model", "served_model", "cause"}

// ledgerNamesKept bounds the writer's map of names to ids: past it, the
// map is dropped and learned again from the database, so that requests of
// ever new names (users, say) cannot grow the writer's memory.
const ledgerNamesKept = 100_000

func namesOf(r *Row) ledgerNames {
	return ledgerNames{r.Key, r.User, r.Group, r.Channel, r.Model, r.Served, r.Cause}
}

// sameNames reports whether a and b have the same names.
func sameNames(a, b *Row) bool {
	return a.Key == b.Key && a.User == b.User && a.Group == b.Group && a.Channel == b.Channel &&
		a.Model == b.Model && a.Served == b.Served && a.Cause == b.Cause
}

func compareNames(a, b ledgerNames) int {
	return cmp.Or(strings.Compare(a.key, b.key), strings.Compare(a.user, b.user),
		strings.Compare(a.group, b.group), strings.Compare(a.channel, b.channel),
		strings.Compare(a.model, b.model), strings.Compare(a.served, b.served),
		strings.Compare(a.cause, b.cause))
}

// resolveNames sets s.ids[i] to the id of rows[i]'s names, in tx: those
// the writer knows from its map, the others read from relay_usage_names,
// where the names that are not there yet are added. What tx learns is
// kept in s.learned until it commits (writeTx adds it to s.names then):
// ids a transaction that failed added do not exist.
func (s *sqlStore) resolveNames(ctx context.Context, tx batchTx, rows []Row) error {
	if len(s.names) > ledgerNamesKept {
		s.names = map[ledgerNames]int64{} // a new map: clear keeps the old one's memory
	}
	s.ids = slices.Grow(s.ids[:0], len(rows))[:len(rows)]
	s.missing = s.missing[:0]
	for i := range rows {
		r := &rows[i]
		// most rows have the names of the row before them
		if i > 0 && sameNames(r, &rows[i-1]) {
			s.ids[i] = s.ids[i-1]
			continue
		}
		n := namesOf(r)
		id, ok := s.names[n]
		if !ok {
			if id, ok = s.learned[n]; !ok {
				s.learned[n] = 0 // ids are from 1: 0 is "not read yet"
				s.missing = append(s.missing, n)
			}
		}
		s.ids[i] = id
	}
	if len(s.missing) == 0 {
		return nil
	}
	if err := s.addNames(ctx, tx, s.missing); err != nil {
		return err
	}
	for i := range rows {
		if s.ids[i] != 0 {
			continue
		}
		if i > 0 && sameNames(&rows[i], &rows[i-1]) {
			s.ids[i] = s.ids[i-1]
			continue
		}
		if s.ids[i] = s.learned[namesOf(&rows[i])]; s.ids[i] == 0 {
			return fmt.Errorf("ledger: the names of request %s were neither found nor added", rows[i].ID)
		}
	}
	return nil
}

// addNames adds missing to relay_usage_names (those another relay added
// meanwhile are kept: ON CONFLICT DO NOTHING, which waits for that
// relay's transaction to end), then reads their ids into s.learned. The
// names are added in one order, so that relays adding the same ones at
// once wait for each other rather than deadlock. Rare: a writer reads a
// set of names once (until its map is dropped).
func (s *sqlStore) addNames(ctx context.Context, tx batchTx, missing []ledgerNames) error {
	slices.SortFunc(missing, compareNames)
	for rest := missing; len(rest) > 0; {
		chunk := rest[:min(len(rest), ledgerStatement)] // 7,000 parameters at most
		rest = rest[len(chunk):]
		args := make([]any, 0, len(chunk)*len(ledgerNameColumns))
		for _, n := range chunk {
			args = append(args, n.key, n.user, n.group, n.channel, n.model, n.served, n.cause)
		}
		values := s.valuesSQL(len(chunk), len(ledgerNameColumns))
		cols := strings.Join(ledgerNameColumns, ", ")
		if err := tx.exec(ctx, "INSERT INTO relay_usage_names ("+cols+") VALUES "+values+" ON CONFLICT DO NOTHING", args); err != nil {
			return fmt.Errorf("ledger: add names: %w", err)
		}
		on := make([]string, len(ledgerNameColumns))
		for i, c := range ledgerNameColumns {
			on[i] = fmt.Sprintf("n.%s = v.column%d", c, i+1)
		}
		q := "SELECT n.id, n." + strings.Join(ledgerNameColumns, ", n.") +
			" FROM (VALUES " + values + ") AS v JOIN relay_usage_names AS n ON " + strings.Join(on, " AND ")
		err := tx.queryNames(ctx, q, args, func(id int64, n ledgerNames) {
			if _, ok := s.learned[n]; ok {
				s.learned[n] = id
			}
		})
		if err != nil {
			return fmt.Errorf("ledger: read names: %w", err)
		}
	}
	return nil
}

// keepLearned adds the names a committed transaction learned to s.names,
// their strings copied: a row's strings may be part of a larger one
// (a request's), which the map would keep.
func (s *sqlStore) keepLearned() {
	for n, id := range s.learned {
		s.names[ledgerNames{strings.Clone(n.key), strings.Clone(n.user), strings.Clone(n.group),
			strings.Clone(n.channel), strings.Clone(n.model), strings.Clone(n.served), strings.Clone(n.cause)}] = id
	}
	clear(s.learned)
}
