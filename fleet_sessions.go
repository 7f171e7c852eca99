package relay

import (
	"context"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// Sessions shared by a fleet. A session's requests may reach any relay of
// the fleet, so its budget (a spend account, internal/money's fleet_spend.go and
// fleet_holds.go) and its session_rate (a limiter, internal/limits) are in
// Redis as a key's are, and so is its loop guard's count: each request of
// a session with a loop guard runs loopScript, which compares the digest
// of the pair its conversation ends with to the last one's and counts the
// run, under <prefix>{x:<digest>}:loop, dropped when the session is idle.
// When Redis does not answer, the relay counts on its own meanwhile.

// loopScript counts a session's run of requests that end with the same
// (tool call, tool result) pair. KEYS: the session's loop hash. ARGV: the
// digest of the request's pair (0: none, which ends the run), 1 when the
// request is an SDK's retry (the run does not grow), the hash's lifetime
// in ms. It returns the run, this request included (0: none).
var loopScript = redis.NewScript(`
local d = ARGV[1]
if d == '0' then
  redis.call('DEL', KEYS[1])
  return 0
end
local n
if redis.call('HGET', KEYS[1], 'd') ~= d then
  redis.call('HSET', KEYS[1], 'd', d, 'n', 1)
  n = 1
elseif ARGV[2] == '1' then
  n = tonumber(redis.call('HGET', KEYS[1], 'n') or '1')
else
  n = redis.call('HINCRBY', KEYS[1], 'n', 1)
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return n
`)

// loopRun counts the request's pair (d; 0: none) in the fleet's run of
// the session (tag); ok is false when Redis did not answer.
func (f *member) loopRun(tag string, d uint64, retry bool) (run int, ok bool) {
	r := "0"
	if retry {
		r = "1"
	}
	var n int64
	err := f.Do("loop", func(ctx context.Context) error {
		var err error
		n, err = loopScript.Run(ctx, f.Redis, []string{f.Key(tag, "loop")}, strconv.FormatUint(d, 10), r, sessionIdle.Milliseconds()).Int64()
		return err
	})
	return int(n), err == nil
}
