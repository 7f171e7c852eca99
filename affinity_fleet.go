package relay

import (
	"context"
	"encoding/hex"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Prompt-cache affinity in a fleet: the records are shared through Redis,
// one string per prefix, `<until in Unix ms> <channel>`, expiring with the
// cache it names. A node asks Redis only when its own table has no live
// record of a request's prefixes: one MGET of the request's keys (all of
// one group sit in one hash slot), before the first pick. It writes the
// records after the answer, off the request's path, batched by a worker.

// affinityWrite is a record for Redis.
type affinityWrite struct {
	key   string
	value string
	ttl   time.Duration
}

// affinityKey is the Redis key of a group's prefix.
func (f *member) affinityKey(group string, k prefixKey) string {
	return f.Key("a:"+group, hex.EncodeToString(k[:]))
}

// affinityWarm asks Redis for the channel with a live record of p's
// longest prefix that has one: the channel, the index of that prefix's
// key, and until when (Unix ns); "" when none has, or Redis did not
// answer in time.
func (f *member) affinityWarm(group string, p *cachePrefix, now time.Time) (string, int, int64) {
	keys := make([]string, p.nkeys)
	for i := range keys {
		keys[i] = f.affinityKey(group, p.keys[i])
	}
	var vals []any
	err := f.Do("affinity", func(ctx context.Context) error {
		var err error
		vals, err = f.Redis.MGet(ctx, keys...).Result()
		return err
	})
	if err != nil {
		return "", 0, 0
	}
	for i := len(vals) - 1; i >= 0; i-- {
		s, ok := vals[i].(string)
		if !ok {
			continue
		}
		ms, ch, ok := strings.Cut(s, " ")
		until, err := strconv.ParseInt(ms, 10, 64)
		if !ok || err != nil || ch == "" || until*int64(time.Millisecond) <= now.UnixNano() {
			continue
		}
		return ch, i, until * int64(time.Millisecond)
	}
	return "", 0, 0
}

// recordAffinity queues the records of p's prefixes on channel for Redis;
// when the queue is full (Redis slow or down) they stay on this node.
func (f *member) recordAffinity(p *cachePrefix, channel string, now time.Time) {
	for i := range int(p.nkeys) {
		ttl := p.ttlOf(i)
		w := affinityWrite{key: f.affinityKey(p.group, p.keys[i]), ttl: ttl,
			value: strconv.FormatInt(now.Add(ttl).UnixMilli(), 10) + " " + channel}
		select {
		case f.affinity <- w:
		default:
			return
		}
	}
}

// writeAffinity writes the queued records, a batch a round trip, until
// ctx ends.
func (f *member) writeAffinity(ctx context.Context) {
	batch := make([]affinityWrite, 0, 256)
	for {
		select {
		case <-ctx.Done():
			return
		case w := <-f.affinity:
			batch = append(batch[:0], w)
		}
	more:
		for len(batch) < cap(batch) {
			select {
			case w := <-f.affinity:
				batch = append(batch, w)
			default:
				break more
			}
		}
		_ = f.Background("affinity_record", func(ctx context.Context) error {
			_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
				for _, w := range batch {
					pipe.Set(ctx, w.key, w.value, w.ttl)
				}
				return nil
			})
			return err
		})
	}
}
