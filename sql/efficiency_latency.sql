-- Latency p50/p95/p99 of generation, tool and verification time per policy version, from the events table.
--
-- Answers: where does an episode's wall time go? Each event's span is the time
-- until the next event of the same episode (ordered by created_at, then
-- step_id, then lifecycle order of event_type for equal times). The span of a
--   GENERATING event is generation time (the model's turn),
--   ACTION_COMMITTED event is tool time (committed -> executed),
--   VERIFYING event is verification time (verifying -> terminal).
-- The last event of an episode has no span. Percentiles are continuous.
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
--
-- Columns:
--   run_id, policy_version (of the event), phase (generation / tool / verification)
--   spans                   events measured
--   mean_ms, p50_ms, p95_ms, p99_ms, max_ms
WITH e AS (
    SELECT
        run_id, policy_version, event_type,
        epoch_us(lead(created_at) OVER w) - epoch_us(created_at) AS span_us
    FROM events
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
    WINDOW w AS (
        PARTITION BY episode_id
        ORDER BY created_at, step_id,
                 list_position(['CREATED', 'GENERATING', 'TOOL_WAITING', 'ACTION_COMMITTED', 'ACTION_EXECUTED',
                                'OBSERVATION_PERSISTED', 'VERIFYING', 'TERMINAL'], event_type),
                 action_id
    )
),
p AS (
    SELECT
        run_id, policy_version,
        CASE event_type WHEN 'GENERATING' THEN 'generation'
                        WHEN 'ACTION_COMMITTED' THEN 'tool'
                        WHEN 'VERIFYING' THEN 'verification' END AS phase,
        span_us / 1e3 AS span_ms
    FROM e
    WHERE event_type IN ('GENERATING', 'ACTION_COMMITTED', 'VERIFYING') AND span_us IS NOT NULL
)
SELECT
    run_id,
    policy_version,
    phase,
    count(*) AS spans,
    avg(span_ms) AS mean_ms,
    quantile_cont(span_ms, 0.5) AS p50_ms,
    quantile_cont(span_ms, 0.95) AS p95_ms,
    quantile_cont(span_ms, 0.99) AS p99_ms,
    max(span_ms) AS max_ms
FROM p
GROUP BY run_id, policy_version, phase
ORDER BY run_id, policy_version, phase
