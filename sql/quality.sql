-- Quality per policy version: success rate, hard-constraint pass rate, reward mean/std, reward-length correlation.
--
-- Answers: is the policy getting better, is it still obeying the hard
-- constraints, and is reward being bought with length?
-- Valid member: status not INFRA_FAILED/EXPIRED, verdict PASS or FAIL, reward
-- not null; every rate and statistic below is over valid members only.
-- Hard constraint: reward_components[$hard_component] >= $hard_threshold
-- (the verifier's gate component, 'format' for the built-in tasks); members
-- without that component are left out of the rate (null when none has it).
-- Length = len(response_ids) (model + observation tokens).
--
-- Parameters:
-- @param run_id = NULL                 only this experiment (NULL: every run)
-- @param hard_component = 'format'     reward component that encodes the hard constraint
-- @param hard_threshold = 1.0          pass when the component is >= this
--
-- Columns:
--   run_id, policy_version
--   trajectories, valid_members
--   success_rate               verdict PASS / valid_members
--   hard_constraint_pass_rate  component >= threshold / valid members with the component
--   reward_mean, reward_std    population std
--   reward_length_corr         Pearson correlation of reward and response length (null when either is constant)
--   response_tokens_mean
WITH t AS (
    SELECT
        run_id, policy_version, verdict, reward,
        len(response_ids) AS response_tokens,
        reward_components[$hard_component::VARCHAR] AS hard_value,
        status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL AS valid
    FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
)
SELECT
    run_id,
    policy_version,
    count(*) AS trajectories,
    count(*) FILTER (WHERE valid) AS valid_members,
    avg(CASE WHEN verdict = 'PASS' THEN 1 ELSE 0 END) FILTER (WHERE valid) AS success_rate,
    avg(CASE WHEN hard_value >= $hard_threshold::DOUBLE THEN 1 ELSE 0 END)
        FILTER (WHERE valid AND hard_value IS NOT NULL) AS hard_constraint_pass_rate,
    avg(reward) FILTER (WHERE valid) AS reward_mean,
    stddev_pop(reward) FILTER (WHERE valid) AS reward_std,
    CASE WHEN stddev_pop(reward) FILTER (WHERE valid) > 0
          AND stddev_pop(response_tokens) FILTER (WHERE valid) > 0
         THEN corr(reward, response_tokens) FILTER (WHERE valid) END AS reward_length_corr,
    avg(response_tokens) FILTER (WHERE valid) AS response_tokens_mean
FROM t
GROUP BY run_id, policy_version
ORDER BY run_id, policy_version
