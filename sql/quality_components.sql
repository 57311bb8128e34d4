-- Reward components over time: mean of each named reward component per time bucket (UTC).
--
-- Answers: which parts of the reward (task_success, format, tool_cost, ...)
-- move over time — is the reward rising because the task is solved or because
-- a shaping term is being farmed? Over valid members (as in quality.sql).
--
-- Parameters:
-- @param run_id = NULL      only this experiment (NULL: every run)
-- @param bucket = 'hour'    date_trunc part: minute, hour, day, week, ...
--
-- Columns:
--   run_id
--   bucket        start of the bucket (UTC, timestamp without zone)
--   component     key of reward_components
--   n             members reporting the component
--   mean, std     population std
WITH kv AS (
    SELECT
        run_id,
        date_trunc($bucket::VARCHAR, timezone('UTC', finished_at)) AS bucket,
        unnest(map_entries(reward_components)) AS e
    FROM trajectories
    WHERE ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
      AND status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL
      AND reward_components IS NOT NULL
)
SELECT
    run_id,
    bucket,
    e.key AS component,
    count(e.value) AS n,
    avg(e.value) AS mean,
    stddev_pop(e.value) AS std
FROM kv
GROUP BY run_id, bucket, e.key
ORDER BY run_id, bucket, component
