-- The rollout engine per run: how long it generated, its share of the workers' wall time, and the waits per
-- stage (queue for the engine, tool, verifier) as p50/p95, from the events the streaming harness records.
--
-- Answers: did the engine sit idle while tools and verifiers ran, and where did episodes wait? The harness
-- stamps every generated turn (the payload of its ACTION_COMMITTED, VERIFYING or TERMINAL event) with the
-- engine call that produced it (batch, gen_ms) and how long the episode was ready before it (queue_ms);
-- ACTION_EXECUTED carries the tool call's wait from queued to answered (waited_ms, injected_ms of it injected
-- by the latency model); a TERMINAL after verification carries the verifier's (waited_ms). Engine busy time
-- counts each engine call once (a vLLM request's gen_ms overlaps the others': its busy time is an upper
-- bound). The wall of a worker is its first CREATED to its last TERMINAL; busy_share = engine_busy_s / the
-- sum of the workers' walls (one engine per worker). Events written before harness/2 have no stamps: their
-- columns are NULL.
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id
--   workers                  worker ids seen
--   episodes                 episodes with a TERMINAL event
--   engine_calls, engine_busy_s, wall_s (sum over workers), busy_share
--   queue_p50_ms, queue_p95_ms       ready -> engine call
--   tool_p50_ms, tool_p95_ms         tool call queued -> answered
--   verify_p50_ms, verify_p95_ms     verifier call queued -> answered
--   injected_tool_ms                 mean injected tool latency (0 without a latency model)
WITH e AS (
    SELECT run_id, worker_id, episode_id, event_type, created_at, payload
    FROM events
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
),
turns AS (
    SELECT run_id, json_extract_string(payload, '$.batch') AS batch,
           CAST(json_extract(payload, '$.gen_ms') AS DOUBLE) AS gen_ms,
           CAST(json_extract(payload, '$.queue_ms') AS DOUBLE) AS queue_ms
    FROM e
    WHERE event_type IN ('ACTION_COMMITTED', 'VERIFYING', 'TERMINAL') AND json_extract(payload, '$.batch') IS NOT NULL
),
calls AS (
    SELECT run_id, max(gen_ms) AS gen_ms FROM turns GROUP BY run_id, batch
),
busy AS (
    SELECT run_id, count(*) AS engine_calls, sum(gen_ms) / 1e3 AS engine_busy_s FROM calls GROUP BY run_id
),
queue AS (
    SELECT run_id, quantile_cont(queue_ms, 0.5) AS queue_p50_ms, quantile_cont(queue_ms, 0.95) AS queue_p95_ms
    FROM turns GROUP BY run_id
),
tools AS (
    SELECT run_id,
           quantile_cont(CAST(json_extract(payload, '$.waited_ms') AS DOUBLE), 0.5) AS tool_p50_ms,
           quantile_cont(CAST(json_extract(payload, '$.waited_ms') AS DOUBLE), 0.95) AS tool_p95_ms,
           avg(CAST(json_extract(payload, '$.injected_ms') AS DOUBLE)) AS injected_tool_ms
    FROM e WHERE event_type = 'ACTION_EXECUTED' AND json_extract(payload, '$.waited_ms') IS NOT NULL
    GROUP BY run_id
),
verifies AS (
    SELECT run_id,
           quantile_cont(CAST(json_extract(payload, '$.waited_ms') AS DOUBLE), 0.5) AS verify_p50_ms,
           quantile_cont(CAST(json_extract(payload, '$.waited_ms') AS DOUBLE), 0.95) AS verify_p95_ms
    FROM e WHERE event_type = 'TERMINAL' AND json_extract(payload, '$.waited_ms') IS NOT NULL
    GROUP BY run_id
),
walls AS (
    SELECT run_id, count(*) AS workers, sum(wall_s) AS wall_s
    FROM (SELECT run_id, worker_id,
                 (epoch_us(max(created_at) FILTER (WHERE event_type = 'TERMINAL'))
                  - epoch_us(min(created_at) FILTER (WHERE event_type = 'CREATED'))) / 1e6 AS wall_s
          FROM e GROUP BY run_id, worker_id)
    GROUP BY run_id
),
eps AS (
    SELECT run_id, count(DISTINCT episode_id) AS episodes FROM e WHERE event_type = 'TERMINAL' GROUP BY run_id
)
SELECT
    w.run_id,
    w.workers,
    eps.episodes,
    b.engine_calls,
    b.engine_busy_s,
    w.wall_s,
    b.engine_busy_s / nullif(w.wall_s, 0) AS busy_share,
    q.queue_p50_ms, q.queue_p95_ms,
    t.tool_p50_ms, t.tool_p95_ms,
    v.verify_p50_ms, v.verify_p95_ms,
    coalesce(t.injected_tool_ms, 0) AS injected_tool_ms
FROM walls w
LEFT JOIN eps USING (run_id)
LEFT JOIN busy b USING (run_id)
LEFT JOIN queue q USING (run_id)
LEFT JOIN tools t USING (run_id)
LEFT JOIN verifies v USING (run_id)
ORDER BY w.run_id
