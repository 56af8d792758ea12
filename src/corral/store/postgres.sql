-- PostgreSQL's own statements (postgres.py), loaded beside queries.sql, whose fragments
-- (`{claimable}`, `{qualified_columns}`) they include.

-- name: finish_many
-- Group commit in one statement: start the next tasks, commit the finished ones, and announce
-- a freed serial key, if any, to other processes.
WITH started AS (
    UPDATE corral_tasks SET attempts = attempts + 1, started_at = :now, started_in_group = :grp
    FROM unnest(:s_ids::text[], :s_tokens::text[]) AS s(id, token)
    WHERE corral_tasks.id = s.id AND corral_tasks.status = 'running'
      AND corral_tasks.lease_token = s.token AND corral_tasks.started_at IS NULL
      AND (:grp = 0 OR corral_tasks.run_alone = 0)
    RETURNING corral_tasks.id),
done AS (
    UPDATE corral_tasks SET status = 'succeeded', result = f.result, lease_token = NULL,
        lease_expires_at = NULL, finished_at = :now
    FROM unnest(:ids::text[], :tokens::text[], :results::text[]) AS f(id, token, result)
    WHERE corral_tasks.id = f.id AND corral_tasks.status = 'running'
      AND corral_tasks.lease_token = f.token
    RETURNING corral_tasks.id, corral_tasks.serial_key)
SELECT id, serial_key,
       CASE WHEN serial_key IS NULL THEN NULL ELSE pg_notify(:channel, '') END AS notified
FROM done

-- name: claim_starts
-- Whether a picked row starts now (queries.sql's `claim_starts`, over the array of picks).
array_position(p.a, corral_tasks.seq) <= :start
AND ((:grp = 0 AND (:start <= 1 OR cardinality(p.a) <= 1)) OR corral_tasks.run_alone = 0)

-- name: claim
-- The claim. The picked rows' seqs go in one array: the update then finds them through the
-- primary key (joined to a ranked subquery instead, the planner hashes the whole table, which
-- grows with every stored result). Its commit is asynchronous (`synchronous_commit` off for
-- this transaction only): a claim the database loses in a crash only puts tasks back (their
-- leases, hence their commits, are gone: at-least-once holds), and a result's synchronous
-- commit flushes every claim before it anyway. It spares a WAL flush per claim. Each lease
-- token starts with the claim's `:nonce`, which nothing else knows (`claimed`).
WITH p AS (SELECT ARRAY(SELECT t.seq FROM corral_tasks t
                        WHERE t.model = :model AND {claimable}
                        ORDER BY t.interactive DESC, t.priority DESC,
                                 COALESCE(t.turn, t.seq), t.seq
                        LIMIT :limit FOR UPDATE SKIP LOCKED) AS a,
                  set_config('synchronous_commit', 'off', true) AS async_commit)
UPDATE corral_tasks SET status = 'running',
    attempts = attempts + CASE WHEN {claim_starts} THEN 1 ELSE 0 END,
    started_at = CASE WHEN {claim_starts} THEN :now ELSE NULL END,
    started_in_group = CASE WHEN {claim_starts} AND (:grp = 1 OR (:start > 1 AND cardinality(p.a) > 1))
                       THEN 1 ELSE 0 END,
    lease_token = :nonce || lpad(to_hex(corral_tasks.seq), 16, '0'),
    lease_expires_at = :expires, worker_id = :worker
FROM p
WHERE corral_tasks.seq = ANY(p.a)
RETURNING {qualified_columns}

-- name: claimed
-- A claim whose connection dropped while it committed: the tasks it leased, if it did.
SELECT {qualified_columns} FROM corral_tasks
WHERE worker_id = :worker AND status = 'running' AND left(lease_token, 32) = :nonce

-- name: announce
-- Tell other processes that tasks may have become claimable (delivered on commit).
SELECT pg_notify(:channel, '')

-- name: notify
-- `announce` as a statement's final SELECT ({channel}: the store's, an identifier).
SELECT pg_notify('{channel}', '') AS notified

-- name: kind_lock
-- Serialise the submitters of one bounded kind for the rest of the transaction.
SELECT pg_advisory_xact_lock(hashtext('corral_kind:' || :kind)) AS x

-- name: migrate_lock
-- One process at a time migrates a schema (several starting at once on a new database).
SELECT pg_advisory_xact_lock(hashtext('corral_migrate:' || current_schema())) AS x
