-- Rollout throughput over time: trajectories and response tokens finished per second, per time bucket (UTC).
--
-- Answers: is generation keeping up, and did it slow down (an engine restart,
-- a slow tool, workers lost)? From trajectories by finished_at: trajectories
-- and response tokens finished in each bucket, divided by the bucket's length.
-- A partly covered first or last bucket reads low.
--
-- Parameters:
-- @param run_id = NULL     only this experiment (NULL: every run)
-- @param bucket = 'hour'   date_trunc part: second, minute, hour, day, week
--
-- Columns:
--   run_id, bucket (start of the bucket, UTC)
--   trajectories              finished in the bucket
--   response_tokens           their response tokens
--   trajectories_per_s, tokens_per_s   per second of the bucket
WITH t AS (
    SELECT run_id, date_trunc($bucket::VARCHAR, timezone('UTC', finished_at)) AS bucket, response_len
    FROM trajectories
    WHERE finished_at IS NOT NULL AND ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
)
SELECT
    run_id,
    bucket,
    count(*) AS trajectories,
    sum(response_len) AS response_tokens,
    count(*) / (epoch(bucket + ('1 ' || $bucket::VARCHAR)::INTERVAL) - epoch(bucket)) AS trajectories_per_s,
    sum(response_len) / (epoch(bucket + ('1 ' || $bucket::VARCHAR)::INTERVAL) - epoch(bucket)) AS tokens_per_s
FROM t
GROUP BY run_id, bucket
ORDER BY run_id, bucket
