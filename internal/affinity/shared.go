package affinity

import (
	"context"
	"encoding/hex"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/redis/go-redis/v9"
)

// Prompt-cache affinity in a fleet: the records are shared through Redis,
// one string per prefix, `<until in Unix ms> <channel>`, expiring with the
// cache it names. A node asks Redis only when its own table has no live
// record of a request's prefixes: one MGET of the request's keys (all of
// one group sit in one hash slot), before the first pick. It writes the
// records after the answer, off the request's path, batched by a worker.

// Shared is the records of a fleet, on the fleet's client: read on a
// request's path, written by a worker that runs as the client's
// background work until it stops.
type Shared struct {
	c      *fleet.Client
	writes chan write // records to write
}

// write is a record for Redis.
type write struct {
	key   string
	value string
	ttl   time.Duration
}

// NewShared shares the records through the fleet of c; its writer runs as
// c's background work.
func NewShared(c *fleet.Client) *Shared {
	s := &Shared{c: c, writes: make(chan write, 4096)}
	c.Go(s.writeRecords)
	return s
}

// key is the Redis key of a group's prefix.
func (s *Shared) key(group string, k Key) string {
	return s.c.Key("a:"+group, hex.EncodeToString(k[:]))
}

// warm asks Redis for the channel with a live record of p's longest
// prefix that has one: the channel, the index of that prefix's key, and
// until when (Unix ns); "" when none has, or Redis did not answer in
// time.
func (s *Shared) warm(p *Prompt, now time.Time) (string, int, int64) {
	keys := make([]string, p.N)
	for i := range keys {
		keys[i] = s.key(p.Group, p.Keys[i])
	}
	var vals []any
	err := s.c.Do("affinity", func(ctx context.Context) error {
		var err error
		vals, err = s.c.Redis.MGet(ctx, keys...).Result()
		return err
	})
	if err != nil {
		return "", 0, 0
	}
	for i := len(vals) - 1; i >= 0; i-- {
		v, ok := vals[i].(string)
		if !ok {
			continue
		}
		ms, ch, ok := strings.Cut(v, " ")
		until, err := strconv.ParseInt(ms, 10, 64)
		if !ok || err != nil || ch == "" || until*int64(time.Millisecond) <= now.UnixNano() {
			continue
		}
		return ch, i, until * int64(time.Millisecond)
	}
	return "", 0, 0
}

// record queues the records of p's prefixes on channel for Redis; when
// the queue is full (Redis slow or down) they stay on this node.
func (s *Shared) record(p *Prompt, channel string, now time.Time) {
	for i := range int(p.N) {
		ttl := p.TTL(i)
		w := write{key: s.key(p.Group, p.Keys[i]), ttl: ttl,
			value: strconv.FormatInt(now.Add(ttl).UnixMilli(), 10) + " " + channel}
		select {
		case s.writes <- w:
		default:
			return
		}
	}
}

// writeRecords writes the queued records, a batch a round trip, until ctx
// ends.
func (s *Shared) writeRecords(ctx context.Context) {
	batch := make([]write, 0, 256)
	for {
		select {
		case <-ctx.Done():
			return
		case w := <-s.writes:
			batch = append(batch[:0], w)
		}
	more:
		for len(batch) < cap(batch) {
			select {
			case w := <-s.writes:
				batch = append(batch, w)
			default:
				break more
			}
		}
		_ = s.c.Background("affinity_record", func(ctx context.Context) error {
			_, err := s.c.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
				for _, w := range batch {
					pipe.Set(ctx, w.key, w.value, w.ttl)
				}
				return nil
			})
			return err
		})
	}
}
