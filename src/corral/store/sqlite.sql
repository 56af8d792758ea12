-- SQLite's own statements (sqlite.py), loaded beside queries.sql. Group commit
-- (`finish_many`): the rows come in as one JSON array of [id, token(, result)] each.

-- name: start_many
UPDATE corral_tasks SET attempts = attempts + 1, started_at = :now, started_in_group = 1
FROM (SELECT value ->> 0 AS id, value ->> 1 AS token FROM json_each(:items)) AS s
WHERE corral_tasks.id = s.id AND corral_tasks.status = 'running'
  AND corral_tasks.lease_token = s.token AND corral_tasks.started_at IS NULL
  AND corral_tasks.run_alone = 0

-- name: finish_many
UPDATE corral_tasks SET status = 'succeeded', result = f.result, lease_token = NULL,
    lease_expires_at = NULL, finished_at = :now
FROM (SELECT value ->> 0 AS id, value ->> 1 AS token, value ->> 2 AS result
      FROM json_each(:items)) AS f
WHERE corral_tasks.id = f.id AND corral_tasks.status = 'running'
  AND corral_tasks.lease_token = f.token
RETURNING corral_tasks.id, corral_tasks.serial_key

-- name: ping
SELECT 1 AS x
