-- Quality over time: success rate and reward per time bucket of finished_at (UTC).
--
-- Answers: how do success and reward move over wall-clock time (across policy
-- versions)? Same valid-member definition as quality.sql.
--
-- Parameters:
-- @param run_id = NULL      only this experiment (NULL: every run)
-- @param bucket = 'hour'    date_trunc part: minute, hour, day, week, ...
--
-- Columns:
--   run_id
--   bucket                   start of the bucket (UTC, timestamp without zone)
--   trajectories, valid_members
--   success_rate             verdict PASS / valid_members
--   reward_mean
--   policy_version_min, policy_version_max   versions that finished in the bucket
WITH t AS (
    SELECT
        run_id, policy_version, verdict, reward,
        date_trunc($bucket::VARCHAR, timezone('UTC', finished_at)) AS bucket,
        status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL AS valid
    FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
)
SELECT
    run_id,
    bucket,
    count(*) AS trajectories,
    count(*) FILTER (WHERE valid) AS valid_members,
    avg(CASE WHEN verdict = 'PASS' THEN 1 ELSE 0 END) FILTER (WHERE valid) AS success_rate,
    avg(reward) FILTER (WHERE valid) AS reward_mean,
    min(policy_version) AS policy_version_min,
    max(policy_version) AS policy_version_max
FROM t
GROUP BY run_id, bucket
ORDER BY run_id, bucket
