//! Every script the store runs in Redis. Each is one atomic step: Redis runs a script to its end
//! before any other command, so a script that reads the fence and then writes is a fenced write,
//! with no window between the check and the write.
//!
//! Times are the Redis server's clock (`TIME`), in milliseconds since the Unix epoch, read inside
//! the script, so leases are measured by one clock whatever the clients' clocks say. (Redis 7
//! replicates a script by its effects, so reading the clock in one is allowed.)
//!
//! A key's row is a hash (`t` tenant, `k` key, `fp` fingerprint, `wf` workflow, `req` request,
//! `st` `started` or `done`, `rp` recovery point, `out` its output, `lv` fencing token, `lu` lease
//! end, `att` attempts, `err` last error, `life` the claim's token, `ca` created, `rs` `rh` `rb`
//! the response, `apart` the token of the finish whose body is stored apart, `fa` finished).
//! Every key lives in one of [`crate::BUCKETS`] buckets, chosen by its tenant and key, and every
//! Redis key of a bucket carries the bucket's hash tag, so all sit in one hash slot: the row, its
//! body apart, and the bucket's fence, sorted sets of lease ends (one per workflow), set of
//! finishes, set of workflows, index of keys and hash of leased rows. A started key is in its
//! workflow's sorted set of lease ends of its bucket, which the resumer reads instead of scanning
//! the keyspace; a finished key is in its bucket's sorted set of finishes, which retention reads.
//!
//! Every script touches the keys of one bucket only, so it runs on Redis Cluster as on one
//! Redis. Every key a script writes is one it was given (`KEYS`), as Redis Cluster asks, so that
//! while a resharding moves the bucket's slot a write is sent where its keys are, or told to try
//! again: a write never lands beside keys that moved. What a script only reads beyond its keys (a
//! row a sorted set names) is a hint, checked again by the write that follows.

/// The server's clock in milliseconds, as every script reads it, and `next_token`: the fence's
/// next token, never below the clock in microseconds.
///
/// Why the floor: the counter is lost with Redis's data (a restart without persistence, a failover
/// to a replica that missed the last writes), and counting again from where the surviving copy
/// was would hand out tokens that owners still at work hold: such an owner's fenced write would
/// land on a key claimed after the loss. Starting again at the clock puts every new token above
/// every token handed out before the loss, as long as the tokens did not outrun the clock (a
/// million claims a second) and the clock did not step back past the loss.
const NOW: &str = "local clock = redis.call('TIME') \
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) \
local function next_token(fence) \
    local token = redis.call('INCR', fence) \
    local floor = tonumber(clock[1]) * 1000000 + tonumber(clock[2]) \
    if token < floor then \
        redis.call('SET', fence, string.format('%d', floor)) \
        return floor \
    end \
    return token \
end ";

/// `true` when the row is started and holds token `ARGV[1]`: the fence of every owner write.
const FENCE: &str = "local held = redis.call('HMGET', KEYS[1], 'lv', 'st') \
if held[1] ~= ARGV[1] or held[2] ~= 'started' then return 0 end ";

/// `journal(row, entry)`: appends one JSON entry to the row's journal (`jr`: entries one per line,
/// `jn` their count), keeping at most 64 (`idemflow_store::JOURNAL_LIMIT`): when full, the entry
/// after the claim goes, so the claim stays first and the newest last. `jstr(text)` is a JSON
/// string. Written in the script that makes the change, with the script's clock: never a command
/// of its own.
const JOURNAL: &str = "local function jstr(text) return cjson.encode(text) end \
local function journal(row, entry) \
    local text = redis.call('HGET', row, 'jr') \
    local count = tonumber(redis.call('HGET', row, 'jn') or '0') or 0 \
    if not text or text == '' then \
        text = entry \
        count = 1 \
    else \
        text = text .. '\\n' .. entry \
        count = count + 1 \
    end \
    if count > 64 then \
        local first = string.find(text, '\\n', 1, true) \
        local second = first and string.find(text, '\\n', first + 1, true) \
        if second then \
            text = string.sub(text, 1, first) .. string.sub(text, second + 1) \
            count = count - 1 \
        end \
    end \
    redis.call('HSET', row, 'jr', text, 'jn', count) \
end ";

fn script(parts: &[&str]) -> redis::Script {
    redis::Script::new(&parts.concat())
}

/// A script that only reads: what operators' tools run. It goes as `EVALSHA_RO` (`EVAL_RO` when
/// the server has not cached it yet), so a Redis user allowed reads only may run it (the
/// read-only recipe of docs/console.md: `+@read +time +evalsha_ro +eval_ro`), and Redis itself
/// refuses it any write. A server older than Redis 7, which has neither, gets `EVALSHA`.
pub(crate) struct ReadOnly {
    script: redis::Script,
    code: String,
}

fn read_only(parts: &[&str]) -> ReadOnly {
    let code = parts.concat();
    ReadOnly {
        script: redis::Script::new(&code),
        code,
    }
}

impl ReadOnly {
    /// A call with its first key.
    pub(crate) fn key(&self, key: impl redis::ToRedisArgs) -> ReadCall<'_> {
        let mut call = ReadCall {
            script: self,
            keys: Vec::new(),
            args: Vec::new(),
        };
        call.key(key);
        call
    }
}

/// A call of a [`ReadOnly`] script, its keys and arguments.
pub(crate) struct ReadCall<'a> {
    script: &'a ReadOnly,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl ReadCall<'_> {
    pub(crate) fn key(&mut self, key: impl redis::ToRedisArgs) -> &mut Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    pub(crate) fn arg(&mut self, arg: impl redis::ToRedisArgs) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    fn command(&self, name: &str, body: &str) -> redis::Cmd {
        let mut command = redis::cmd(name);
        command
            .arg(body)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        command
    }

    pub(crate) async fn invoke_async<T: redis::FromRedisValue>(
        &self,
        connection: &mut (impl redis::aio::ConnectionLike + Send),
    ) -> redis::RedisResult<T> {
        let hash = self.script.script.get_hash();
        match self
            .command("EVALSHA_RO", hash)
            .query_async(connection)
            .await
        {
            Err(error) if error.code() == Some("NOSCRIPT") => {
                self.command("EVAL_RO", &self.script.code)
                    .query_async(connection)
                    .await
            }
            Err(error) if unknown_command(&error) => {
                let mut invocation = self.script.script.prepare_invoke();
                for key in &self.keys {
                    invocation.key(key.as_slice());
                }
                for arg in &self.args {
                    invocation.arg(arg.as_slice());
                }
                invocation.invoke_async(connection).await
            }
            answered => answered,
        }
    }
}

/// The server has no such command (`EVALSHA_RO` before Redis 7).
fn unknown_command(error: &redis::RedisError) -> bool {
    error.code() == Some("ERR") && error.to_string().contains("unknown command")
}

/// KEYS: row. Returns `{now, {fp, wf, st, lu, lv, rs, rh, rb, apart}}`.
pub(crate) fn look_up() -> redis::Script {
    script(&[
        NOW,
        "return {now, redis.call('HMGET', KEYS[1], 'fp', 'wf', 'st', 'lu', 'lv', 'rs', 'rh', \
         'rb', 'apart')}",
    ])
}

/// KEYS: row, fence, leases, workflows, finishes, index, leased (all of the row's bucket), and
/// an eighth when the client knows it: the bucket's set of lease ends of the workflow an earlier
/// row of the key left an entry in. ARGV: tenant, key, fingerprint, workflow, request, lease ms,
/// the workflow in hex, the row's member of the index, the workflow in hex of the eighth key (or
/// `''`). Returns `{token, ''}`; `{0, ''}` when the key is there (nothing written); `{-1,
/// workflow in hex}` when an earlier row of the key, lost alone, left an entry in another
/// workflow's set that the call did not name (nothing written: the client names it and calls
/// again, so that every key the script writes is one it declared).
///
/// The workflow joins the bucket's set of workflows with keys, which the resumer's lag and its
/// count of keys no worker knows read. What an earlier row of the key that was lost alone
/// (evicted, deleted by hand) left in the sets goes: its finish (retention would take it for this
/// claim and delete a running key) and its lease end, in whichever workflow's set it is (a
/// resumer of that workflow would take this claim for its own and run its phases on another
/// workflow's request); `leased` names that set.
pub(crate) fn claim() -> redis::Script {
    script(&[
        "if redis.call('EXISTS', KEYS[1]) == 1 then return {0, ''} end \
         local old = redis.call('HGET', KEYS[7], KEYS[1]) \
         if old and old ~= ARGV[7] and old ~= ARGV[9] then return {-1, old} end ",
        NOW,
        JOURNAL,
        "local token = next_token(KEYS[2]) \
         local ends = now + tonumber(ARGV[6]) \
         redis.call('HSET', KEYS[1], 't', ARGV[1], 'k', ARGV[2], 'fp', ARGV[3], 'wf', ARGV[4], \
             'req', ARGV[5], 'st', 'started', 'rp', 'start', 'lv', token, 'lu', ends, 'att', 1, \
             'life', token, 'ca', now) \
         if old and old ~= ARGV[7] then redis.call('ZREM', KEYS[8], KEYS[1]) end \
         redis.call('ZADD', KEYS[3], ends, KEYS[1]) \
         redis.call('HSET', KEYS[7], KEYS[1], ARGV[7]) \
         redis.call('SADD', KEYS[4], ARGV[7]) \
         redis.call('ZREM', KEYS[5], KEYS[1]) \
         redis.call('ZADD', KEYS[6], 0, ARGV[8]) \
         journal(KEYS[1], string.format('{\"at\":%d,\"event\":\"claimed\",\"token\":%d}', \
             now, token)) \
         return {token, ''}",
    ])
}

/// KEYS: row, leases. ARGV: token, recovery point, output, lease ms. 1, or 0 when fenced.
/// The lease never shortens.
pub(crate) fn advance() -> redis::Script {
    script(&[
        FENCE,
        NOW,
        JOURNAL,
        "local ends = math.max(tonumber(redis.call('HGET', KEYS[1], 'lu')), now + tonumber(ARGV[4])) \
         redis.call('HSET', KEYS[1], 'rp', ARGV[2], 'out', ARGV[3], 'att', 1, 'lu', ends) \
         redis.call('HDEL', KEYS[1], 'err') \
         redis.call('ZADD', KEYS[2], ends, KEYS[1]) \
         journal(KEYS[1], string.format('{\"at\":%d,\"event\":\"phase\",\"token\":%s,\"point\":%s}', \
             now, ARGV[1], jstr(ARGV[2]))) \
         return 1",
    ])
}

/// KEYS: row, leases, finishes, leased, the body apart (`<row>:body:<token>`). ARGV: token,
/// recovery point, status, headers, body, `1` to store the body apart (under the fifth key, named
/// by the finishing owner's token: one per life, as a key finishes once per life and its tokens
/// never repeat). 1, or 0 when fenced.
pub(crate) fn finish() -> redis::Script {
    script(&[
        FENCE,
        NOW,
        JOURNAL,
        "redis.call('HSET', KEYS[1], 'st', 'done', 'rp', ARGV[2], 'rs', ARGV[3], 'rh', ARGV[4], \
             'fa', now) \
         redis.call('HDEL', KEYS[1], 'out', 'lu') \
         if ARGV[6] == '1' then \
             redis.call('SET', KEYS[5], ARGV[5]) \
             redis.call('HSET', KEYS[1], 'rb', '', 'apart', ARGV[1]) \
         else \
             redis.call('HSET', KEYS[1], 'rb', ARGV[5]) \
         end \
         redis.call('ZREM', KEYS[2], KEYS[1]) \
         redis.call('HDEL', KEYS[4], KEYS[1]) \
         redis.call('ZADD', KEYS[3], now, KEYS[1]) \
         journal(KEYS[1], string.format('{\"at\":%d,\"event\":\"finished\",\"token\":%s,\"status\":%d}', \
             now, ARGV[1], tonumber(ARGV[3]))) \
         return 1",
    ])
}

/// KEYS: row, leases. ARGV: token, lease ms. 1, or 0 when fenced. Never shortens the lease.
pub(crate) fn renew_lease() -> redis::Script {
    script(&[
        FENCE,
        NOW,
        "local ends = math.max(tonumber(redis.call('HGET', KEYS[1], 'lu')), now + tonumber(ARGV[2])) \
         redis.call('HSET', KEYS[1], 'lu', ends) \
         redis.call('ZADD', KEYS[2], ends, KEYS[1]) \
         return 1",
    ])
}

/// KEYS: row, fence, leases. ARGV: token, retry-after ms, last error. 1, or 0 when fenced. The
/// fence advances: the postponing owner is done with the key.
pub(crate) fn postpone() -> redis::Script {
    script(&[
        FENCE,
        NOW,
        JOURNAL,
        "local ends = now + tonumber(ARGV[2]) \
         local token = next_token(KEYS[2]) \
         redis.call('HSET', KEYS[1], 'lv', token, 'lu', ends, 'err', ARGV[3]) \
         redis.call('ZADD', KEYS[3], ends, KEYS[1]) \
         journal(KEYS[1], string.format('{\"at\":%d,\"event\":\"failed\",\"token\":%d,\"point\":%s,\"error\":%s}', \
             now, token, jstr(redis.call('HGET', KEYS[1], 'rp')), jstr(ARGV[3]))) \
         return 1",
    ])
}

/// KEYS: row, leases, index, leased. ARGV: token, the row's member of the index. 1, or 0 when
/// fenced. Deletes the started key.
pub(crate) fn delete_owned() -> redis::Script {
    script(&[
        FENCE,
        "redis.call('DEL', KEYS[1]) \
         redis.call('ZREM', KEYS[2], KEYS[1]) \
         redis.call('ZREM', KEYS[3], ARGV[2]) \
         redis.call('HDEL', KEYS[4], KEYS[1]) \
         return 1",
    ])
}

/// KEYS: row, fence, leases. ARGV: the token seen. The new token, or 0 when the key is not
/// started or its token moved on. The lease ends now.
pub(crate) fn end_lease() -> redis::Script {
    script(&[
        FENCE,
        NOW,
        JOURNAL,
        "local token = next_token(KEYS[2]) \
         redis.call('HSET', KEYS[1], 'lv', token, 'lu', now) \
         redis.call('ZADD', KEYS[3], now, KEYS[1]) \
         journal(KEYS[1], string.format('{\"at\":%d,\"event\":\"lease_ended\",\"token\":%d,\"by\":\"operator\"}', \
             now, token)) \
         return token",
    ])
}

/// The body of a takeover, shared by [`take_over`] and [`take_due`] (after [`NOW`], whose
/// `next_token` it calls): `row` started, held by
/// `seen` (or any token when `seen` is false), its lease over: a new token, one attempt more, a
/// lease of `lease` ms. Returns the taken key's fields, or false.
const TAKE: &str = "local function take(row, fence, leases, seen, lease, now, by) \
    local held = redis.call('HMGET', row, 'lv', 'st', 'lu') \
    if held[2] ~= 'started' then return false end \
    if seen and held[1] ~= seen then return false end \
    if tonumber(held[3]) > now then return false end \
    local token = next_token(fence) \
    local attempts = redis.call('HINCRBY', row, 'att', 1) \
    local ends = now + lease \
    redis.call('HSET', row, 'lv', token, 'lu', ends) \
    redis.call('ZADD', leases, ends, row) \
    journal(row, string.format('{\"at\":%d,\"event\":\"taken_over\",\"token\":%d,\"by\":\"%s\",\"attempt\":%d}', \
        now, token, by, attempts)) \
    local fields = redis.call('HMGET', row, 't', 'k', 'rp', 'out', 'req', 'err') \
    return {token, attempts, fields[1], fields[2], fields[3], fields[4], fields[5], fields[6]} \
end ";

/// KEYS: row, fence, leases. ARGV: the token seen, lease ms. `{token, attempts, tenant, key,
/// recovery point, output, request, last error}`, or nil when the key moved on or its lease lives.
pub(crate) fn take_over() -> redis::Script {
    script(&[
        NOW,
        JOURNAL,
        TAKE,
        "return take(KEYS[1], KEYS[2], KEYS[3], ARGV[1], tonumber(ARGV[2]), now, 'retry')",
    ])
}

/// KEYS: each workflow's set of lease ends in one bucket. ARGV: how many. The due entries of
/// those sets, the longest-lapsed first whatever their workflow: `{lease end, workflow index
/// (1-based), row}` each, at most that many. Read-only: the resumer's first look at a bucket,
/// which [`take_due`] then takes entry by entry.
pub(crate) fn due() -> ReadOnly {
    read_only(&[
        NOW,
        "local left = tonumber(ARGV[1]) \
         local due = {} \
         for index = 1, #KEYS do \
             local ends = redis.call('ZRANGEBYSCORE', KEYS[index], '-inf', now, 'WITHSCORES', \
                 'LIMIT', 0, left) \
             for at = 1, #ends, 2 do \
                 table.insert(due, {tonumber(ends[at + 1]), index, ends[at]}) \
             end \
         end \
         table.sort(due, function(a, b) return a[1] < b[1] end) \
         local found = {} \
         for at = 1, math.min(left, #due) do \
             table.insert(found, {string.format('%d', due[at][1]), due[at][2], due[at][3]}) \
         end \
         return found",
    ])
}

/// KEYS: row, fence, the leases of the workflow whose set named the row, leased. ARGV: lease ms,
/// the workflow, the workflow in hex. The resumer's takeover of one due entry: `{token,
/// attempts, tenant, key, recovery point, output, request, last error}`, or nil. An entry whose
/// row is gone (deleted, lost alone), or is another workflow's (lost alone and claimed again
/// under it), is dropped from the set and never taken.
pub(crate) fn take_due() -> redis::Script {
    script(&[
        NOW,
        JOURNAL,
        TAKE,
        "local workflow = redis.call('HGET', KEYS[1], 'wf') \
         if workflow ~= ARGV[2] then \
             redis.call('ZREM', KEYS[3], KEYS[1]) \
             if redis.call('HGET', KEYS[4], KEYS[1]) == ARGV[3] then \
                 redis.call('HDEL', KEYS[4], KEYS[1]) \
             end \
             return false \
         end \
         return take(KEYS[1], KEYS[2], KEYS[3], false, tonumber(ARGV[1]), now, 'resumer')",
    ])
}

/// KEYS: a bucket's workflows. ARGV: the bucket's prefix of the sorted sets of lease ends. How
/// long the oldest lapsed lease of a started key of the bucket has been over, in ms (0 when none
/// has).
pub(crate) fn resumer_lag() -> ReadOnly {
    read_only(&[
        NOW,
        "local lag = 0 \
         for _, workflow in ipairs(redis.call('SMEMBERS', KEYS[1])) do \
             local oldest = redis.call('ZRANGE', ARGV[1] .. workflow, 0, 0, 'WITHSCORES') \
             if oldest[2] then lag = math.max(lag, now - tonumber(oldest[2])) end \
         end \
         return lag",
    ])
}

/// KEYS: a bucket's workflows. ARGV: the bucket's prefix of the sorted sets of lease ends, then
/// the (hex) workflows known. `{workflow, due keys}` for each other workflow with due keys in the
/// bucket.
pub(crate) fn count_due_unknown() -> ReadOnly {
    read_only(&[
        NOW,
        "local known = {} \
         for index = 2, #ARGV do known[ARGV[index]] = true end \
         local counts = {} \
         for _, workflow in ipairs(redis.call('SMEMBERS', KEYS[1])) do \
             if not known[workflow] then \
                 local due = redis.call('ZCOUNT', ARGV[1] .. workflow, '-inf', now) \
                 if due > 0 then table.insert(counts, {workflow, due}) end \
             end \
         end \
         return counts",
    ])
}

/// KEYS: a bucket's finishes. ARGV: keep for ms, how many. Read-only: retention's first look at a
/// bucket, the entries finished longer ago (the oldest first), each `{row, body apart or ''}`,
/// which [`expire_one`] then deletes row by row.
pub(crate) fn expired() -> ReadOnly {
    read_only(&[
        NOW,
        "local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]), \
             'LIMIT', 0, tonumber(ARGV[2])) \
         local found = {} \
         for _, row in ipairs(old) do \
             table.insert(found, {row, redis.call('HGET', row, 'apart') or ''}) \
         end \
         return found",
    ])
}

/// KEYS: row, finishes, index, the body apart seen (`<row>:body:<apart>`, or `<row>:body:`).
/// ARGV: keep for ms, the row's member of the index, the body apart seen (or `''`). 1 when the
/// row was deleted, with its body apart, else 0. A row is deleted only when it is finished, by
/// its own finish time, with the body apart seen (another is a later life: the next batch sees
/// it): an entry whose row was lost, or is started again, is dropped from the set and nothing
/// else, and one behind its row's finish is moved to it (the set is not the truth; the row is).
pub(crate) fn expire_one() -> redis::Script {
    script(&[
        NOW,
        "local cutoff = now - tonumber(ARGV[1]) \
         local held = redis.call('HMGET', KEYS[1], 'st', 'fa', 'apart') \
         if held[1] == 'done' and tonumber(held[2]) <= cutoff then \
             if (held[3] or '') ~= ARGV[3] then return 0 end \
             if held[3] then redis.call('DEL', KEYS[4]) end \
             redis.call('DEL', KEYS[1]) \
             redis.call('ZREM', KEYS[3], ARGV[2]) \
             redis.call('ZREM', KEYS[2], KEYS[1]) \
             return 1 \
         elseif held[1] == 'done' then \
             redis.call('ZADD', KEYS[2], tonumber(held[2]), KEYS[1]) \
         else \
             redis.call('ZREM', KEYS[2], KEYS[1]) \
         end \
         return 0",
    ])
}

/// KEYS: row, the row's body apart prefix (`<row>:body:`). `{now, {t, k, wf, st, rp, lu, lv, att,
/// err, rs, fp, ca, jr}, response bytes}` (the fields nil when the key is absent).
pub(crate) fn report() -> ReadOnly {
    read_only(&[
        NOW,
        "local fields = redis.call('HMGET', KEYS[1], 't', 'k', 'wf', 'st', 'rp', 'lu', 'lv', 'att', \
             'err', 'rs', 'fp', 'ca', 'jr') \
         local bytes = false \
         if fields[4] == 'done' then \
             local apart = redis.call('HGET', KEYS[1], 'apart') \
             if apart then \
                 bytes = redis.call('STRLEN', KEYS[2] .. apart) \
             else \
                 bytes = redis.call('HSTRLEN', KEYS[1], 'rb') \
             end \
         end \
         return {now, fields, bytes}",
    ])
}

/// KEYS: row. `{now, {req, st, rs, rh, rb, apart, fa}}`: a key's stored bodies, with the clock
/// of the server that holds it.
pub(crate) fn bodies() -> ReadOnly {
    read_only(&[
        NOW,
        "return {now, redis.call('HMGET', KEYS[1], 'req', 'st', 'rs', 'rh', 'rb', 'apart', 'fa')}",
    ])
}

/// KEYS: row, index, finishes, the leases of the row's workflow, leased, the body apart seen
/// (`<row>:body:<apart>`, or `<row>:body:`). ARGV: the token shown, the state shown, the row's
/// member of the index, the body apart seen (or `''`). Deletes the key (with its body apart) if it
/// still holds that token, state and body: the state, or nil.
pub(crate) fn expire_key() -> redis::Script {
    script(&[
        "local held = redis.call('HMGET', KEYS[1], 'lv', 'st', 'apart') \
         if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] or (held[3] or '') ~= ARGV[4] then \
             return false \
         end \
         if held[3] then redis.call('DEL', KEYS[6]) end \
         redis.call('DEL', KEYS[1]) \
         redis.call('ZREM', KEYS[2], ARGV[3]) \
         redis.call('ZREM', KEYS[3], KEYS[1]) \
         redis.call('ZREM', KEYS[4], KEYS[1]) \
         if held[2] == 'started' then redis.call('HDEL', KEYS[5], KEYS[1]) end \
         return held[2]",
    ])
}

/// `page(set, score, member, count)`: up to `count` members of the sorted set `set` with their
/// scores, after `member` at `score` (the last one a page before read; `''` for the first page):
/// right after it where it still is (`ZRANK`), else from the first member at that score, so a
/// member that went or moved meanwhile makes some members read twice, never one passed over.
/// `O(log n + count)`, whatever the set's size.
const PAGE: &str = "local function page(set, score, member, count) \
    local start = 0 \
    if member ~= '' then \
        local rank = redis.call('ZRANK', set, member) \
        if rank and redis.call('ZSCORE', set, member) == score then \
            start = rank + 1 \
        else \
            start = redis.call('ZCOUNT', set, '-inf', '(' .. score) \
        end \
    end \
    return redis.call('ZRANGE', set, start, start + count - 1, 'WITHSCORES') \
end ";

/// KEYS: a bucket's workflows, its finishes. ARGV: the bucket's prefix of the sorted sets of lease
/// ends. `{now, {workflow in hex, keys, due}..., finished in the last minute, in the last 15
/// minutes}`: counts only (`ZCARD`, `ZCOUNT`), whatever the number of keys.
pub(crate) fn overview() -> ReadOnly {
    read_only(&[
        NOW,
        "local started = {} \
         for _, workflow in ipairs(redis.call('SMEMBERS', KEYS[1])) do \
             local leases = ARGV[1] .. workflow \
             local keys = redis.call('ZCARD', leases) \
             if keys > 0 then \
                 table.insert(started, {workflow, keys, redis.call('ZCOUNT', leases, '-inf', now)}) \
             end \
         end \
         return {now, started, \
             redis.call('ZCOUNT', KEYS[2], now - 60000, '+inf'), \
             redis.call('ZCOUNT', KEYS[2], now - 900000, '+inf')}",
    ])
}

/// KEYS: a workflow's leases in one bucket. ARGV: the page's position (score, member), its size.
/// One page of the started keys: `{oldest claim (ms) among them or false, members read, the last
/// one's score, the last member}`.
pub(crate) fn oldest_started() -> ReadOnly {
    read_only(&[
        PAGE,
        "local found = page(KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])) \
         local oldest = false \
         for at = 1, #found, 2 do \
             local created = tonumber(redis.call('HGET', found[at], 'ca')) \
             if created and (not oldest or created < oldest) then oldest = created end \
         end \
         return {oldest, #found / 2, found[#found] or '', found[#found - 1] or ''}",
    ])
}

/// KEYS: a workflow's leases in one bucket. ARGV: the page's position (score, member), its size,
/// the attempts that make a key stuck. One page of the started keys: `{members read, the last
/// one's score, the last member, {lease end, tenant, key} of each stuck one (its lease over, or
/// that many attempts at one recovery point)}`.
pub(crate) fn stuck_page() -> ReadOnly {
    read_only(&[
        NOW,
        PAGE,
        "local found = page(KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])) \
         local stuck = {} \
         for at = 1, #found, 2 do \
             local ends = tonumber(found[at + 1]) \
             local held = redis.call('HMGET', found[at], 't', 'k', 'att') \
             if held[1] and held[2] and (ends <= now or \
                 (tonumber(held[3]) or 1) >= tonumber(ARGV[4])) then \
                 table.insert(stuck, {ends, held[1], held[2]}) \
             end \
         end \
         return {#found / 2, found[#found] or '', found[#found - 1] or '', stuck}",
    ])
}
