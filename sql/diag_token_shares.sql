-- Diagnostics: action-token share and repeated-token share of responses, per run and policy version.
--
-- Answers: how much of each response the policy actually wrote (versus tool
-- observations), and is it degenerating into repetition? Over every
-- trajectory. Action tokens are the response tokens with loss_mask 1.
-- repeated_token_share of a trajectory = 1 - distinct action token ids /
-- action tokens (0: no token id repeats; near 1: one token over and over).
--
-- Parameters:
-- @param run_id = NULL      only this experiment (NULL: every run)
--
-- Columns:
--   run_id, policy_version
--   trajectories
--   response_tokens             all response tokens (policy and observation)
--   action_tokens               response tokens with loss_mask 1
--   action_token_share          action_tokens / response_tokens
--   mean_repeated_token_share   mean over trajectories of repeated_token_share
--   max_repeated_token_share    its largest value
WITH t AS (
    SELECT run_id, policy_version, len(response_ids) AS n_tokens,
           list_filter(response_ids, lambda x, i: loss_mask[i] = 1) AS action
    FROM trajectories
    WHERE $run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR
),
r AS (
    SELECT run_id, policy_version, n_tokens, len(action) AS n_action,
           CASE WHEN len(action) > 0 THEN 1 - len(list_distinct(action)) / len(action) END AS repeated
    FROM t
)
SELECT
    run_id,
    policy_version,
    count(*) AS trajectories,
    sum(n_tokens) AS response_tokens,
    sum(n_action) AS action_tokens,
    sum(n_action) / sum(n_tokens) AS action_token_share,
    avg(repeated) AS mean_repeated_token_share,
    max(repeated) AS max_repeated_token_share
FROM r
GROUP BY run_id, policy_version
ORDER BY run_id, policy_version
