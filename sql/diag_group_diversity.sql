-- Diagnostics: answer diversity and effective group size of GRPO groups, per run and policy version.
--
-- Answers: are groups collapsing (every member writing the same response) and
-- how many members of a group really carry gradient signal? Over valid
-- members (as in quality.sql) of groups with at least 2 of them.
-- unique_answer_ratio of a group = distinct response token sequences / valid
-- members (1: all different; 1/n: collapsed). effective_group_size = Kish's
-- effective sample size of the centred rewards a_i = reward_i - group mean:
-- (sum |a_i|)^2 / sum a_i^2, and 0 for a group without reward spread
-- (max = min): n when every member pulls equally, near 1 when one outlier
-- carries the whole group.
--
-- Parameters:
-- @param run_id = NULL      only this experiment (NULL: every run)
--
-- Columns:
--   run_id
--   policy_version              the group's oldest member policy_version
--   groups                      groups with >= 2 valid members
--   mean_valid_members          mean valid members per group
--   mean_unique_answer_ratio    mean over groups of unique_answer_ratio
--   collapsed_groups            groups whose valid members all wrote the same response
--   mean_effective_group_size   mean over groups of effective_group_size
--   no_signal_groups            groups without reward spread (effective_group_size 0)
WITH v AS (
    SELECT run_id, group_id, policy_version, response_ids, reward
    FROM trajectories
    WHERE ($run_id::VARCHAR IS NULL OR run_id = $run_id::VARCHAR)
      AND status NOT IN ('INFRA_FAILED', 'EXPIRED') AND verdict IN ('PASS', 'FAIL') AND reward IS NOT NULL
),
mu AS (
    SELECT run_id, group_id, avg(reward) AS mean_reward FROM v GROUP BY run_id, group_id
),
g AS (
    SELECT v.run_id, v.group_id, min(v.policy_version) AS policy_version, count(*) AS n,
           count(DISTINCT v.response_ids) AS distinct_answers,
           max(v.reward) > min(v.reward) AS spread,
           sum(abs(v.reward - mu.mean_reward)) AS s1,
           sum((v.reward - mu.mean_reward) * (v.reward - mu.mean_reward)) AS s2
    FROM v JOIN mu USING (run_id, group_id)
    GROUP BY v.run_id, v.group_id
    HAVING count(*) >= 2
)
SELECT
    run_id,
    policy_version,
    count(*) AS groups,
    avg(n) AS mean_valid_members,
    avg(distinct_answers / n) AS mean_unique_answer_ratio,
    count(*) FILTER (WHERE distinct_answers = 1) AS collapsed_groups,
    avg(CASE WHEN spread THEN s1 * s1 / s2 ELSE 0 END) AS mean_effective_group_size,
    count(*) FILTER (WHERE NOT spread) AS no_signal_groups
FROM g
GROUP BY run_id, policy_version
ORDER BY run_id, policy_version
